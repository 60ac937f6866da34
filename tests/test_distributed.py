"""The same seed on 1, 2 and 3 ranks, under every launcher, gives the same model."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, FAST, REPO, clean_env, final_weights, free_port, launch, max_diff

# float64 accumulation makes sums almost order-independent; allow for float32 rounding.
TOL = 1e-5
ARGS = FAST + ["--partition", "dirichlet:0.5", "--seed", "3", "--model", "cnn"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single") / "run")
    p = launch(ARGS + ["--out", out])
    assert p.returncode == 0, p.stderr
    return final_weights(out)


@pytest.mark.parametrize("ranks", [2, 3])
def test_mpiexec_matches_single_process(tmp_path, single, ranks):
    out = str(tmp_path / "run")
    p = launch(ARGS + ["--out", out], ranks=ranks)
    assert p.returncode == 0, p.stderr
    assert max_diff(single, final_weights(out)) <= TOL


def test_srun_environment_matches_single_process(tmp_path, single):
    out = str(tmp_path / "run")
    port = free_port()
    procs = []
    for r in range(2):
        env = clean_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                        SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2",
                        SLURM_JOB_ID="1234", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "fedhpc.launch", *ARGS, "--out", out],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    assert max_diff(single, final_weights(out)) <= TOL


def test_torchrun_matches_single_process(tmp_path, single):
    out = str(tmp_path / "run")
    torchrun = [os.path.join(BIN, "torchrun"), "--nnodes", "1", "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    p = subprocess.run([*torchrun, "-m", "fedhpc.launch", *ARGS, "--out", out], cwd=REPO,
                       env=clean_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert max_diff(single, final_weights(out)) <= TOL


def test_two_ranks_print_progress_and_describe_world(tmp_path):
    p = launch([a for a in ARGS if a != "--quiet"] + ["--out", str(tmp_path / "o")], ranks=2)
    assert p.returncode == 0, p.stderr
    assert "2 rank(s) via mpi" in p.stdout and "backend gloo" in p.stdout
    assert p.stdout.count("round    4/4") == 1, "only rank 0 prints progress"
    assert "final test accuracy" in p.stdout


def test_a_rank_that_dies_stops_the_others_with_a_clear_message(tmp_path):
    out = str(tmp_path / "run")
    port = free_port()
    base = [a for a in FAST]
    base[base.index("--rounds") + 1] = "400"
    args = base + ["--out", out, "--checkpoint-every", "2"]
    procs = []
    for r in range(2):
        env = clean_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                        SLURM_STEP_NODELIST="localhost", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "fedhpc.launch", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    latest = os.path.join(out, "checkpoints", "LATEST")
    import time
    deadline = time.time() + 120
    while not os.path.exists(latest) and time.time() < deadline:
        time.sleep(0.05)
    procs[1].kill()
    _, err = procs[0].communicate(timeout=120)
    procs[1].communicate()
    assert procs[0].returncode == 4, err
    assert "peer rank probably died" in err and "--resume" in err
    assert not os.path.exists(os.path.join(out, "final_model.pt"))
    # What was checkpointed is usable: the run goes on from it, here on a single process.
    done = int(open(latest).read().strip().split("_")[1])
    resumed = [a for a in args]
    resumed[resumed.index("--rounds") + 1] = str(done + 2)
    p = launch(resumed + ["--resume"])
    assert p.returncode == 0, p.stderr
    rounds = [json.loads(l)["round"] for l in open(os.path.join(out, "metrics.jsonl"))]
    assert rounds == list(range(1, done + 3))
