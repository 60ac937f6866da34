"""How ranks map onto a node's cores and GPUs, and which backend carries their tensors.

Pure functions of the launcher's environment (srun's task counts, CPU binding and GPU
variables) and of every rank's view of its GPU, so that each rule is tested without SLURM or
GPUs (tests/test_world_layout.py); :class:`fedhpc.world.World` reads os.environ and the devices
through them.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence

from .errors import ConfigError

BACKENDS = ("auto", "nccl", "gloo")


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
                        "Give each rank its own GPU: as many ranks per node as GPUs, with --gpus-per-node=G "
                        "--ntasks-per-node=G --gpu-bind=none (slurm/run_gpu.sbatch; each rank takes the GPU "
                        "of its local rank), or a CUDA_VISIBLE_DEVICES that maps ranks to distinct GPUs; "
                        "train several clients per rank at once with --clients-at-once K")
        return "", ""
    for v in views:
        if v["ranks"] > v["gpus"]:
            return (f"{v['ranks']} ranks share {v['gpus']} GPU(s) on {v['host']}",
                    f"Launch at most {v['gpus']} rank(s) per node (and train several clients per rank at "
                    f"once with --clients-at-once K)")
    return "", ""


# ------------------------------------------------------------- the node layout under srun

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


def ranks_sharing_cores(env, launcher: str, local_rank: int, local_size: int,
                        node_masks: Optional[Sequence[Sequence[int]]] = None) -> tuple:
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

    Under mpiexec the ranks' own masks are compared (``node_masks``: each node-local rank's
    CPUs, gathered over MPI before the process group exists): Open MPI binds by default (each
    rank to a core for up to 2 ranks, to a socket beyond), Hydra with ``-bind-to``. Masks
    that differ mean the launcher bound the ranks, and this rank's CPUs are shared only by
    the ranks whose masks overlap them. All alike: unbound, shared by the node's ranks.
    """
    if launcher == "mpi" and node_masks and len(node_masks) == local_size:
        mine = set(node_masks[local_rank])
        if not mine or all(set(m) == mine for m in node_masks):
            return local_size, False
        return sum(1 for m in node_masks if mine.intersection(m)), True
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


def threads_per_rank(requested: int, cores: int, ranks: int, bound: bool = False, binder: str = "srun") -> tuple:
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
            note = (f"{threads} thread(s) per rank exceed the {cores} core(s) {binder} bound this rank to{shared}: "
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
