"""A second SIGTERM (or a SIGINT) while a round runs stops the run at once, the last complete
checkpoint intact (issue 40, section 0: a bare Mix2FLD round took four minutes, and SIGTERM only
stops after the round it lands in). The first SIGTERM keeps its meaning: checkpoint at the end of
the round, exit 75 (tests/test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, launch

#: rounds of several seconds (150 local epochs of an MLP over 4 clients), a checkpoint after each
ARGS = ["--algo", "fedavg", "--model", "mlp", "--num-clients", "4", "--clients-per-round", "4", "--local-epochs",
        "150", "--lr", "0.05", "--rounds", "3", "--checkpoint-every", "1", "--threads", "1", "--no-tensorboard"]


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_the_round_at_once_and_keeps_the_last_checkpoint(tmp_path, second):
    out = str(tmp_path / "run")
    # SIGINT as a shell gives a foreground job (a background one inherits it ignored, and Python then
    # installs no KeyboardInterrupt handler)
    p = subprocess.Popen([sys.executable, "-m", "fedhpc.launch", *ARGS, "--out", out], cwd=REPO, env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = os.path.join(out, "checkpoints", "LATEST")
    deadline = time.time() + 180
    while time.time() < deadline and not os.path.exists(latest) and p.poll() is None:
        time.sleep(0.05)
    assert os.path.exists(latest), p.communicate()[1]
    round_seconds = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())["round_seconds"]
    time.sleep(0.2)  # into round 2
    p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    sent = time.perf_counter()
    p.send_signal(getattr(signal, second))
    _, err = p.communicate(timeout=120)
    took = time.perf_counter() - sent
    assert p.returncode == 130, err
    assert took < round_seconds / 2, f"stopped {took:.2f} s after the second signal; a round takes {round_seconds:.2f} s"
    assert "SIGTERM: stopping after this round with a checkpoint; send it again to stop at once" in err
    assert f"interrupted; the last checkpoint in {out}/checkpoints is intact" in err
    assert "Traceback" not in err
    # round 2 was not finished, logged nor checkpointed; round 1's checkpoint is the one a resume reads
    assert open(latest).read().strip() == "round_000001"
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "round_000001"]
    assert len(open(os.path.join(out, "metrics.jsonl")).read().splitlines()) == 1
    args = list(ARGS)
    args[args.index("--rounds") + 1] = "1"  # the run as far as its checkpoint: resumed, evaluated, done
    resumed = launch(args + ["--out", out, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "after round 1" in resumed.stdout
