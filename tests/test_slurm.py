"""slurm/: the sweep generator, and run.sbatch's pre-emption/requeue logic with stand-in srun/scontrol."""

import os
import signal
import stat
import subprocess
import sys
import time

from conftest import REPO, clean_env


def test_make_sweep_is_the_cartesian_product():
    p = subprocess.run([sys.executable, "slurm/make_sweep.py", "--algo", "fedavg", "fedprox", "--seed", "0", "1", "2"],
                       cwd=REPO, capture_output=True, text=True)
    lines = p.stdout.splitlines()
    assert len(lines) == 6 and len(set(lines)) == 6
    assert "--algo fedprox --seed 2" in lines
    bad = subprocess.run([sys.executable, "slurm/make_sweep.py", "--algo"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "no values" in bad.stderr


def _fake_bin(tmp_path):
    b = tmp_path / "bin"
    b.mkdir()
    # srun: run the command once, as a single task (drop srun's own options).
    (b / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (b / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for f in b.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return str(b)


def test_run_sbatch_requeues_after_the_warning_signal(tmp_path):
    env = clean_env(PATH=_fake_bin(tmp_path) + os.pathsep + os.environ["PATH"], FEDHPC_PYTHON=sys.executable,
                    SLURM_JOB_ID="77", SLURM_JOB_NAME="t", SLURM_SUBMIT_DIR=REPO, OUT=str(tmp_path / "run"))
    p = subprocess.Popen(["bash", "slurm/run.sbatch", "--rounds", "400", "--num-clients", "8", "--clients-per-round",
                          "4", "--model", "mlp", "--quiet", "--no-tensorboard", "--checkpoint-every", "0"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does to the batch shell
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, out + err
    assert "requeue 77" in (tmp_path / "scontrol.log").read_text()
    assert (tmp_path / "run" / "checkpoints" / "LATEST").exists()
