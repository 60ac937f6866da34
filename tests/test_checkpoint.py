"""Pre-emption, resume and refusal of bad checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST, REPO, clean_env, final_weights, launch, max_diff, mpiexec

ARGS = FAST[:]
ARGS[ARGS.index("--rounds") + 1] = "40"
ARGS += ["--checkpoint-every", "0", "--seed", "5"]


def metrics(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def strip_timing(recs):
    return [{k: v for k, v in r.items() if k != "round_seconds"} for r in recs]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full") / "run")
    p = launch(ARGS + ["--out", out])
    assert p.returncode == 0, p.stderr
    return out


def interrupt(out, ranks, after_rounds=3):
    cmd = [sys.executable, "-m", "fedhpc.launch", *ARGS, "--out", out]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    p = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= after_rounds:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_then_resume_equals_uninterrupted(tmp_path, uninterrupted, ranks):
    out = str(tmp_path / "run")
    code, err = interrupt(out, ranks)
    assert code == 75, err
    assert "--resume" in err
    done = int(open(os.path.join(out, "checkpoints", "LATEST")).read().strip().split("_")[1])
    assert 3 <= done < 40, "the signal must land mid-run for this test to mean anything"
    assert not os.path.exists(os.path.join(out, "final_model.pt"))
    p = launch(ARGS + ["--out", out, "--resume"], ranks=ranks)
    assert p.returncode == 0, p.stderr
    assert max_diff(final_weights(uninterrupted), final_weights(out)) <= 1e-5
    a, b = strip_timing(metrics(uninterrupted)), strip_timing(metrics(out))
    assert [r["round"] for r in b] == list(range(1, 41))
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k


def test_corrupt_checkpoint_is_refused(tmp_path):
    out = str(tmp_path / "run")
    assert launch(FAST + ["--out", out]).returncode == 0
    latest = open(os.path.join(out, "checkpoints", "LATEST")).read().strip()
    server = os.path.join(out, "checkpoints", latest, "server.pt")
    blob = bytearray(open(server, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(server, "wb").write(bytes(blob))
    p = launch(FAST + ["--out", out, "--resume", "--rounds", "6"])
    assert p.returncode == 2
    assert "corrupt" in p.stderr and "server.pt" in p.stderr
    assert not any(l.startswith("Traceback") for l in p.stderr.splitlines())


def test_mismatched_checkpoint_is_refused(tmp_path):
    out = str(tmp_path / "run")
    assert launch(FAST + ["--out", out]).returncode == 0
    before = open(os.path.join(out, "metrics.jsonl")).read()
    p = launch(FAST + ["--out", out, "--resume", "--lr", "0.5"])
    assert p.returncode == 2
    assert "different run" in p.stderr and "lr" in p.stderr
    assert open(os.path.join(out, "metrics.jsonl")).read() == before, "nothing lost"


def test_existing_run_is_not_overwritten_without_resume(tmp_path):
    out = str(tmp_path / "run")
    assert launch(FAST + ["--out", out]).returncode == 0
    weights = final_weights(out)
    p = launch(FAST + ["--out", out, "--seed", "9"])
    assert p.returncode == 2 and "already holds a run" in p.stderr and "--resume" in p.stderr
    assert max_diff(weights, final_weights(out)) == 0


def test_resume_extends_a_finished_run(tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    short = ARGS[:]
    short[short.index("--rounds") + 1] = "25"
    assert launch(short + ["--out", out]).returncode == 0
    p = launch(ARGS + ["--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert max_diff(final_weights(uninterrupted), final_weights(out)) <= 1e-5


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    out = str(tmp_path / "new")
    p = launch([a for a in FAST if a != "--quiet"] + ["--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "no checkpoint" in p.stdout
    assert len(open(os.path.join(out, "metrics.jsonl")).readlines()) == 4
