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
from every rank's view before the process group exists (:func:`fedhpc.layout.agree_backend`).
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import sys
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .errors import ConfigError, FedHPCError, RankFailure
from .hostlist import first_host
from .layout import agree_backend, gpu_layout, ranks_sharing_cores, slurm_tasks_per_node, threads_per_rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


class World:
    """This process's place among the ranks, and the collectives the engine uses."""

    def __init__(self, device: str = "auto", threads: int = 0, timeout: float = 600.0, backend: str = "auto",
                 deterministic: bool = True):
        self.launcher, self.rank, self.size, self.local_rank, self.local_size = "single", 0, 1, 0, 1
        self._mpi_comm = None
        init_method = None
        busiest = None  # tasks on the step's fullest node, where srun says
        node_masks = None  # each node-local rank's CPUs, under mpiexec
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
            # whether mpiexec bound the ranks to CPUs of their own (ranks_sharing_cores)
            if hasattr(os, "sched_getaffinity") and self.local_size > 1:
                node_masks = node.allgather(sorted(os.sched_getaffinity(0)))
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
        # divided among the ranks that share them (all of the node's, unless srun or mpiexec
        # bound each rank to its own cores: ranks_sharing_cores).
        if hasattr(os, "sched_getaffinity"):
            cores = len(os.sched_getaffinity(0))
            sharing, bound = ranks_sharing_cores(env, self.launcher, self.local_rank, self.local_size, node_masks)
        else:
            cores, sharing, bound = os.cpu_count(), self.local_size, False
        #: said once by rank 0: more threads than cores makes every rank wait for the others'
        self.threads, self.thread_note = threads_per_rank(threads, cores, sharing, bound,
                                                          "mpiexec" if self.launcher == "mpi" else "srun")
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

    def send_objects(self, outgoing: Dict[int, Any]) -> Dict[int, Any]:
        """Point to point: ``outgoing[dst]`` goes to rank ``dst`` alone; returns {src: object} of
        what the ranks sent here, in rank order (a parcel to itself comes back as it is).
        Collective (every rank calls it, with {} when it sends nothing): one all-gather of the
        byte counts, then only the parcels travel, where an all_gather_object would hand every
        parcel to every rank."""
        kept = {self.rank: outgoing[self.rank]} if self.rank in outgoing else {}  # to itself: handed back
        if self.size == 1:
            return kept
        parcels = {dst: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) for dst, obj in outgoing.items()
                   if dst != self.rank}
        counts = torch.zeros(self.size, dtype=torch.int64)
        for dst, data in parcels.items():
            counts[dst] = len(data)
        table = [torch.zeros_like(counts) for _ in range(self.size)]
        self._guard("send_objects (sizes)", dist.all_gather, table, counts, group=self._cpu_group)

        def exchange():
            requests, inbox = [], {}
            for dst, data in parcels.items():
                requests.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst,
                                           group=self._cpu_group))
            for src in range(self.size):
                n = int(table[src][self.rank])
                if n and src != self.rank:
                    inbox[src] = torch.empty(n, dtype=torch.uint8)
                    requests.append(dist.irecv(inbox[src], src, group=self._cpu_group))
            for request in requests:
                request.wait()
            return inbox

        inbox = self._guard("send_objects", exchange)
        received = {src: pickle.loads(buf.numpy().tobytes()) for src, buf in inbox.items()}
        return dict(sorted({**received, **kept}.items()))

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

    def close(self, graceful: bool = True, finalize_mpi: bool = True) -> None:
        """Destroy the process group: torch's gloo aborts at exit when it is left alive.

        ``graceful=False`` (a peer died or this rank failed alone) skips the closing barrier,
        which would otherwise wait for a rank that will never come. ``finalize_mpi=False`` leaves
        MPI initialised for a later World in this process (``fedhpc.run`` called again; MPI cannot
        be initialised twice), and mpi4py finalises it when the interpreter exits.
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
        if self._mpi_comm is not None and graceful and finalize_mpi:
            # Open MPI's mpiexec counts a rank that leaves without MPI_Finalize as failed (exit 1,
            # "exiting improperly"), finished run or not, and the launcher leaves by os._exit,
            # which skips mpi4py's own Finalize at exit. After a failure the ranks are brought
            # down by abort() instead: Finalize could wait for a peer that is gone.
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized():
                MPI.Finalize()
            self._mpi_comm = None

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
