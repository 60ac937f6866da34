"""Shared helpers: run the launcher in-process or as real processes (1 rank, mpiexec, srun, torchrun)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

# One intra-op thread per test process unless a test sets its own (test_ops' two-thread checks
# do, and restore it): scripts/test.sh runs one pytest worker per core, and the runs tests launch
# take --threads 1 as well. Set here once, not per module, where the last module imported won.
torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
# Small, fast defaults for end-to-end runs on the digits data.
FAST = ["--rounds", "4", "--num-clients", "8", "--clients-per-round", "4", "--lr", "0.1",
        "--local-epochs", "2", "--model", "mlp", "--quiet", "--threads", "1", "--no-tensorboard"]


def mpiexec() -> str:
    path = os.path.join(BIN, "mpiexec")
    return path if os.path.exists(path) else shutil.which("mpiexec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """The environment without any launcher variables, so a child decides for itself."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("PMI_", "OMPI_", "SLURM_", "PMIX_", "HYDRA_", "MPIR_"))
               # settings of the machine, not of a launch: root allowed, a node without ssh/rsh (Open
               # MPI refuses to start even one node's ranks when its remote agent is missing), and
               # its core binding (off where several tests' mpiexec jobs run at once: each would
               # bind its ranks to the same first cores)
               or k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_plm_rsh_agent", "OMPI_MCA_plm_ssh_agent",
                                "OMPI_MCA_hwloc_base_binding_policy")))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def launch(args, ranks: int = 1, timeout: float = 240, env=None, prefix=None) -> subprocess.CompletedProcess:
    """Run ``python -m fedhpc.launch ARGS`` on 1 process or under ``mpiexec -n RANKS``."""
    cmd = [sys.executable, "-m", "fedhpc.launch", *args]
    if prefix:
        cmd = prefix + cmd
    elif ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def run_probe(script: str, out_dir, ranks: int, timeout: float = 180) -> list:
    """Run ``python tests/SCRIPT OUT_DIR`` on 1 process or under ``mpiexec -n RANKS`` and load
    the ``OUT_DIR/rank<r>.pt`` file every rank writes."""
    cmd = [sys.executable, os.path.join("tests", script), str(out_dir)]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    p = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return [torch.load(os.path.join(str(out_dir), f"rank{r}.pt")) for r in range(ranks)]


def fedhpc_algorithms() -> list:
    """The algorithms fedhpc registers, sorted: not the probes some test modules register
    (tests/state_probe.py's), which a parametrisation must not pick up by import order."""
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    load_algorithm_modules()
    return [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedhpc.")]


def final_weights(out: str) -> dict:
    return torch.load(os.path.join(out, "final_model.pt"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def cfg_for(data_dir, dataset, partition="iid", num_clients=4, seed=0, client_test_fraction=0.2):
    """The RunConfig fields a dataset builder reads, for building datasets directly in tests."""
    return SimpleNamespace(data_dir=str(data_dir), dataset=dataset, partition=partition,
                           num_clients=num_clients, seed=seed, client_test_fraction=client_test_fraction)


def opts(dataset, **kw):
    """An instance of ``dataset``'s options dataclass."""
    from fedhpc.data import DATASETS, load_dataset_modules

    load_dataset_modules()
    return DATASETS.get(dataset).options(**kw)


@pytest.fixture
def cfg_factory():
    """A validated RunConfig built from keyword arguments."""
    def make(**kw):
        from fedhpc.config import RunConfig
        cfg = RunConfig(**kw)
        cfg.validate()
        return cfg
    return make
