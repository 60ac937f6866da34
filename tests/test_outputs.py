"""What --out holds after a run, and the SIGUSR1 (SLURM warning) path."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
import yaml

from conftest import FAST, REPO, clean_env, launch

REQUIRED = {"round", "test_accuracy", "test_loss", "train_loss", "bytes_up", "bytes_down", "round_seconds"}


def test_run_outputs(tmp_path):
    out = str(tmp_path / "run")
    args = [a for a in FAST if a != "--no-tensorboard"] + ["--eval-every", "2", "--rounds", "5"]
    p = launch(args + ["--out", out])
    assert p.returncode == 0, p.stderr
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["round"] for r in recs] == [2, 4, 5], "evaluated rounds only, and always the last"
    for r in recs:
        assert REQUIRED <= r.keys()
        assert 0 <= r["test_accuracy"] <= 1 and r["round_seconds"] > 0
    # bytes: 4 clients per round each download and upload the whole model (float32)
    sd = torch.load(os.path.join(out, "final_model.pt"))
    nbytes = 4 * sum(v.numel() for v in sd.values())
    assert recs[0]["bytes_up"] == recs[0]["bytes_down"] == 4 * nbytes
    assert recs[-1]["bytes_up_total"] == 5 * 4 * nbytes
    cfg = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert cfg["rounds"] == 5 and cfg["model"] == "mlp" and cfg["algo"] == "fedavg"
    from fedhpc.models import build_model
    build_model("mlp", (1, 8, 8), 10).load_state_dict(sd)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(os.path.join(out, "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"test_accuracy", "train_loss", "bytes_up", "round_seconds"} <= tags
    assert [s.step for s in ev.Scalars("train_loss")] == [1, 2, 3, 4, 5]
    assert [s.step for s in ev.Scalars("test_accuracy")] == [2, 4, 5]


def test_sigusr1_checkpoints_and_exits_75(tmp_path):
    out = str(tmp_path / "run")
    args = FAST[:]
    args[args.index("--rounds") + 1] = "400"
    proc = subprocess.Popen([sys.executable, "-m", "fedhpc.launch", *args, "--out", out, "--checkpoint-every", "0"],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(path) and os.path.getsize(path) > 0):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    done = int(open(os.path.join(out, "checkpoints", "LATEST")).read().split("_")[1])
    assert 1 <= done < 400
    assert sum(1 for _ in open(path)) == done
