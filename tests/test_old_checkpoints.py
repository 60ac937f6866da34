"""Checkpoints written by an older fedhpc resume with today's code and end where today's
uninterrupted run ends.

Every other resume test resumes what the same code wrote a moment before, or a body crafted
to look old. The runs under tests/fixtures/old_checkpoints/ were made by the commit named in
its COMMIT file, or in the case folder's own COMMIT (make.sh there regenerates them), on two
ranks, and cut after their round-2 checkpoint. That commit predates several things today's reader must fill in for an old
checkpoint: client-state shards without index.json, pMixFed's --first-layer-index (its
layers were numbered from 0) and ``rounds`` in its identity, an algorithm name stored as typed
('FedMix'), the mean-data download record. Every algorithm that commit had is there, FedAlign
made by a later one (make.sh says why); each run is resumed here on one rank (the two shards
fold onto it).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fedhpc.errors import CheckpointError
from fedhpc.world import World
from standard_runner import run_case
from test_algorithm_standard import assert_states_equal

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "old_checkpoints")
CASES = json.load(open(os.path.join(HERE, "cases.json")))


def _commit(name):
    """The commit that wrote case ``name``: its folder's COMMIT, else the fixtures' default."""
    own = os.path.join(HERE, name, "COMMIT")
    return open(own if os.path.exists(own) else os.path.join(HERE, "COMMIT")).read().strip()[:10]


#: what make.sh adds to every case
COMMON = ["--rounds", "4", "--checkpoint-every", "2", "--threads", "1", "--no-tensorboard", "--quiet"]
#: what today's resume must be told that the old run did not write down
TODAY = {"pmixfed": ["--first-layer-index", "0"],  # the only numbering before the option existed
         "pmixfed_dynamic": ["--first-layer-index", "0"]}


def _argv(name):
    return CASES[name] + COMMON + TODAY.get(name, [])


def _model_rows(out):
    """metrics.jsonl's rows without traffic and time (the old code booked mean-data downloads
    every round; today once per refresh)."""
    keep = ("round", "train_loss", "test_accuracy", "test_loss", "clients")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))]


@pytest.fixture(scope="module")
def todays_runs(tmp_path_factory):
    """Each case run uninterrupted by today's code, once: name -> (out, engine, client states)."""
    done = {}

    def get(name):
        if name not in done:
            out = str(tmp_path_factory.mktemp(name) / "full")
            eng, _, states = run_case(_argv(name) + ["--out", out], World(threads=1))
            done[name] = out, eng, states
        return done[name]
    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_checkpoint_resumes_to_where_todays_uninterrupted_run_ends(name, tmp_path, todays_runs):
    resumed = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(HERE, name), resumed)
    eng_res, _, states_res = run_case(_argv(name) + ["--out", resumed, "--resume"], World(threads=1))
    assert eng_res.start_round == 2, "the old checkpoint was not resumed (the run started over)"
    full, eng_full, states_full = todays_runs(name)
    assert torch.equal(eng_full.global_state, eng_res.global_state), (
        f"resuming {_commit(name)}'s round-2 checkpoint of {name} ends "
        f"{float((eng_full.global_state - eng_res.global_state).abs().max()):.3g} away from today's uninterrupted "
        f"run (if test_the_old_commit_ran_the_case_as_today_does fails too, today's numbers differ from that "
        f"commit's: when intended, regenerate with bash tests/fixtures/old_checkpoints/make.sh HEAD {name})")
    assert_states_equal(states_full, states_res)
    # rounds 3-4 that the old run wrote after its checkpoint were rewound and written again by
    # today's code; rounds 1-2 are the old run's (its 2-rank loss sums differ from today's 1-rank
    # ones in the last digits: the accuracies, counts, are exact)
    old_rows, rows = _model_rows(resumed), _model_rows(full)
    assert [r["round"] for r in old_rows] == [r["round"] for r in rows] == [1, 2, 3, 4]
    assert old_rows[2:] == rows[2:]
    for old, new in zip(old_rows[:2], rows[:2]):
        if not eng_full.algo.has_global_model:  # the old code logged FD's untrained global model too
            assert old.keys() - new.keys() == {"test_accuracy", "test_loss"}
            old = {k: old[k] for k in new}
        assert old.get("test_accuracy") == new.get("test_accuracy") and old == pytest.approx(new, rel=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_old_commit_ran_the_case_as_today_does(name, todays_runs):
    """The fixtures test today's reader only while the old commit's runs are today's: its final
    model (round 4, two ranks) is today's uninterrupted one (one rank)."""
    old = torch.load(os.path.join(HERE, name, "old_final_model.pt"), weights_only=False)
    today = torch.load(os.path.join(todays_runs(name)[0], "final_model.pt"), weights_only=False)
    assert old.keys() == today.keys()
    for k in old:
        if k.endswith("num_batches_tracked"):  # since 9a5a080 not federated: the file holds the initial 0
            continue
        assert torch.equal(old[k], today[k]), (
            f"{name}: {k} differs from {_commit(name)}'s: if today's numbers changed on purpose, regenerate the "
            f"case with bash tests/fixtures/old_checkpoints/make.sh HEAD {name}")


def test_an_old_pmixfed_checkpoint_is_refused_under_todays_default_numbering(tmp_path):
    out = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(HERE, "pmixfed"), out)
    with pytest.raises(CheckpointError, match="resume with --first-layer-index 0"):
        run_case(CASES["pmixfed"] + COMMON + ["--out", out, "--resume"], World(threads=1))
    # refused before anything was written: the old run is intact and still resumes
    assert open(os.path.join(out, "checkpoints", "LATEST")).read().strip() == "round_000002"
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "round_000002"]


def test_a_setting_the_old_checkpoint_did_not_record_is_read_from_its_runs_config_yaml(tmp_path):
    """The old pMixFed checkpoint predates ``rounds`` in its identity (the schedule delta(t) = t/T
    reads it): the run's config.yaml says 4, so --rounds 6 is refused as another run, and without
    config.yaml the refusal says what is missing."""
    out = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(HERE, "pmixfed"), out)
    longer = _argv("pmixfed")
    longer[longer.index("--rounds") + 1] = "6"
    with pytest.raises(CheckpointError, match="rounds: checkpoint 4 vs now 6"):
        run_case(longer + ["--out", out, "--resume"], World(threads=1))
    os.remove(os.path.join(out, "config.yaml"))
    with pytest.raises(CheckpointError, match=r"rounds: not recorded by the checkpoint \(it predates that record\) "
                                              r"nor by the run's config.yaml beside checkpoints/"):
        run_case(_argv("pmixfed") + ["--out", out, "--resume"], World(threads=1))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "round_000002"]
