"""Pre-emption, resume and refusal of bad checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import FAST, REPO, clean_env, final_weights, launch, max_diff, mpiexec
from fedhpc import checkpoint as ckpt
from fedhpc.client_state import ClientStateStore
from fedhpc.errors import CheckpointError
from fedhpc.run_log import WALL_CLOCK_METRICS
from fedhpc.world import World

ARGS = FAST[:]
ARGS[ARGS.index("--rounds") + 1] = "40"
ARGS += ["--checkpoint-every", "0", "--seed", "5"]


def metrics(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def strip_timing(recs):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_METRICS} for r in recs]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full") / "run")
    p = launch(ARGS + ["--out", out])
    assert p.returncode == 0, p.stderr
    return out


def open_mpi() -> bool:
    p = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60)
    return "Open MPI" in p.stdout + p.stderr or "OpenRTE" in p.stdout + p.stderr


def interrupt(out, ranks, after_rounds=3, sig=signal.SIGTERM):
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
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("ranks,sig", [(1, "SIGTERM"), (2, "SIGTERM"), (2, "SIGUSR1")])
def test_sigterm_then_resume_equals_uninterrupted(tmp_path, uninterrupted, ranks, sig):
    """SIGTERM or SLURM's warning SIGUSR1, delivered through mpiexec on 2 ranks. Open MPI's
    mpiexec forwards SIGUSR1 but kills its ranks on SIGTERM (README: signal it with SIGUSR1)."""
    if ranks > 1 and sig == "SIGTERM" and open_mpi():
        pytest.skip("Open MPI's mpiexec kills its ranks on SIGTERM instead of forwarding it")
    out = str(tmp_path / "run")
    code, err = interrupt(out, ranks, sig=getattr(signal, sig))
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


def test_a_run_that_failed_in_its_first_round_can_be_rerun_in_the_same_out(tmp_path):
    """A NaN in round 1 leaves an empty metrics.jsonl and no checkpoint: nothing to protect."""
    out = str(tmp_path / "run")
    p = launch(FAST + ["--out", out, "--lr", "1e30"])
    assert p.returncode == 3 and "NaN or infinite in round 1" in p.stderr, p.stderr
    assert os.path.getsize(os.path.join(out, "metrics.jsonl")) == 0
    assert not os.path.exists(os.path.join(out, "checkpoints"))
    p = launch(FAST + ["--out", out])
    assert p.returncode == 0, p.stderr
    assert [r["round"] for r in metrics(out)] == [1, 2, 3, 4]


def test_resume_extends_a_finished_run(tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    short = ARGS[:]
    short[short.index("--rounds") + 1] = "25"
    assert launch(short + ["--out", out]).returncode == 0
    p = launch(ARGS + ["--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert max_diff(final_weights(uninterrupted), final_weights(out)) <= 1e-5


def test_resume_with_fewer_rounds_than_the_checkpoint_is_refused(tmp_path, uninterrupted):
    """A 40-round run resumed with --rounds 30 printed 'final ... after 30 rounds' over the
    round-40 model; it must say the checkpoint is past --rounds, and change nothing."""
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted, out)
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in ("metrics.jsonl", "config.yaml", "final_model.pt")}
    fewer = ARGS[:]
    fewer[fewer.index("--rounds") + 1] = "30"
    p = launch(fewer + ["--out", out, "--resume"])
    assert p.returncode == 2, p.stderr
    assert "after round 40, past --rounds 30; resume with --rounds 40 or more" in p.stderr, p.stderr
    assert before == {f: os.path.getmtime(os.path.join(out, f)) for f in before}


@pytest.mark.parametrize("algo, extends", [("pmixfed", False), ("pmixfed_dynamic", True)])
def test_an_algorithm_whose_schedule_reads_rounds_does_not_resume_with_other_rounds(tmp_path, algo, extends):
    """pMixFed's delta(t) = t / T: 2 rounds extended to 3 would not be the 3-round run."""
    out = str(tmp_path / "run")
    args = FAST + ["--algo", algo, "--out", out, "--checkpoint-every", "1"]
    assert launch(args[:1] + ["2"] + args[2:]).returncode == 0
    p = launch(args[:1] + ["3"] + args[2:] + ["--resume"])
    if extends:
        assert p.returncode == 0, p.stderr
    else:
        assert p.returncode == 2 and "rounds: checkpoint 2 vs now 3" in p.stderr, p.stderr


@pytest.mark.parametrize("algo, eval_every, first, total", [("fedbabu", 1, 2, 4), ("fedavg", 2, 5, 8)])
def test_a_finished_run_extended_logs_what_the_longer_run_logs(tmp_path, algo, eval_every, first, total):
    """A finished run logged its last round with the final evaluation (FedBABU's fine-tuned
    heads) even off the --eval-every grid; extended, that round must read as in the longer run."""
    def args(rounds, out):
        a = FAST + ["--algo", algo, "--eval-every", str(eval_every), "--out", out]
        a[a.index("--rounds") + 1] = str(rounds)
        return a
    straight, extended = str(tmp_path / "straight"), str(tmp_path / "extended")
    assert launch(args(total, straight)).returncode == 0
    assert launch(args(first, extended)).returncode == 0
    p = launch(args(total, extended) + ["--resume"])
    assert p.returncode == 0, p.stderr
    assert max_diff(final_weights(straight), final_weights(extended)) == 0
    a, b = strip_timing(metrics(straight)), strip_timing(metrics(extended))
    assert [r["round"] for r in b] == [r["round"] for r in a]
    assert a == b


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    out = str(tmp_path / "new")
    p = launch([a for a in FAST if a != "--quiet"] + ["--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "no checkpoint" in p.stdout
    assert len(open(os.path.join(out, "metrics.jsonl")).readlines()) == 4


# ------------------------------------------------ falling back past a damaged checkpoint
# Unit tests of fedhpc.checkpoint on a single-process World, plus one 2-rank probe.

IDENTITY = {"algo": "fedavg", "lr": 0.1, "seed": 3}


class ShardStore:
    """A one-rank client-state store holding clients 3 and 7, as checkpoint.save calls it."""

    def save_shard(self, directory):
        store = ClientStateStore(World(threads=1), 1 << 20, directory + ".spill")
        for cid in (3, 7):
            store.put(cid, {"algo": torch.full((4,), float(cid))})
        store.save_shard(directory)
        store.close()


def saved_run(tmp_path, rounds=(10, 20), identities=None, shards=True):
    """OUT with one checkpoint per round; the global state of round r is filled with r."""
    out = str(tmp_path / "run")
    world = World(threads=1)
    for r in rounds:
        identity = (identities or {}).get(r, IDENTITY)
        server = {"identity": identity, "global_state": torch.full((3,), float(r))}
        ckpt.save(out, r, world, server, ShardStore() if shards else None)
    return out


def cdir(out, r):
    return os.path.join(out, "checkpoints", f"round_{r:06d}")


def flip_byte(path):
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def truncate(path):
    blob = open(path, "rb").read()
    open(path, "wb").write(blob[: len(blob) // 2])


def unreadable_despite_checksum(d):
    """server.pt replaced by junk, manifest updated to match: only torch.load can tell."""
    server = os.path.join(d, "server.pt")
    open(server, "wb").write(b"not a torch file at all")
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    manifest["server_sha256"] = ckpt._sha256(server)
    json.dump(manifest, open(os.path.join(d, "manifest.json"), "w"))


CORRUPTIONS = {
    "manifest_missing": lambda d: os.remove(os.path.join(d, "manifest.json")),
    "manifest_garbage": lambda d: open(os.path.join(d, "manifest.json"), "w").write("{ truncated"),
    "manifest_not_fedhpc": lambda d: open(os.path.join(d, "manifest.json"), "w").write("[1, 2]"),
    "sha_mismatch": lambda d: flip_byte(os.path.join(d, "server.pt")),
    "server_missing": lambda d: os.remove(os.path.join(d, "server.pt")),
    "server_unreadable": unreadable_despite_checksum,
    "shard_missing": lambda d: shutil.rmtree(os.path.join(d, "client_state", "rank0")),
    # One client's state file deleted or cut short after the save: resuming it would restart
    # that client from nothing (a personal model lost) without a word.
    "state_file_missing": lambda d: os.remove(os.path.join(d, "client_state", "rank0", "3.pt")),
    "state_file_truncated": lambda d: truncate(os.path.join(d, "client_state", "rank0", "7.pt")),
    "shard_index_missing": lambda d: os.remove(os.path.join(d, "client_state", "rank0", "index.json")),
    "directory_gone": lambda d: shutil.rmtree(d),  # LATEST names a directory that is not there
}
# The words each warning must carry so a user knows what broke.
REASON = {"manifest_missing": "manifest.json", "manifest_garbage": "manifest.json",
          "manifest_not_fedhpc": "manifest.json", "sha_mismatch": "sha256",
          "server_missing": "server.pt is missing", "server_unreadable": "cannot be read",
          "shard_missing": "rank0", "directory_gone": "LATEST names",
          "state_file_missing": "3.pt is missing", "state_file_truncated": "7.pt has",
          "shard_index_missing": "index.json"}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_damaged_newest_falls_back_to_the_older_one_with_a_warning(tmp_path, kind):
    out = saved_run(tmp_path)
    CORRUPTIONS[kind](cdir(out, 20))
    warnings = []
    directory, body = ckpt.load_latest_intact(out, IDENTITY, warn=warnings.append)
    assert directory == cdir(out, 10)
    assert body["round"] == 10 and body["global_state"].tolist() == [10.0] * 3
    assert body["client_state_dirs"] == [os.path.join(cdir(out, 10), "client_state", "rank0")]
    assert len(warnings) == 1
    assert "round_000020" in warnings[0] and cdir(out, 10) in warnings[0], warnings[0]
    assert REASON[kind] in warnings[0], warnings[0]
    # load() on the damaged one alone still refuses it, naming it
    if kind != "directory_gone":
        with pytest.raises(CheckpointError, match="round_000020.*corrupt"):
            ckpt.load(cdir(out, 20), IDENTITY)


def test_intact_newest_is_used_silently(tmp_path):
    out = saved_run(tmp_path)
    warnings = []
    directory, body = ckpt.load_latest_intact(out, IDENTITY, warn=warnings.append)
    assert directory == cdir(out, 20) == ckpt.latest(out) and body["round"] == 20
    assert body["global_state"].tolist() == [20.0] * 3 and warnings == []
    assert ckpt.load(directory, IDENTITY)["round"] == 20


def restored_store(directory, indexed=True):
    store = ClientStateStore(World(threads=1), 1 << 20, os.path.join(os.path.dirname(directory), "spill"))
    store.load_shards([os.path.join(directory, "client_state", "rank0")], indexed)
    return store


def test_client_states_restore_as_saved_and_a_changed_byte_is_named(tmp_path):
    """A flipped byte keeps the file's size, so only the sha256 check as the state loads sees it."""
    out = saved_run(tmp_path, rounds=(10,))
    store = restored_store(cdir(out, 10))
    assert store.location == {3: 0, 7: 0}
    assert store.get(3)["algo"].tolist() == [3.0] * 4 and store.get(7)["algo"].tolist() == [7.0] * 4
    flip_byte(os.path.join(cdir(out, 10), "client_state", "rank0", "7.pt"))
    with pytest.raises(CheckpointError, match=r"7\.pt is corrupt.*sha256.*move .*checkpoints.* away"):
        restored_store(cdir(out, 10))


def test_a_checkpoint_saved_before_shard_indexes_still_resumes(tmp_path):
    """Without an index (manifest without client_state_index) a shard's <cid>.pt files are read
    as they are; other files there are not clients."""
    out = saved_run(tmp_path, rounds=(10,))
    shard = os.path.join(cdir(out, 10), "client_state", "rank0")
    os.remove(os.path.join(shard, "index.json"))
    open(os.path.join(shard, "notes.pt"), "w").write("a stray file")
    manifest_path = os.path.join(cdir(out, 10), "manifest.json")
    manifest = json.load(open(manifest_path))
    del manifest["client_state_index"]
    json.dump(manifest, open(manifest_path, "w"))
    directory, body = ckpt.load_latest_intact(out, IDENTITY, warn=None)
    assert body["client_state_indexed"] is False
    assert restored_store(directory, indexed=False).location == {3: 0, 7: 0}


def test_no_checkpoint_gives_none(tmp_path):
    assert ckpt.load_latest_intact(str(tmp_path / "nothing"), IDENTITY) is None
    os.makedirs(tmp_path / "empty" / "checkpoints")
    assert ckpt.load_latest_intact(str(tmp_path / "empty"), IDENTITY) is None


def test_default_warning_goes_to_stderr(tmp_path, capsys):
    out = saved_run(tmp_path)
    flip_byte(os.path.join(cdir(out, 20), "server.pt"))
    directory, _ = ckpt.load_latest_intact(out, IDENTITY)
    cap = capsys.readouterr()
    assert directory == cdir(out, 10) and cap.out == ""
    assert cap.err.startswith("warning:") and "round_000020" in cap.err and cdir(out, 10) in cap.err


def test_missing_latest_file_uses_newest_intact_directory(tmp_path):
    out = saved_run(tmp_path)
    os.remove(os.path.join(out, "checkpoints", "LATEST"))
    warnings = []
    directory, _ = ckpt.load_latest_intact(out, IDENTITY, warn=warnings.append)
    assert directory == cdir(out, 20) and "LATEST is missing" in warnings[0]


def test_latest_is_the_authority_when_intact(tmp_path):
    """LATEST names the last save that completed; a directory of a later round (a crash
    between its rename and the LATEST update) is only a fallback candidate."""
    out = saved_run(tmp_path)
    open(os.path.join(out, "checkpoints", "LATEST"), "w").write("round_000010\n")
    directory, _ = ckpt.load_latest_intact(out, IDENTITY, warn=pytest.fail)
    assert directory == cdir(out, 10)


def test_every_checkpoint_damaged_is_refused_naming_each(tmp_path):
    out = saved_run(tmp_path)
    flip_byte(os.path.join(cdir(out, 20), "server.pt"))
    os.remove(os.path.join(cdir(out, 10), "manifest.json"))
    warnings = []
    with pytest.raises(CheckpointError) as e:
        ckpt.load_latest_intact(out, IDENTITY, warn=warnings.append)
    msg = str(e.value)
    assert "no intact checkpoint" in msg
    assert os.path.join(cdir(out, 20), "server.pt") in msg
    assert os.path.join(cdir(out, 10), "manifest.json") in msg
    assert "start afresh" in msg and warnings == []


def test_other_runs_checkpoint_is_refused_not_skipped(tmp_path):
    """Newest written with other settings, older one matching: still refused (--out holds
    another run), and the message names the differing setting."""
    out = saved_run(tmp_path, identities={20: dict(IDENTITY, lr=0.5)})
    with pytest.raises(CheckpointError, match=r"different run \(lr: checkpoint 0.5 vs now 0.1\)"):
        ckpt.load_latest_intact(out, IDENTITY, warn=pytest.fail)
    # and after skipping a damaged newest, a mismatched older one is refused too
    out2 = saved_run(tmp_path / "b", identities={10: dict(IDENTITY, seed=4)})
    flip_byte(os.path.join(cdir(out2, 20), "server.pt"))
    with pytest.raises(CheckpointError, match="different run.*seed"):
        ckpt.load_latest_intact(out2, IDENTITY, warn=lambda m: None)


def test_other_format_version_is_refused_not_skipped(tmp_path):
    out = saved_run(tmp_path)
    path = os.path.join(cdir(out, 20), "manifest.json")
    manifest = json.load(open(path))
    manifest["version"] = ckpt.VERSION + 1
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CheckpointError, match="format version"):
        ckpt.load_latest_intact(out, IDENTITY, warn=pytest.fail)


def test_save_after_fallback_drops_the_abandoned_newer_checkpoint(tmp_path):
    """Resumed from round 10 past a damaged round 20, the run saves round 11: round 20 is
    from an abandoned history, so it goes, and the kept ones are 11 and 10 (by round, not
    by name order, which would have deleted round 10 and kept the damaged 20)."""
    out = saved_run(tmp_path)
    flip_byte(os.path.join(cdir(out, 20), "server.pt"))
    os.makedirs(os.path.join(out, "checkpoints", "round_000015.partial"))  # a crashed save
    ckpt.save(out, 11, World(threads=1), {"identity": IDENTITY, "global_state": torch.zeros(3)})
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "round_000010", "round_000011"]
    directory, body = ckpt.load_latest_intact(out, IDENTITY, warn=pytest.fail)
    assert directory == cdir(out, 11) and body["client_state_dirs"] == []


class FakeWorld:
    """Rank ``rank`` of ``size``; all_gather_object answers with ``others`` around our own."""

    def __init__(self, rank, size, others):
        self.rank, self.size, self.others = rank, size, others

    def all_gather_object(self, obj):
        every = list(self.others)
        every.insert(self.rank, obj)
        return every


def test_only_rank_zero_warns_and_ranks_must_agree(tmp_path):
    out = saved_run(tmp_path)
    flip_byte(os.path.join(cdir(out, 20), "server.pt"))
    same = ("use", "round_000010")
    for rank, expect in ((0, 1), (1, 0)):
        warnings = []
        directory, _ = ckpt.load_latest_intact(out, IDENTITY, warn=warnings.append,
                                               world=FakeWorld(rank, 2, [same]))
        assert directory == cdir(out, 10) and len(warnings) == expect
    with pytest.raises(CheckpointError, match="ranks see different checkpoints"):
        ckpt.load_latest_intact(out, IDENTITY, world=FakeWorld(0, 2, [("use", "round_000020")]))
    with pytest.raises(CheckpointError, match="peer's problem"):
        ckpt.load_latest_intact(out, IDENTITY, world=FakeWorld(1, 2, [("error", "peer's problem")]))


def test_two_ranks_fall_back_together(tmp_path):
    """Real ranks: collective save with a shard per rank, damaged newest -> both ranks use
    the older one, only rank 0 warns; private copies that agree are fine; copies that
    differ (node-local disks) make both ranks refuse instead of diverging or hanging."""
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    probe = os.path.join(REPO, "tests", "checkpoint_probe.py")
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, probe, str(tmp_path)], cwd=REPO,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.load(open(tmp_path / f"result{r}.json")) for r in (0, 1)]
    assert [r["size"] for r in res] == [2, 2]
    for r, rec in enumerate(res):
        assert rec["fallback"]["directory"] == "round_000010" and rec["fallback"]["round"] == 10
        assert rec["fallback"]["shards"] == ["client_state/rank0", "client_state/rank1"]
        assert len(rec["fallback"]["warnings"]) == (1 if r == 0 else 0)
        assert rec["same"]["directory"] == "round_000020" and rec["same"]["warnings"] == []
        assert "ranks see different checkpoints" in rec["divergent"]["error"]
    w = res[0]["fallback"]["warnings"][0]
    assert "round_000020" in w and "round_000010" in w


def test_resume_past_a_corrupt_checkpoint_end_to_end(tmp_path, uninterrupted):
    """Rounds 20 and 30 kept; round 30 damaged; --resume continues from round 20 with a
    warning naming both, and ends with the uninterrupted run's model and metrics.
    (Needs Engine.restore to call checkpoint.load_latest_intact.)"""
    out = str(tmp_path / "run")
    short = ARGS[:]
    short[short.index("--rounds") + 1] = "30"
    short[short.index("--checkpoint-every") + 1] = "10"
    assert launch(short + ["--out", out]).returncode == 0
    assert sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d != "LATEST") == \
        ["round_000020", "round_000030"]
    flip_byte(os.path.join(cdir(out, 30), "server.pt"))
    p = launch(ARGS + ["--out", out, "--resume", "--checkpoint-every", "10"])
    assert p.returncode == 0, p.stderr
    assert "round_000030" in p.stderr and "round_000020" in p.stderr and "warning" in p.stderr
    assert max_diff(final_weights(uninterrupted), final_weights(out)) <= 1e-5
    a, b = strip_timing(metrics(uninterrupted)), strip_timing(metrics(out))
    assert [r["round"] for r in b] == list(range(1, 41))
    for x, y in zip(a, b):
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("typed", ["fl", "FedAvg"])
def test_a_checkpoint_naming_the_algorithm_as_typed_resumes_under_its_registry_name(tmp_path, typed):
    """Runs started before the launcher stored canonical names hold the alias or the case the
    user typed (the shipped Mix2FLD sweeps use algo: fl); they resume under the canonical name,
    and another algorithm is still refused."""
    out = saved_run(tmp_path, rounds=(10,), identities={10: {**IDENTITY, "algo": typed}})
    directory, body = ckpt.load_latest_intact(out, IDENTITY, warn=None)
    assert body["round"] == 10
    with pytest.raises(CheckpointError, match="algo: checkpoint 'fedavg' vs now 'fedprox'"):
        ckpt.load_latest_intact(out, {**IDENTITY, "algo": "fedprox"}, warn=None)


def test_options_written_out_at_their_defaults_are_the_same_run(tmp_path):
    """Option mappings compare as today's code resolves them: a checkpoint of a run started
    with {} resumes under a file that now writes an option out at its default (the pMixFed
    files' finetune_epochs: 4), or model options equal to the builder's defaults; a value that
    differs is refused, naming just that option."""
    from fedhpc.config import parse_args
    from fedhpc.server.channel import ChannelOptions
    old, _, _ = parse_args(["--algo", "pmixfed", "--model", "cnn", "--channel", "symmetric"])
    new, _, _ = parse_args(["--algo", "pmixfed", "--model", "cnn", "--channel", "symmetric",
                            "--finetune-epochs", "4", "--model-opt", "width=16", "--data-opt", "test_fraction=0.2",
                            "--channel-opt", "num_channels=" + str(ChannelOptions().num_channels)])
    assert old.identity() != new.identity()
    out = saved_run(tmp_path, rounds=(10,), identities={10: old.identity()})
    assert ckpt.load_latest_intact(out, new.identity(), warn=None)[1]["round"] == 10
    other, _, _ = parse_args(["--algo", "pmixfed", "--model", "cnn", "--channel", "symmetric",
                              "--finetune-epochs", "2", "--model-opt", "width=8"])
    with pytest.raises(CheckpointError) as e:
        ckpt.load_latest_intact(out, other.identity(), warn=None)
    msg = str(e.value)
    assert "algo_options.finetune_epochs: checkpoint 4 vs now 2" in msg
    assert "model_options.width: checkpoint 16 vs now 8" in msg and "mu" not in msg


def test_a_checkpoint_from_older_partition_rules_is_refused(tmp_path):
    """classes:K once meant a cyclic deal: a checkpoint written under the old rules names the
    same spec but another split, so resuming it onto today's partition must be refused."""
    from fedhpc.config import RunConfig
    ident = RunConfig(partition="classes:2").identity()
    assert ident["partition_rules"] >= 2
    old = {k: v for k, v in ident.items() if k != "partition_rules"}  # an older release's checkpoint
    out = saved_run(tmp_path, rounds=(10,), identities={10: old})
    with pytest.raises(CheckpointError, match="partition_rules"):
        ckpt.load_latest_intact(out, ident, warn=None)


@pytest.mark.parametrize("saved, now", [
    ("Dirichlet:.50", "dirichlet:0.5"),
    ("dirichlet_capped:0.5", "dirichlet_capped:0.5:10"),
    ("deficient:3,1:2:60", "deficient:1,3:2:60"),
    ("classes: 2", "classes:2"),
    ("AUTO", "auto"),
])
def test_a_partition_spelled_another_way_is_the_same_run(tmp_path, saved, now):
    out = saved_run(tmp_path, rounds=(10,), identities={10: {**IDENTITY, "partition": saved}})
    assert ckpt.load_latest_intact(out, {**IDENTITY, "partition": now}, warn=None)[1]["round"] == 10
    with pytest.raises(CheckpointError, match="partition: checkpoint"):
        ckpt.load_latest_intact(out, {**IDENTITY, "partition": "dirichlet:0.3"}, warn=None)


@pytest.mark.parametrize("a, b", [
    ("Dirichlet:.50", "dirichlet:0.5"),
    ("dirichlet_capped:0.5", "dirichlet_capped:0.5:10"),
    ("deficient:3,1:2:10", "deficient:1,3:2:10"),
    ("classes: 2", "classes:2"),
])
def test_partition_spellings_called_the_same_run_deal_the_same_split(a, b):
    """What makes the resume above honest: the two spellings really deal one split, sample for
    sample (and a spelling of another split does not compare equal)."""
    import numpy as np

    from fedhpc.data.partition import CAPPED_MIN_SAMPLES, canonical_partition, make_partition
    assert CAPPED_MIN_SAMPLES == 10  # the explicit MIN in the cases above
    assert canonical_partition(a) == canonical_partition(b)
    assert canonical_partition(a) != canonical_partition("dirichlet:0.3")
    labels = np.random.default_rng(0).integers(0, 6, size=600)
    pa, pb = make_partition(a, labels, 6, 3), make_partition(b, labels, 6, 3)
    assert len(pa) == len(pb) == 6 and all(np.array_equal(x, y) for x, y in zip(pa, pb))


def test_a_run_left_at_model_auto_resumes_under_the_model_it_stood_for(tmp_path):
    """The digits' default model is the CNN: a run started with --model auto (the default) and
    resumed naming cnn is the same run, and the other way round; naming another model is not.
    In this process (the launcher's parsing, the engine's identity check): the refusal's exit code
    and message on the command line are test_mismatched_checkpoint_is_refused's."""
    from standard_runner import run_case

    def args(rounds, model, out):
        a = FAST + ["--out", out, "--checkpoint-every", "1"]
        a[a.index("--rounds") + 1] = str(rounds)
        a[a.index("--model") + 1] = model
        return a
    straight = str(tmp_path / "straight")
    run_case(args(3, "cnn", straight), World(threads=1))
    for first, then in (("auto", "cnn"), ("cnn", "auto")):
        out = str(tmp_path / f"{first}-{then}")
        run_case(args(2, first, out), World(threads=1))
        eng, _, _ = run_case(args(3, then, out) + ["--resume"], World(threads=1))
        assert eng.start_round == 2, "the run was not resumed"
        assert max_diff(final_weights(straight), final_weights(out)) == 0
    with pytest.raises(CheckpointError, match="model: checkpoint 'cnn' vs now 'mlp'"):
        run_case(args(3, "mlp", str(tmp_path / "auto-cnn")) + ["--resume"], World(threads=1))


# ------------------------------------------------ server state: FedAvgM's momentum buffer

def test_fedavg_with_server_momentum_resumed_equals_uninterrupted_bit_for_bit(tmp_path, monkeypatch):
    """FedAvgM (--server-momentum 0.5) carries a velocity from round to round: interrupted after
    round 2 (as SIGTERM stops it) and resumed in this process, the run ends on the uninterrupted
    run's model and metrics, bit for bit. Control: with the velocity left out of the algorithm's
    state_dict (what a forgotten buffer looks like) the resumed run ends elsewhere, so the
    comparison above can see a lost buffer."""
    from fedhpc.algorithms.fedavg import FedAvg
    from fedhpc.engine import Preempted
    from standard_runner import run_case

    argv = FAST + ["--algo", "fedavg", "--server-momentum", "0.5", "--seed", "5", "--checkpoint-every", "1"]

    def resumed(out):
        with pytest.raises(Preempted):
            run_case(argv + ["--out", out], World(threads=1), interrupt_after=2)
        return run_case(argv + ["--out", out, "--resume"], World(threads=1))

    full, full_final, _ = run_case(argv + ["--out", str(tmp_path / "full")], World(threads=1))
    assert full.algo.server_velocity is not None and float(full.algo.server_velocity.abs().max()) > 0
    res, res_final, _ = resumed(str(tmp_path / "cut"))
    assert torch.equal(full.global_state, res.global_state), \
        float((full.global_state - res.global_state).abs().max())
    assert torch.equal(full.algo.server_velocity, res.algo.server_velocity)
    untimed = lambda m: {k: v for k, v in m.items() if k not in WALL_CLOCK_METRICS}  # noqa: E731
    assert untimed(full_final) == untimed(res_final)
    rows = [strip_timing(metrics(d)) for d in (tmp_path / "full", tmp_path / "cut")]
    assert [r["round"] for r in rows[1]] == [1, 2, 3, 4] and rows[0] == rows[1]

    monkeypatch.setattr(FedAvg, "state_dict", lambda self: {})
    lost, _, _ = resumed(str(tmp_path / "lost"))
    assert float((full.global_state - lost.global_state).abs().max()) > 1e-4, "a lost velocity went unnoticed"
