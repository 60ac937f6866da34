"""Ranks, bootstrap and collectives: one code path for every way of launching.

Detection order (first match wins):
  1. torchrun / torch.distributed.launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
  2. MPI (mpiexec / mpirun, MPICH or Open MPI): PMI_SIZE or OMPI_COMM_WORLD_SIZE.
     mpi4py gives rank/size and the node-local size; rank 0 picks a free port and
     broadcasts the rendezvous address over MPI.
  3. srun: SLURM_STEP_NUM_TASKS (set for job steps only, not in the batch script),
     SLURM_PROCID, SLURM_LOCALID; the rendezvous host is the first node of
     SLURM_STEP_NODELIST and the port MASTER_PORT or one derived from the job id.
  4. A single process: no process group at all, every collective is the identity.

MPI only launches and bootstraps; tensors travel over torch.distributed with gloo
on CPU and NCCL on GPU when every rank of a node has a GPU of its own. Ranks that share a
GPU (more ranks on a node than GPUs) cannot use NCCL, which refuses two ranks on one device:
their collectives go over gloo, staged through host memory. The ranks agree on the backend
from every rank's view before the process group exists (:func:`agree_backend`).
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .errors import ConfigError, FedHPCError, RankFailure
from .hostlist import first_host


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


BACKENDS = ("auto", "nccl", "gloo")


def exact_sum_step(bound: float, terms: int) -> float:
    """The grid step on which ``terms`` values within [-bound, bound] sum exactly in float64.

    Multiples of 2**e of magnitude below 2**(e+53) are exact doubles, and so is every partial
    sum of at most ``terms`` of them when bound * terms <= 2**(e+52): the all-reduce then gives
    the same bits for any number of ranks and any reduction order.
    """
    if not (bound > 0 and terms >= 1):
        raise ValueError(f"exact_sum_step needs bound > 0 and terms >= 1, got {bound}, {terms}")
    return 2.0 ** (math.ceil(math.log2(bound * terms)) - 52)


def gpu_numerics(deterministic: bool) -> None:
    """How this process's GPU kernels compute: the same numbers every time, or the fastest.

    Deterministic (the default): float32 convolutions and matrix products in full float32
    (cuDNN's TF32 default is off), cuDNN's deterministic algorithms without autotuning, and
    cuBLAS with a fixed workspace. Then a seed gives the same model on 1 or N ranks, ranks
    sharing a GPU, batched or sequential clients, and from run to run: measured on an H100,
    TF32 alone moved a digits CNN by 3e-4 (ranks sharing vs one rank) and 9e-4 (batched vs
    sequential). torch is told to use deterministic algorithms with warn_only, so an op
    without one warns (once) instead of stopping a run. ``deterministic=False`` allows TF32
    and cuDNN's autotuner (faster convolutions; results then vary in the 4th digit).
    """
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        # cuBLAS reuses workspace across streams nondeterministically unless it is fixed,
        # and reads this once, at its first handle: set before any matrix product runs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # ... but no NaN-filling of every torch.empty (its default under that flag): an extra write
    # per allocation that fedhpc, which never reads memory it did not write, does not need
    torch.utils.deterministic.fill_uninitialized_memory = False


def agree_backend(views: List[dict], requested: str = "auto"):
    """(backend, note): which torch.distributed backend carries the ranks' tensors, decided from
    every rank's view so that all ranks decide alike (one picking NCCL while another picks gloo
    hangs init_process_group; a refusal raised on one node alone leaves the others waiting there).

    ``views[r]``: rank r's host, whether it runs on a GPU (``cuda``), that GPU's UUID (``gpu``, or
    None where torch cannot say) and its node's ``ranks`` and ``gpus`` as :func:`gpu_layout` reads
    them.

    * CPU runs: gloo; so is a run where some ranks have no GPU (their peers stage through host memory).
    * GPU runs with a GPU per rank: NCCL (GPU-direct, the fastest).
    * GPU runs where ranks share a GPU: gloo, staged through host memory. NCCL refuses two
      ranks on one device ("Duplicate GPU detected"), so it is no option there. Sharing is read
      from the UUIDs when every rank has one (this sees any binding: --gpu-bind, a
      CUDA_VISIBLE_DEVICES of one's own), else from the layout (more ranks than GPUs on a node).
      The note says what gloo costs and the usual better layout for small models: one rank per
      GPU training several clients at once (``--clients-at-once``), measured in benchmarks/RESULTS.md.

    ``requested`` ("auto", "nccl", "gloo") overrides the choice where that can work, and a
    request that cannot (NCCL on CPU, NCCL with shared GPUs) is a ConfigError naming the fix.
    """
    if requested not in BACKENDS:
        raise ConfigError(f"--collective-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    on_cpu = [r for r, v in enumerate(views) if not v["cuda"]]
    if on_cpu:
        if requested == "nccl":
            where = "" if len(on_cpu) == len(views) else f" on every rank, but rank(s) {_ranks(on_cpu)} have none"
            raise ConfigError(f"--collective-backend nccl needs GPUs (--device cuda){where}; CPU runs use gloo: "
                              f"drop the option or set it to auto")
        if len(on_cpu) == len(views):
            return "gloo", ""
        return "gloo", (f"collectives over gloo through host memory (rank(s) {_ranks(on_cpu)} have no GPU); "
                        f"give every rank a GPU, or run all on CPU with --device cpu")
    shared, fix = _shared_gpus(views)
    if requested == "nccl" and shared:
        raise ConfigError(f"--collective-backend nccl needs one rank per GPU, but {shared}. {fix}, or use "
                          f"--collective-backend gloo (or auto)")
    if requested == "gloo" or shared:
        why = (f"{shared} and NCCL needs one rank per GPU" if shared else "--collective-backend gloo")
        return "gloo", (f"collectives over gloo through host memory ({why}); for small models one rank per GPU "
                        f"with --clients-at-once K is usually faster")
    return "nccl", ""


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _shared_gpus(views: List[dict]) -> tuple:
    """(what is shared, the fix) for GPU views, or ("", "") when every rank has a GPU of its own."""
    if all(v.get("gpu") for v in views):
        users: dict = {}
        for r, v in enumerate(views):
            users.setdefault((v["host"], v["gpu"]), []).append(r)
        for (host, _), ranks in users.items():
            if len(ranks) > 1:
                return (f"ranks {_ranks(ranks)} share one GPU on {host}",
                        "Give each rank its own GPU (srun --gpus-per-task=1, or a --gpu-bind / "
                        "CUDA_VISIBLE_DEVICES that maps ranks to distinct GPUs; train several clients per "
                        "rank at once with --clients-at-once K)")
        return "", ""
    for v in views:
        if v["ranks"] > v["gpus"]:
            return (f"{v['ranks']} ranks share {v['gpus']} GPU(s) on {v['host']}",
                    f"Launch at most {v['gpus']} rank(s) per node (and train several clients per rank at "
                    f"once with --clients-at-once K)")
    return "", ""


def gpu_uuid(device: torch.device) -> Optional[str]:
    """The UUID of ``device``, which tells two ranks on one GPU apart from two on two GPUs
    whatever each one's CUDA_VISIBLE_DEVICES calls them; None where torch cannot say."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001 - older torch, or no real GPU behind a mocked one
        return None
    # an all-zero UUID (seen from some virtualised GPUs) would make every GPU look like one
    return uuid if uuid.strip("0-") else None


def exchange_views(store, rank: int, size: int, view: dict) -> List[dict]:
    """Every rank's ``view``, in rank order, through the rendezvous store (before any process
    group exists: which group to create is what the views decide)."""
    import json

    store.set(f"fedhpc_view/{rank}", json.dumps(view))
    views = [json.loads(store.get(f"fedhpc_view/{r}")) for r in range(size)]
    # Rank 0 hosts the store: it waits until every rank has read every view, so that when the
    # views make every rank raise the same ConfigError, none finds the store gone mid-read.
    store.set(f"fedhpc_view_read/{rank}", "1")
    if rank == 0:
        store.wait([f"fedhpc_view_read/{r}" for r in range(size)])
    return views


def rendezvous_store(init_method: str, rank: int, size: int, timeout: timedelta):
    """The store init_process_group would make from ``init_method`` (rank 0 hosts it, or the
    torchrun agent's), made here so that the ranks can agree on a backend before the group."""
    store, _, _ = next(dist.rendezvous(init_method, rank, size, timeout=timeout))
    store.set_timeout(timeout)
    return store


# ------------------------------------------------------------- the node layout under srun
# Pure functions of the environment (and of what this process sees), so that each rule can be
# tested without SLURM; World reads os.environ through them.

def expand_tasks_per_node(spec: str, var: str = "SLURM_STEP_TASKS_PER_NODE") -> List[int]:
    """SLURM's compressed count list, one entry per node: ``2(x3),1`` -> [2, 2, 2, 1].

    Each comma-separated item is ``N`` or ``N(xM)`` (M nodes with N tasks). Anything else is a
    ConfigError naming the variable: a wrong count would otherwise surface as oversubscribed
    cores or a wrong backend, far from its cause.
    """
    counts: List[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ConfigError(f"{var}={spec!r}: {item!r} is not a task count N or N(xM) "
                              f"(SLURM writes e.g. 2(x3),1)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_tasks_per_node(env) -> tuple:
    """(tasks on this node, tasks on the busiest node of the step), from srun's variables.

    SLURM_STEP_TASKS_PER_NODE (SLURM_TASKS_PER_NODE outside a step) lists every node's count
    in the compressed form; SLURM_NODEID (this node's index in the step) picks this node's.
    Without SLURM_NODEID the first node's count stands for every node, as before.
    """
    var = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
    counts = expand_tasks_per_node(env.get(var, "1"), var)
    node = env.get("SLURM_NODEID")
    if node is None:
        return counts[0], max(counts)
    if not node.strip().isdigit() or int(node) >= len(counts):
        raise ConfigError(f"SLURM_NODEID={node!r} does not index the {len(counts)} node(s) of "
                          f"{var}={env.get(var)!r}")
    return counts[int(node)], max(counts)


# Binding types under which srun gives each task CPUs of its own (task/affinity turns cores and
# threads, and its automatic binding, into one mask_cpu entry per task); sockets, ldoms and
# boards hand several tasks the same domain.
_PER_TASK_BINDS = {"cores", "threads", "mask_cpu", "map_cpu", "rank"}
_SHARED_BINDS = {"sockets", "ldoms", "boards", "rank_ldom", "map_ldom", "mask_ldom"}


def _cpu_masks(listed: str) -> Optional[List[int]]:
    """SLURM_CPU_BIND_LIST's hexadecimal masks (``0x3,0xC``, ``F*2``), or None if unreadable."""
    masks: List[int] = []
    try:
        for item in listed.split(","):
            mask, _, repeat = item.strip().partition("*")
            masks += [int(mask, 16)] * (int(repeat) if repeat else 1)
    except ValueError:
        return None
    return masks or None


def ranks_sharing_cores(env, launcher: str, local_rank: int, local_size: int) -> tuple:
    """(ranks, bound): how many of this node's ranks divide this process's affinity mask.

    Not bound (``bound`` False): the mask is the whole step's (or node's), shared by all
    ``local_size`` ranks. Bound: srun gave this task its own CPUs (``--cpu-bind=cores`` in
    slurm/step.sh, or task/affinity's automatic binding), so sched_getaffinity already shows
    this rank's share and is not divided again; ``ranks`` is 1, or the number of this node's
    tasks whose masks in SLURM_CPU_BIND_LIST overlap this task's where that list says so.

    srun bound the task when SLURM_CPU_BIND_TYPE (else the type part of SLURM_CPU_BIND) names
    a per-task binding and not "none". Only srun's own tasks are read so: under torchrun or
    mpiexec started inside an srun task, the ranks inherit that one task's variables and mask
    and share it. A mask smaller than the node is no signal: a job's cgroup also shrinks the
    mask of an unbound step.
    """
    if launcher != "srun":
        return local_size, False
    bind = env.get("SLURM_CPU_BIND", "")
    kind = env.get("SLURM_CPU_BIND_TYPE")
    if kind is None:
        kind = bind.split(":", 1)[0]        # "quiet,cores,mask_cpu:0x3,0xC" -> its type part
    types = {t.strip() for t in kind.split(":", 1)[0].split(",")} - {"", "quiet", "verbose"}
    if not types or "none" in types or not (types & _PER_TASK_BINDS):
        return local_size, False
    masks = None
    if "mask_cpu" in types:
        listed = env.get("SLURM_CPU_BIND_LIST") or (bind.split(":", 1)[1] if ":" in bind else "")
        masks = _cpu_masks(listed) if listed else None
    if masks is None:
        # no list to compare: a per-task type alone is trusted, a socket/ldom binding is not
        return (local_size, False) if types & _SHARED_BINDS else (1, True)
    mine = masks[local_rank % len(masks)]
    if not mine:
        return local_size, False
    return sum(1 for t in range(local_size) if masks[t % len(masks)] & mine), True


def threads_per_rank(requested: int, cores: int, ranks: int, bound: bool = False) -> tuple:
    """(threads, note): ``requested`` or, at 0 (auto), this process's cores / ranks sharing them.

    ``note`` (said once, by rank 0) is set when the threads oversubscribe those cores.
    """
    cores = cores or 1
    auto = max(1, cores // max(1, ranks))
    threads = requested or auto
    note = ""
    if threads * ranks > cores:
        if bound:
            shared = f" shared by {ranks} rank(s)" if ranks > 1 else ""
            note = (f"{threads} thread(s) per rank exceed the {cores} core(s) srun bound this rank to{shared}: "
                    f"rounds run slower than with fewer; drop --threads (then the rank's bound cores) "
                    f"or set it to {auto}")
        else:
            note = (f"{threads} thread(s) per rank x {ranks} rank(s) on this node exceed its {cores} core(s): "
                    f"rounds run slower than with fewer; drop --threads (then cores / ranks on the node) "
                    f"or set it to {auto}")
    return threads, note


def _gpu_count(value: Optional[str]) -> Optional[int]:
    """SLURM_GPUS_ON_NODE (``4``) or SLURM_GPUS_PER_TASK (``1``, ``a100:1``, ``a100:1,v100:1``)
    as a count; None where absent, zero or unreadable."""
    if not value:
        return None
    total = 0
    for item in value.split(","):
        count = item.rsplit(":", 1)[-1].strip()
        if not count.isdigit():
            return None
        total += int(count)
    return total or None


def gpu_layout(env, launcher: str, local_size: int, busiest: int, visible: int) -> tuple:
    """(ranks, gpus) of this node for :func:`agree_backend`: shared GPUs when ranks > gpus.

    ``visible`` is torch.cuda.device_count() in this process. The rule:

    * srun, and this task's view is private: the step holds G GPUs on this node
      (SLURM_GPUS_ON_NODE, which SLURM sets to the step's count on the node, not the task's;
      else SLURM_GPUS_PER_TASK x tasks on the node) and ``visible`` x local_size <= G, so
      every task can have ``visible`` GPUs of its own, as --gpus-per-task's implied
      --gpu-bind=per_task gives them. Each rank then uses cuda:(local_rank % visible) of its
      own set (cuda:0 with one GPU per task): (local_size, G), never shared.
    * otherwise the ranks share what this task sees, as before: every task sees the same
      ``visible`` GPUs and rank i uses cuda:(i % visible). (busiest, visible), with
      ``busiest`` the step's largest tasks-per-node: a node with fewer tasks shares its GPUs
      as a fuller one does. (:func:`agree_backend` makes the ranks decide alike in any case;
      where every rank's GPU UUID is known, those decide sharing instead of this count.)

    CUDA_VISIBLE_DEVICES alone cannot tell the cases apart (a GPU shared by four tasks shows
    as ``0`` in each, as does a private one under device cgroups), nor can SLURM_STEP_GPUS (in
    a bound task it lists the task's own GPUs) or SLURM_JOB_GPUS (the job may hold more GPUs
    than this step). Unreadable SLURM GPU variables count as absent. Other launchers keep
    (local_size, visible): their local ranks are not SLURM's tasks.
    """
    if launcher == "srun" and visible > 0:
        on_node = _gpu_count(env.get("SLURM_GPUS_ON_NODE"))
        per_task = _gpu_count(env.get("SLURM_GPUS_PER_TASK"))
        if on_node is None and per_task is not None:
            on_node = per_task * local_size
        if on_node is not None and visible * local_size <= on_node:
            return local_size, on_node
        return busiest, visible
    return local_size, visible


class World:
    """This process's place among the ranks, and the collectives the engine uses."""

    def __init__(self, device: str = "auto", threads: int = 0, timeout: float = 600.0, backend: str = "auto",
                 deterministic: bool = True):
        self.launcher, self.rank, self.size, self.local_rank, self.local_size = "single", 0, 1, 0, 1
        self._mpi_comm = None
        init_method = None
        busiest = None  # tasks on the step's fullest node, where srun says
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
            self.launcher = "torchrun"
            self.rank, self.size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_rank = int(env.get("LOCAL_RANK", 0))
            self.local_size = int(env.get("LOCAL_WORLD_SIZE", 1))
            init_method = "env://"
        elif "PMI_SIZE" in env or "OMPI_COMM_WORLD_SIZE" in env:
            self.launcher = "mpi"
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            self._mpi_comm = comm
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
            node.Free()
            if self.size > 1:
                hosts = comm.allgather(socket.gethostname())
                addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
                port = comm.bcast(int(env["MASTER_PORT"]) if "MASTER_PORT" in env else
                                  (_free_port() if self.rank == 0 else None), root=0)
                init_method = f"tcp://{addr}:{port}"
        elif "SLURM_STEP_NUM_TASKS" in env and int(env["SLURM_STEP_NUM_TASKS"]) > 1:
            self.launcher = "srun"
            self.rank, self.size = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
            self.local_rank = int(env.get("SLURM_LOCALID", 0))
            self.local_size, busiest = slurm_tasks_per_node(env)
            nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
            addr = env.get("MASTER_ADDR") or first_host(nodelist)
            port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
            init_method = f"tcp://{addr}:{port}"

        # Threads per rank: MPI launchers drop torch to 1 thread, and several ranks on a node
        # must not oversubscribe it, so always set the count explicitly: this process's cores
        # divided among the ranks that share them (all of the node's, unless srun bound each
        # task to its own cores: ranks_sharing_cores).
        if hasattr(os, "sched_getaffinity"):
            cores = len(os.sched_getaffinity(0))
            sharing, bound = ranks_sharing_cores(env, self.launcher, self.local_rank, self.local_size)
        else:
            cores, sharing, bound = os.cpu_count(), self.local_size, False
        #: said once by rank 0: more threads than cores makes every rank wait for the others'
        self.threads, self.thread_note = threads_per_rank(threads, cores, sharing, bound)
        torch.set_num_threads(self.threads)

        use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        if use_cuda:
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was asked for but no GPU is visible; use --device cpu or auto")
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            gpu_numerics(deterministic)
        else:
            self.device = torch.device("cpu")
        ranks, gpus = gpu_layout(env, self.launcher, self.local_size, busiest or self.local_size,
                                 torch.cuda.device_count() if use_cuda else 0)
        view = {"host": socket.gethostname(), "cuda": use_cuda, "gpu": gpu_uuid(self.device) if use_cuda else None,
                "ranks": ranks, "gpus": gpus}
        store = None
        if self.size > 1:
            store = rendezvous_store(init_method, self.rank, self.size, timedelta(seconds=timeout))
            views = self._guard("rendezvous", exchange_views, store, self.rank, self.size, view)
        else:
            views = [view]
        # Every rank decides from the same views: they all pick one backend or all raise one error.
        self.backend, self.backend_note = agree_backend(views, backend)
        # gloo carries CPU tensors only as far as this code relies on: GPU tensors on a gloo run
        # go through a host copy in each collective (see _on_host)
        self._stage_on_host = use_cuda and self.backend == "gloo"
        if self.backend == "nccl":
            # NCCL's watchdog tears the process down on an error by default (mode 3), so a dead
            # peer would never reach our clear "exit 4, --resume" message. Mode 2 only aborts
            # the communicator and lets the collective raise; the user's own setting wins.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._timeout = timeout
        if self.size > 1:
            # under the prefix init_process_group gives a store it makes itself
            dist.init_process_group(self.backend, store=dist.PrefixStore("default_pg", store), rank=self.rank,
                                    world_size=self.size, timeout=timedelta(seconds=timeout))
        # Collectives on CPU tensors (objects, small metadata) go through gloo even on GPU runs.
        self._cpu_group = None
        if self.size > 1 and self.backend != "gloo":
            self._cpu_group = dist.new_group(backend="gloo")

    # ---------------------------------------------------------------- collectives
    def _guard(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (RuntimeError, dist.DistBackendError) as e:
            raise RankFailure(
                f"collective {what} failed on rank {self.rank} ({e.__class__.__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); a peer rank probably died or hung "
                f"(read the other ranks' output). The latest checkpoint is intact: rerun the same "
                f"command with --resume"
            ) from e

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor a collective hands to the backend: a host copy on gloo runs with GPUs."""
        return tensor.cpu() if self._stage_on_host and tensor.is_cuda else tensor

    def _all_reduce_(self, tensor: torch.Tensor, op, what: str) -> torch.Tensor:
        if self.size > 1:
            t = self._host(tensor)
            self._guard(what, dist.all_reduce, t, op=op)
            if t is not tensor:
                tensor.copy_(t)
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over all ranks."""
        return self._all_reduce_(tensor, dist.ReduceOp.SUM, "all_reduce")

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over all ranks, in place."""
        return self._all_reduce_(tensor, dist.ReduceOp.MAX, "all_reduce(max)")

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's tensor, in rank order; the first dimension may differ between ranks."""
        if self.size == 1:
            return [tensor]
        device = tensor.device
        tensor = self._host(tensor)
        n = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self._guard("all_gather(sizes)", dist.all_gather, sizes, n)
        sizes = [int(s) for s in sizes]
        longest = max(sizes)
        padded = tensor
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
            padded = torch.cat([tensor, pad])
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self._guard("all_gather", dist.all_gather, out, padded.contiguous())
        return [o[:s].to(device) for o, s in zip(out, sizes)]

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (same shape and dtype everywhere)."""
        if self.size > 1:
            t = self._host(tensor)
            self._guard("broadcast", dist.broadcast, t, src=src)
            if t is not tensor:
                tensor.copy_(t)
        return tensor

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.size == 1:
            return [obj]
        out: List[Any] = [None] * self.size
        self._guard("all_gather_object", dist.all_gather_object, out, obj, group=self._cpu_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        self._guard("broadcast_object", dist.broadcast_object_list, box, src=src, group=self._cpu_group)
        return box[0]

    def raise_together(self, failure: Optional[Exception], where: str) -> None:
        """Raise on every rank once a collective has told them that some rank's work failed.

        Work between two collectives can fail on one rank alone: a client that only it trains,
        a server micro-batch that only it runs. Raised there alone, the error would leave the
        other ranks in the next collective until --collective-timeout, and rank 0, which prints
        the errors every rank shares, would never see it. So that work catches its exception,
        adds a failure count to the collective it makes anyway and, where the count is not 0,
        every rank calls this (one gather of who failed and why): a failing rank raises its own
        exception; the others raise the first failing rank's error with its rank named, or a
        RankFailure pointing at that rank's traceback if it was not a FedHPCError.
        """
        # The error travels as plain strings, never as the exception object: an error class
        # defined inside a function does not pickle (the failing rank would raise alone and
        # leave the others in this gather), and one whose __init__ takes other arguments than
        # a message does not unpickle. The others rebuild the class by name around the message.
        report = None
        if isinstance(failure, FedHPCError):
            kind = type(failure)
            report = (kind.__module__, kind.__qualname__, failure.exit_code, str(failure))
        elif failure is not None:
            report = f"{type(failure).__name__}: {failure}"
        reports = self.all_gather_object(report)
        if failure is not None:
            raise failure
        rank, first = next((r, x) for r, x in enumerate(reports) if x is not None)
        if isinstance(first, tuple):
            module, qualname, exit_code, message = first
            raise _fedhpc_error(module, qualname, exit_code, f"{message} [raised on rank {rank}, {where}]")
        raise RankFailure(f"{where} failed on rank {rank} with {first} (its traceback is in that "
                          f"rank's output); the latest checkpoint is intact")

    def heartbeat(self) -> None:
        """On NCCL runs, a one-number gloo all-reduce before the round's NCCL collective.

        gloo notices a peer whose process died at once (its socket closes) and raises, which
        :meth:`_guard` turns into RankFailure; NCCL would instead wait for the collective
        timeout and then abort from its watchdog thread. A no-op on gloo-only runs.
        """
        if self.size > 1 and self._cpu_group is not None:
            self._guard("heartbeat", dist.all_reduce, torch.ones(1), group=self._cpu_group)

    def barrier(self) -> None:
        if self.size > 1:
            self._guard("barrier", dist.barrier, group=self._cpu_group)

    def close(self, graceful: bool = True) -> None:
        """Destroy the process group: torch's gloo aborts at exit when it is left alive.

        ``graceful=False`` (a peer died or this rank failed alone) skips the closing barrier,
        which would otherwise wait for a rank that will never come.
        """
        if self.size > 1 and dist.is_initialized():
            try:
                if not graceful:
                    raise RuntimeError("skip barrier")
                # Tear down together: a rank destroying gloo while a peer still holds the
                # connection is what makes torch 2.13 abort at exit.
                dist.barrier()
            except Exception:
                pass
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def abort(self, code: int) -> None:
        """Bring every rank down after a fatal error on this one (instead of a hang)."""
        if self._mpi_comm is not None and self.size > 1:
            sys.stdout.flush(); sys.stderr.flush()
            self._mpi_comm.Abort(code)

    def describe(self) -> str:
        return (f"{self.size} rank(s) via {self.launcher}, backend "
                f"{self.backend if self.size > 1 else 'none'}, device {self.device}, "
                f"{self.threads} thread(s) per rank")


def _fedhpc_error(module: str, qualname: str, exit_code: int, message: str) -> FedHPCError:
    """The FedHPCError another rank raised, rebuilt from its class's name and its message.

    Built without calling the class's ``__init__`` (whose arguments this rank does not have);
    a class this rank cannot find by name (defined inside a function) becomes a FedHPCError
    with the same exit code, so the launcher still prints it and exits as the original would.
    """
    kind: Any = sys.modules.get(module)
    for name in qualname.split("."):
        kind = getattr(kind, name, None)
    if not (isinstance(kind, type) and issubclass(kind, FedHPCError)):
        kind = FedHPCError
    error = kind.__new__(kind)
    error.args = (message,)
    error.exit_code = exit_code
    return error
