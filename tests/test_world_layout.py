"""fedhpc/world.py under srun: GPUs per task, CPU binding and uneven tasks per node.

Nothing here starts a process group: World is built with SLURM's variables set by hand and
torch.cuda, sched_getaffinity, set_num_threads and init_process_group replaced, so each case
reads what World would pick on that node. The pure rules of fedhpc/layout.py (slurm_tasks_per_node,
ranks_sharing_cores, threads_per_rank, gpu_layout) are checked directly as well.
"""

import os

import pytest
import torch
import torch.distributed as dist

import fedhpc.layout as layout
import fedhpc.world as world
from fedhpc.errors import ConfigError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


def srun_env(tasks, localid, procid=None, per_node=None, **extra):
    env = {"SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_PROCID": str(localid if procid is None else procid),
           "SLURM_LOCALID": str(localid), "SLURM_STEP_TASKS_PER_NODE": str(tasks) if per_node is None else per_node,
           "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "1234", "MASTER_PORT": "29999"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def make_world(monkeypatch, env, gpus=0, cores=8, peers=None, **kw):
    """World as one task with ``env`` would build it, seeing ``gpus`` GPUs and ``cores`` cores.
    The other ranks' views are ``peers(rank, size, view)`` (default: all look like this one).

    Returns (world, backend given to init_process_group, threads given to torch)."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "PMIX_")) or k in LAUNCH_VARS:
            monkeypatch.delenv(k)
    # World sets this default on NCCL runs: make monkeypatch restore it afterwards
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.__setitem__("threads", n))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(world, "gpu_numerics", lambda deterministic: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **a: seen.__setitem__("backend", backend))
    monkeypatch.setattr(dist, "new_group", lambda **a: None)
    # the mocked GPUs have no UUID, even on a machine with a real GPU behind torch.cuda
    monkeypatch.setattr(world, "gpu_uuid", lambda device: None)
    monkeypatch.setattr(world, "rendezvous_store", lambda *a: dist.HashStore())
    monkeypatch.setattr(world, "exchange_views", lambda store, rank, size, view:
                        (peers or (lambda r, n, v: [v] * n))(rank, size, view))
    w = world.World(device="auto", **kw)
    return w, seen.get("backend"), seen.get("threads")


# ------------------------------------------------------------------ 1. GPUs per task

def test_gpu_per_task_picks_nccl_and_each_task_its_own_gpu(monkeypatch):
    """srun --gpus-per-task=1: each of 4 tasks sees only its GPU, as cuda:0; NCCL, not gloo.
    The other layouts keep today's choice; every mismatch is listed at once."""
    cases = [
        # (what, extra env, visible GPUs, backend, device index of local rank i)
        ("a: 1 private GPU per task (--gpus-per-task=1)",
         dict(SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="4", CUDA_VISIBLE_DEVICES="0"), 1, "nccl", lambda i: 0),
        ("a: same, SLURM_GPUS_PER_TASK only (no SLURM_GPUS_ON_NODE)",
         dict(SLURM_GPUS_PER_TASK="1"), 1, "nccl", lambda i: 0),
        ("a: --gpus-per-task with a type", dict(SLURM_GPUS_PER_TASK="h100:1"), 1, "nccl", lambda i: 0),
        ("a: --gpus-per-node=4 --gpu-bind=single:1", dict(SLURM_GPUS_ON_NODE="4"), 1, "nccl", lambda i: 0),
        ("b: every task sees the node's 4 GPUs", dict(SLURM_GPUS_ON_NODE="4"), 4, "nccl", lambda i: i),
        ("b: --gpus-per-task=1 --gpu-bind=none", dict(SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="4"), 4,
         "nccl", lambda i: i),
        ("c: 4 tasks really share 1 GPU", dict(SLURM_GPUS_ON_NODE="1", CUDA_VISIBLE_DEVICES="0"), 1, "gloo",
         lambda i: 0),
        ("c: no SLURM GPU variables at all", {}, 1, "gloo", lambda i: 0),
        ("2 GPUs per task, each task sees its 2", dict(SLURM_GPUS_PER_TASK="2", SLURM_GPUS_ON_NODE="8"), 2,
         "nccl", lambda i: i % 2),
        ("closest binding: 2 tasks per visible pair of 4 GPUs", dict(SLURM_GPUS_ON_NODE="4"), 2, "gloo",
         lambda i: i % 2),
    ]
    wrong = []
    for what, extra, visible, backend, index in cases:
        for i in range(4):
            w, init_backend, _ = make_world(monkeypatch, srun_env(4, i, **extra), gpus=visible)
            got = (w.backend, init_backend, w.device)
            want = (backend, backend, torch.device("cuda", index(i)))
            if got != want:
                wrong.append(f"{what}, local rank {i}: got {got}, want {want}")
    # d: 2 tasks on the one GPU they see, no SLURM GPU variables (the CPU-only mock of the
    # shared-GPU test): gloo, with the note saying why
    for i in range(2):
        w, init_backend, _ = make_world(monkeypatch, srun_env(2, i), gpus=1)
        if (w.backend, init_backend, w.device) != ("gloo", "gloo", torch.device("cuda", 0)) \
                or "share" not in w.backend_note:
            wrong.append(f"d: 2 tasks on 1 GPU, local rank {i}: got {w.backend}, {w.device}, {w.backend_note!r}")
    assert not wrong, "\n".join(wrong)


def test_gpu_per_task_accepts_nccl_when_asked(monkeypatch):
    w, backend, _ = make_world(monkeypatch, srun_env(4, 3, SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="4"),
                               gpus=1, backend="nccl")
    assert (w.backend, backend, w.device) == ("nccl", "nccl", torch.device("cuda", 0))
    # a GPU that 4 tasks really share is still refused, with the fix
    with pytest.raises(ConfigError, match="one rank per GPU"):
        make_world(monkeypatch, srun_env(4, 3, SLURM_GPUS_ON_NODE="1"), gpus=1, backend="nccl")


@pytest.mark.parametrize("env, local_size, busiest, visible, expect", [
    (dict(SLURM_GPUS_PER_TASK="1"), 4, 4, 1, (4, 4)),
    (dict(SLURM_GPUS_ON_NODE="4"), 4, 4, 1, (4, 4)),
    (dict(SLURM_GPUS_ON_NODE="4"), 4, 4, 4, (4, 4)),
    (dict(SLURM_GPUS_ON_NODE="1"), 4, 4, 1, (4, 1)),
    ({}, 2, 2, 1, (2, 1)),
    ({}, 1, 2, 1, (2, 1)),                                  # fewer tasks here: the fullest node decides
    (dict(SLURM_GPUS_PER_TASK="1"), 1, 2, 1, (1, 1)),       # uneven, but a private GPU per task everywhere
    (dict(SLURM_GPUS_ON_NODE="4"), 4, 4, 2, (4, 2)),        # pairs of tasks see the same 2 GPUs
    (dict(SLURM_GPUS_ON_NODE="junk", SLURM_GPUS_PER_TASK="x:y"), 4, 4, 1, (4, 1)),  # unreadable: ignored
])
def test_gpu_layout_rule(env, local_size, busiest, visible, expect):
    assert layout.gpu_layout(env, "srun", local_size, busiest, visible) == expect
    # other launchers' local ranks are not SLURM's tasks: what this process sees, as before
    assert layout.gpu_layout(env, "torchrun", local_size, busiest, visible) == (local_size, visible)


# ------------------------------------------------------------------ 2. CPU binding

CORES_BOUND = dict(SLURM_CPU_BIND_TYPE="cores,mask_cpu:", SLURM_CPU_BIND="quiet,cores,mask_cpu:0x1,0x2",
                   SLURM_CPU_BIND_LIST="0x1,0x2")


def test_tasks_bound_to_their_own_core_are_not_told_to_oversubscribe(monkeypatch):
    """srun --cpu-bind=cores, 2 tasks with 1 core each, --threads 1: no warning."""
    for i in range(2):
        w, _, threads = make_world(monkeypatch, srun_env(2, i, **CORES_BOUND), cores=1, threads=1)
        assert (w.threads, threads, w.thread_note) == (1, 1, "")
    # only the variables srun sets (no list): still bound
    w, _, _ = make_world(monkeypatch, srun_env(2, 1, SLURM_CPU_BIND="quiet,cores"), cores=1, threads=1)
    assert w.thread_note == ""
    # 2 threads on its 1 bound core do oversubscribe it, and the note says so
    w, _, _ = make_world(monkeypatch, srun_env(2, 0, **CORES_BOUND), cores=1, threads=2)
    assert "exceed the 1 core(s) srun bound" in w.thread_note and "set it to 1" in w.thread_note


def test_auto_threads_use_the_whole_bound_mask(monkeypatch):
    """--threads 0 (auto), 8 bound cores per task x 4 tasks: 8 threads each, not 2."""
    bound = dict(SLURM_CPU_BIND_TYPE="cores,mask_cpu:", SLURM_CPU_BIND_LIST="0xFF,0xFF00,0xFF0000,0xFF000000")
    cases = [
        ("bound to cores", bound, 8),
        ("bound, SLURM_CPU_BIND only", dict(SLURM_CPU_BIND="quiet,mask_cpu:0xFF,0xFF00,0xFF0000,0xFF000000"), 8),
        ("bound to threads, no list", dict(SLURM_CPU_BIND_TYPE="threads"), 8),
        ("bound to sockets: 2 tasks per socket mask", dict(SLURM_CPU_BIND_TYPE="sockets,mask_cpu:",
                                                            SLURM_CPU_BIND_LIST="0xFF,0xFF00,0xFF,0xFF00"), 4),
        ("sockets, no list to compare: divided as before", dict(SLURM_CPU_BIND_TYPE="sockets"), 2),
        ("not bound", {}, 2),
        ("--cpu-bind=none", dict(SLURM_CPU_BIND_TYPE="none", SLURM_CPU_BIND="quiet,none"), 2),
        ("empty type", dict(SLURM_CPU_BIND_TYPE="", SLURM_CPU_BIND="quiet"), 2),
    ]
    wrong = []
    for what, extra, want in cases:
        w, _, threads = make_world(monkeypatch, srun_env(4, 1, **extra), cores=8, threads=0)
        if (w.threads, threads, w.thread_note) != (want, want, ""):
            wrong.append(f"{what}: got {w.threads} thread(s) ({w.thread_note!r}), want {want}")
    assert not wrong, "\n".join(wrong)


def test_binding_is_read_for_srun_tasks_only():
    """torchrun or mpiexec inside one srun task: its ranks inherit that task's binding and share it."""
    env = dict(CORES_BOUND)
    assert layout.ranks_sharing_cores(env, "srun", 1, 2) == (1, True)
    assert layout.ranks_sharing_cores(env, "torchrun", 1, 2) == (2, False)
    assert layout.ranks_sharing_cores(env, "mpi", 1, 2) == (2, False)
    # an unreadable list: the per-task type alone is trusted
    assert layout.ranks_sharing_cores(dict(SLURM_CPU_BIND_TYPE="cores,mask_cpu:", SLURM_CPU_BIND_LIST="zz"),
                                     "srun", 0, 4) == (1, True)
    # user masks repeated with *N, shared pairwise
    assert layout.ranks_sharing_cores(dict(SLURM_CPU_BIND_TYPE="mask_cpu:", SLURM_CPU_BIND_LIST="0x3*2,0xC*2"),
                                     "srun", 2, 4) == (2, True)


@pytest.mark.parametrize("requested, cores, ranks, bound, threads, noted", [
    (0, 8, 4, False, 2, False),
    (0, 8, 1, True, 8, False),
    (1, 1, 1, True, 1, False),
    (2, 1, 1, True, 2, True),
    (1, 1, 2, False, 1, True),
    (0, 3, 4, False, 1, True),
])
def test_threads_per_rank(requested, cores, ranks, bound, threads, noted):
    got, note = layout.threads_per_rank(requested, cores, ranks, bound)
    assert got == threads and bool(note) == noted


# ------------------------------------------------------------------ 3. uneven tasks per node

def test_uneven_tasks_per_node_are_read_for_this_node(monkeypatch):
    """SLURM_STEP_TASKS_PER_NODE=2(x3),1: the 4th node holds one task, not two."""
    w, _, threads = make_world(monkeypatch, srun_env(7, 0, procid=6, per_node="2(x3),1", SLURM_NODEID="3"),
                               cores=4)
    assert (w.local_size, w.threads, threads, w.thread_note) == (1, 4, 4, "")
    w, _, _ = make_world(monkeypatch, srun_env(7, 1, procid=3, per_node="2(x3),1", SLURM_NODEID="1"), cores=4)
    assert (w.local_size, w.threads) == (2, 2)
    w, _, _ = make_world(monkeypatch, srun_env(7, 1, procid=5, per_node="1,2(x3)", SLURM_NODEID="3"), cores=4)
    assert (w.local_size, w.threads) == (2, 2)
    # the step's own list wins over the job's
    w, _, _ = make_world(monkeypatch, srun_env(3, 0, procid=2, per_node="2,1", SLURM_NODEID="1",
                                               SLURM_TASKS_PER_NODE="4(x2)"), cores=4)
    assert w.local_size == 1
    # without SLURM_NODEID, the first node's count, as before
    w, _, _ = make_world(monkeypatch, srun_env(7, 0, per_node="2(x3),1"), cores=4)
    assert w.local_size == 2
    # every node picks the same backend: with one GPU per node and no SLURM GPU variables the
    # 2-task nodes share it (gloo), so the 1-task node must not pick NCCL (init would hang)
    for node, procid in (("0", 0), ("3", 6)):
        w, backend, _ = make_world(monkeypatch, srun_env(7, 0, procid=procid, per_node="2(x3),1",
                                                         SLURM_NODEID=node), gpus=1)
        assert (w.backend, backend) == ("gloo", "gloo"), node


@pytest.mark.parametrize("spec", ["2(x3", "x2", "2(3),1", "2,,1", "", "0", "2(x0)", "two"])
def test_malformed_tasks_per_node_is_a_config_error(monkeypatch, spec):
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        make_world(monkeypatch, srun_env(2, 0, per_node=spec, SLURM_NODEID="0"))


@pytest.mark.parametrize("node", ["4", "-1", "a"])
def test_node_id_outside_the_list_is_a_config_error(monkeypatch, node):
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        make_world(monkeypatch, srun_env(7, 0, per_node="2(x3),1", SLURM_NODEID=node))


@pytest.mark.parametrize("env, expect", [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, (1, 2)),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, (2, 2)),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,4", "SLURM_NODEID": "0"}, (1, 4)),
    ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, (3, 3)),
    ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "1"}, (1, 2)),
    ({}, (1, 1)),
])
def test_slurm_tasks_per_node(env, expect):
    assert layout.slurm_tasks_per_node(env) == expect


# ------------------------------------------------------------------ 4. one backend for all ranks

def gpu_view(host, gpu=None, ranks=1, gpus=1, cuda=True):
    return {"host": host, "cuda": cuda, "gpu": gpu, "ranks": ranks, "gpus": gpus}


@pytest.mark.parametrize("what, views, expect, needle", [
    ("distinct GPUs by UUID", [gpu_view("n0", "A"), gpu_view("n0", "B"), gpu_view("n1", "A")], "nccl", ""),
    ("two ranks on one GPU by UUID (a --gpu-bind the layout cannot see)",
     [gpu_view("n0", "A", 2, 2), gpu_view("n0", "A", 2, 2)], "gloo", "ranks 0, 1 share one GPU on n0"),
    ("UUIDs beat a layout that looks shared",
     [gpu_view("n0", "A", 4, 2), gpu_view("n0", "B", 4, 2)], "nccl", ""),
    ("a rank without a UUID: the layout of the fullest node decides",
     [gpu_view("n0", "A", 1, 1), gpu_view("n1", None, 2, 1)], "gloo", "2 ranks share 1 GPU(s) on n1"),
    ("nodes with different GPU counts", [gpu_view("n0", None, 2, 2), gpu_view("n1", None, 4, 2)],
     "gloo", "4 ranks share 2 GPU(s) on n1"),
    ("a rank on CPU among GPU ranks", [gpu_view("n0", "A"), gpu_view("n1", cuda=False, gpus=0)],
     "gloo", "rank(s) 1 have no GPU"),
    ("CPU only", [gpu_view("n0", cuda=False, gpus=0)] * 3, "gloo", ""),
])
def test_the_ranks_agree_on_one_backend(what, views, expect, needle):
    backend, note = layout.agree_backend(views)
    assert backend == expect, what
    assert (needle in note) if needle else note == "", (what, note)


@pytest.mark.parametrize("views, needle", [
    ([gpu_view("n0", "A"), gpu_view("n0", "A")], "ranks 0, 1 share one GPU on n0.*--gpu-bind"),
    ([gpu_view("n0", None, 2, 2), gpu_view("n1", None, 4, 2)], "4 ranks share 2 GPU"),
    ([gpu_view("n0", "A"), gpu_view("n1", cuda=False, gpus=0)], "on every rank, but rank.s. 1 have none"),
])
def test_nccl_that_some_rank_cannot_use_is_refused_naming_it(views, needle):
    with pytest.raises(ConfigError, match=needle):
        layout.agree_backend(views, "nccl")


def test_a_task_with_its_own_gpu_follows_a_node_whose_tasks_share_one(monkeypatch):
    """Node 0's task has a GPU to itself; node 1's two tasks share one. Each node alone would
    pick NCCL on node 0 and gloo on node 1, and init_process_group would hang: node 0 must take
    gloo too, and a request for NCCL fails on node 0 as well, naming node 1."""
    def peers(rank, size, view):
        return [view] + [gpu_view("node1", None, 2, 1)] * (size - 1)
    env = srun_env(3, 0, per_node="1,2", SLURM_NODEID="0", SLURM_GPUS_PER_TASK="1")
    w, backend, _ = make_world(monkeypatch, env, gpus=1)
    assert (w.backend, backend) == ("nccl", "nccl")  # alone it would
    w, backend, _ = make_world(monkeypatch, env, gpus=1, peers=peers)
    assert (w.backend, backend) == ("gloo", "gloo") and "2 ranks share 1 GPU(s) on node1" in w.backend_note
    with pytest.raises(ConfigError, match="on node1"):
        make_world(monkeypatch, env, gpus=1, peers=peers, backend="nccl")


def test_views_travel_through_the_rendezvous_store():
    """exchange_views over a real store, ranks arriving in any order (threads for ranks)."""
    import threading
    from datetime import timedelta

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(
        r, world.exchange_views(store, r, 3, gpu_view(f"n{r}", f"G{r}")))) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [gpu_view(f"n{r}", f"G{r}") for r in range(3)]
    assert got == {0: want, 1: want, 2: want}


def test_gpu_uuid_reads_the_device_and_ignores_an_empty_one(monkeypatch):
    class Props:
        def __init__(self, uuid):
            self.uuid = uuid
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props("5c1f0e2a-0000-1111-2222-333344445555"))
    assert world.gpu_uuid(torch.device("cuda", 0)) == "5c1f0e2a-0000-1111-2222-333344445555"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props("00000000-0000-0000-0000-000000000000"))
    assert world.gpu_uuid(torch.device("cuda", 0)) is None

    def no_gpu(d):
        raise RuntimeError("no CUDA")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    assert world.gpu_uuid(torch.device("cuda", 0)) is None


def test_ranks_mpiexec_bound_share_only_overlapping_masks():
    """Under mpiexec the ranks' own CPU masks say whether the launcher bound them: Open MPI binds
    each of up to 2 ranks to a core (and beyond that to a socket) by default, so a rank's mask
    is its own, not the node's to divide again."""
    assert layout.ranks_sharing_cores({}, "mpi", 0, 2, [[0], [1]]) == (1, True)              # bound to cores
    assert layout.ranks_sharing_cores({}, "mpi", 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7]] * 2) == (2, True)  # sockets
    assert layout.ranks_sharing_cores({}, "mpi", 1, 2, [[0, 1], [0, 1]]) == (2, False)       # not bound
    assert layout.ranks_sharing_cores({}, "mpi", 1, 2, None) == (2, False)                   # not gathered
    assert layout.ranks_sharing_cores({}, "mpi", 1, 3, [[0], [1]]) == (3, False)             # not one per rank
    assert layout.ranks_sharing_cores({}, "torchrun", 0, 2, [[0], [1]]) == (2, False)        # mpiexec's only
    threads, note = layout.threads_per_rank(2, 1, 1, True, "mpiexec")
    assert threads == 2 and "exceed the 1 core(s) mpiexec bound this rank to" in note
