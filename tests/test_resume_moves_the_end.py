"""A resume that moves a run's end (more --rounds, the same, fewer than were planned) must leave
what the run of that length leaves: the last round logged with the final evaluation, every
other round as an ordinary one, and a converged run ended where it converged."""

import errno
import json
import os
import shutil
import signal

import pytest
import torch

from conftest import final_weights, max_diff
from fedhpc import engine as engine_module
from fedhpc import launch
from fedhpc.client_state import ClientStateStore
from fedhpc.config import parse_args
from fedhpc.errors import OutputError
from fedhpc.world import World

BASE = ["--num-clients", "8", "--clients-per-round", "4", "--lr", "0.1", "--local-epochs", "1", "--model", "mlp",
        "--quiet", "--threads", "1", "--no-tensorboard", "--seed", "3"]
COLD = BASE + ["--cold-start-fraction", "0.25"]


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def strip_timing(recs):
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in recs]


def run(args, out, rounds, *extra):
    return launch.main(args + ["--out", str(out), "--rounds", str(rounds), *extra])


def test_a_run_that_converged_in_its_last_round_stays_converged_when_extended(tmp_path):
    """--stop-epsilon met in round c of a c-round run: extended, the longer run would have
    stopped at c too, so nothing more may train."""
    args = BASE + ["--local-epochs", "2", "--checkpoint-every", "0", "--stop-epsilon", "0.15", "--seed", "5"]
    straight = tmp_path / "straight"
    assert run(args, straight, 8) == 0
    converged_at = records(straight)[-1]["round"]
    assert records(straight)[-1]["converged"] and converged_at < 8  # the setting converges early
    cut = tmp_path / "cut"
    assert run(args, cut, converged_at) == 0
    assert records(cut)[-1]["converged"]
    assert run(args, cut, 8, "--resume") == 0
    assert max_diff(final_weights(straight), final_weights(cut)) == 0
    assert strip_timing(records(straight)) == strip_timing(records(cut))


def test_an_extension_that_fails_loses_nothing_of_the_finished_run(tmp_path, monkeypatch):
    """Extending a finished run logs its last round again as an ordinary one; if the extension
    fails before a new round ends, resuming with the old --rounds must bring the final record
    (cold-start metrics) back."""
    out = tmp_path / "run"
    assert run(COLD, out, 4) == 0
    finished = records(out)
    assert "cold_start_accuracy" in finished[-1]

    real = engine_module.Engine.run_round

    def failing(self, t):
        if t == 4:
            raise RuntimeError("simulated failure in round 5")
        return real(self, t)

    monkeypatch.setattr(engine_module.Engine, "run_round", failing)
    assert run(COLD, out, 6, "--resume") != 0
    assert "cold_start_accuracy" not in records(out)[-1]  # the longer run's round 4, as it should read
    monkeypatch.setattr(engine_module.Engine, "run_round", real)
    assert run(COLD, out, 4, "--resume") == 0
    assert records(out) == finished


def test_resuming_with_rounds_equal_to_a_mid_run_checkpoint_ends_the_run_there(tmp_path):
    """An 8-round run stopped after its round-4 checkpoint and resumed with --rounds 4 is the
    4-round run: round 4 logged with the final evaluation, and its checkpoint says so, so a
    later extension logs round 4 as the longer run does."""
    args = COLD + ["--checkpoint-every", "4"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert run(args, straight, 4) == 0
    assert run(args, cut, 8) == 0
    shutil.rmtree(cut / "checkpoints" / "round_000008")
    (cut / "checkpoints" / "LATEST").write_text("round_000004\n")
    assert run(args, cut, 4, "--resume") == 0
    assert "cold_start_accuracy" in records(cut)[-1]
    assert strip_timing(records(cut)) == strip_timing(records(straight))
    assert max_diff(final_weights(straight), final_weights(cut)) == 0
    longer = tmp_path / "longer"
    assert run(args, longer, 6) == 0
    assert run(args, cut, 6, "--resume") == 0
    assert strip_timing(records(cut)) == strip_timing(records(longer))


def test_a_signal_without_out_does_not_claim_a_checkpoint(capsys):
    """No --out: nothing is saved, so the run must not say 'checkpoint written' nor exit with
    the code a requeue reads as 'checkpointed, run again'."""
    real = engine_module.Engine.run_round

    def signalled(self, t):
        metrics = real(self, t)
        if t == 0:
            self._on_signal(signal.SIGUSR1, None)
        return metrics

    engine_module.Engine.run_round = signalled
    try:
        code = launch.main(BASE + ["--rounds", "50", "--no-out"])
    finally:
        engine_module.Engine.run_round = real
    err = capsys.readouterr().err
    assert code == 1 and code != engine_module.EXIT_PREEMPTED
    assert "checkpoint written" not in err
    assert "nothing was saved (no --out)" in err and "give --out DIR" in err


def test_client_state_files_are_synced_and_a_full_disk_is_named(tmp_path, monkeypatch):
    store = ClientStateStore(World(threads=1), 1 << 20, str(tmp_path / "spill"))
    for cid in (3, 7):
        store.put(cid, {"algo": torch.full((4,), float(cid))})
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.save_shard(str(tmp_path / "rank0"))
    assert {"3.pt", "7.pt"} <= set(synced)  # their blocks are on disk before a rename names them

    real_open = open

    def full_disk(path, mode="r", *a, **k):
        if str(path).endswith(".pt") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(OutputError, match=r"cannot write .*3\.pt: No space left on device; free space"):
        store.save_shard(str(tmp_path / "rank0b"))
    store.close()


def test_a_full_disk_under_metrics_jsonl_is_named(tmp_path, monkeypatch):
    """A round's record that cannot be synced to metrics.jsonl (disk full) is an OutputError
    naming the file and the fix, not a bare OSError."""
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "run"
    with pytest.raises(OutputError, match=r"cannot write .*metrics\.jsonl: No space left on device; free space"):
        engine_module.Engine(*parse_args(BASE + ["--out", str(out), "--rounds", "1"]), World(threads=1)).run()
