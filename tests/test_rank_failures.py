"""An error raised on one rank only stops every rank at once, and rank 0 says what it was.

Work between two collectives (a client only one rank trains, a server micro-batch only some
ranks run) can fail on one rank alone. Raised there alone, the error left the other ranks in the
next all-reduce until --collective-timeout, and rank 0, which prints the errors every rank
shares, reported only that a peer had died. Real 2-rank launches of tests/failure_probe.py.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import FAST, REPO, clean_env, mpiexec

PROBE = os.path.join(REPO, "tests", "failure_probe.py")


def run_probe(*args, timeout=150):
    cmd = [mpiexec(), "-n", "2", sys.executable, PROBE, *args]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def launcher_error(mode, out, *flags):
    """The one error line rank 0 printed for a 2-rank run of the probe, checked for the exit
    code of a DataError (2), not RankFailure's 4 (a peer that "probably died")."""
    proc = run_probe(mode, out, *FAST, "--collective-timeout", "60", *flags)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]  # rank 0 speaks for both
    assert "peer rank" not in text
    return errors[0]


def test_a_dataset_missing_on_one_node_is_reported_by_rank_0_at_once(tmp_path):
    """Rank 1 fails while loading the data, before the run's first collective; rank 0 must say
    why at once, not wait in that collective until --collective-timeout (60 s here)."""
    import time
    t0 = time.time()
    error = launcher_error("dataset", str(tmp_path / "run"))
    assert "digits.npz is missing; copy the dataset to every node [raised on rank 1, loading the dataset]" in error
    assert time.time() - t0 < 50


def test_a_client_failing_on_one_rank_is_reported_by_rank_0_and_stops_both(tmp_path):
    out = str(tmp_path / "run")
    error = launcher_error("client", out)
    assert "shard is corrupt; prepare the dataset again [raised on rank 1, training round 2]" in error
    with open(os.path.join(out, "metrics.jsonl")) as f:  # round 1 was kept, round 2 was not
        rounds = [json.loads(line)["round"] for line in f]
    assert rounds == [1]


def test_a_client_model_failing_on_one_rank_at_evaluation_is_reported_by_rank_0(tmp_path):
    error = launcher_error("evaluation", str(tmp_path / "run"))
    assert "model file is unreadable; rerun with --resume [raised on rank 1, the clients' own models' " \
           "evaluation]" in error


def test_a_local_split_unreadable_on_one_rank_at_evaluation_is_reported_by_rank_0(tmp_path):
    """The global model's pass over the clients' splits runs outside the algorithm's code, but a
    read there can fail on one rank alone just the same."""
    error = launcher_error("local_split", str(tmp_path / "run"))
    assert "client_test/x of the store is truncated; prepare the dataset again [raised on rank 1, the " \
           "clients' own models' evaluation]" in error


@pytest.mark.parametrize("kind, rank0_says", [
    ("config", "ConfigError: the teacher outputs have 9 labels for a 10-label model; gather them again "
               "[raised on rank 1, server training]"),
    ("bug", "RankFailure: server training failed on rank 1 with RuntimeError: mat1 and mat2 shapes cannot "
            "be multiplied (its traceback is in that rank's output)"),
    # Errors travel by class name and message: a class whose __init__ takes no message did not
    # unpickle on rank 0 (a TypeError there), and one defined in a function did not pickle on
    # rank 1 (rank 0 waited for it until the collective timeout).
    ("custom", "ShardMissing: client 7's shard shards/7.h5 is missing; prepare the dataset again "
               "[raised on rank 1, server training]\nexit code 5"),
    ("local", "FedHPCError: the teacher outputs are missing; gather them again "
              "[raised on rank 1, server training]\nexit code 6"),
])
def test_a_server_micro_batch_failing_on_one_rank_raises_on_every_rank(kind, rank0_says, tmp_path):
    proc = run_probe("server", kind, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert said[0].startswith(rank0_says), said[0]
    own = {"config": "ConfigError: the teacher outputs", "bug": "RuntimeError: mat1 and mat2",
           "custom": "ShardMissing: client 7", "local": "TeacherMissing: the teacher"}[kind]
    assert said[1].startswith(own), said[1]
    assert "[raised on rank" not in said[1]  # the failing rank raises its own error, unchanged


def test_the_reference_devices_model_failing_on_its_rank_is_reported_by_rank_0(tmp_path):
    """Without local evaluation, only the rank holding the reference device asks for its model."""
    error = launcher_error("reference", str(tmp_path / "run"), "--no-local-eval")
    assert "model file is unreadable; rerun with --resume" in error
    if "[raised on rank" in error:  # rank 1 holds it; else rank 0 printed its own error
        assert re.search(r"\[raised on rank 1, client \d+'s model \(the reference device\)\]$", error), error
