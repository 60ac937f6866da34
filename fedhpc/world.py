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
on CPU and NCCL on GPU (one GPU per local rank).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist

from .errors import ConfigError, RankFailure
from .hostlist import first_host


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class World:
    """This process's place among the ranks, and the collectives the engine uses."""

    def __init__(self, device: str = "auto", threads: int = 0, timeout: float = 600.0):
        self.launcher, self.rank, self.size, self.local_rank, self.local_size = "single", 0, 1, 0, 1
        self._mpi_comm = None
        init_method = None
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
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
            self.local_size = int(re.match(r"\d+", per_node).group())
            nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
            addr = env.get("MASTER_ADDR") or first_host(nodelist)
            port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
            init_method = f"tcp://{addr}:{port}"

        # Threads per rank: MPI launchers drop torch to 1 thread, and several ranks on a node
        # must not oversubscribe it, so always set the count explicitly.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.threads = threads or max(1, (cores or 1) // max(1, self.local_size))
        torch.set_num_threads(self.threads)

        use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        if use_cuda:
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was asked for but no GPU is visible; use --device cpu or auto")
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            # NCCL's watchdog tears the process down on an error by default (mode 3), so a dead
            # peer would never reach our clear "exit 4, --resume" message. Mode 2 only aborts
            # the communicator and lets the collective raise; the user's own setting wins.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._timeout = timeout
        if self.size > 1:
            dist.init_process_group(self.backend, init_method=init_method, rank=self.rank,
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

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over all ranks."""
        if self.size > 1:
            self._guard("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's tensor, in rank order; the first dimension may differ between ranks."""
        if self.size == 1:
            return [tensor]
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
        return [o[:s] for o, s in zip(out, sizes)]

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (same shape and dtype everywhere)."""
        if self.size > 1:
            self._guard("broadcast", dist.broadcast, tensor, src=src)
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
