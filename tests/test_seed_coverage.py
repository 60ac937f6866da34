"""Which labels MixFLD / Mix2FLD seeds cover (issue 39, section 2, item 1).

Mix2FLD Sec. III-B: each device "randomly selects two different raw samples ... having
different labels". A schedule that gave every device the same label pair per seed slot, drawn
afresh for each slot, left whole labels out of the server's seed set (N_S = 10, run seed 0:
labels 1, 5 and 6 absent, counts 30 vs 5), and so out of the server's output-to-model
conversion. Under the default schedule every label is in every server seed set, as evenly as
N_S allows, and the inverse mixup of Eqs. 7-8 still finds its partners (N_I = 2 N_S).

Expected values are counted here from the seed sets' label tuples and raw sources.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import CheckpointError
from fedhpc.exchanges.seed_samples import SeedSet
from fedhpc.world import World

C = 10
DEVICES = 10
#: the paper's setting on the digits twin: 10 devices, every label on every device, two of them
#: minority labels (launch/mix2fld_digits.yaml's partition, all of it for training as in the
#: paper's 500 samples a device); and its IID twin
PARTITIONS = ["skewed:2:1:13", "skewed:0:0:13"]


def engine(algo, seed, n_seeds, n_inverse, partition, extra=("--client-test-fraction", "0")):
    cfg, ao, do = parse_args(["--algo", algo, "--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=8",
                              "--num-clients", str(DEVICES), "--clients-per-round", str(DEVICES),
                              "--partition", partition, "--seed", str(seed), "--rounds", "1",
                              "--seeds-per-device", str(n_seeds), "--inverse-per-device", str(n_inverse),
                              "--server-steps", "1", "--threads", "1", "--quiet", "--no-tensorboard",
                              "--no-out", *extra])
    return Engine(cfg, ao, do, World(threads=1))


def collected_seeds(eng) -> SeedSet:
    return SeedSet.cat([eng.algo.make_seeds(cid) for cid in eng.training_clients])


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("n_seeds", [10, 20, 50])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_every_label_is_in_the_server_seed_set_and_evenly(seed, n_seeds, partition):
    eng = engine("mixfld", seed, n_seeds, n_seeds, partition)
    s = collected_seeds(eng)
    counts = torch.bincount(s.labels.flatten(), minlength=C)
    assert int(counts.min()) > 0, f"seed {seed}, N_S {n_seeds}: labels {(counts == 0).nonzero().flatten().tolist()} absent"
    # N_S * N label slots per device, 10 labels: N_S = 10, 20, 50 divide evenly, so every label
    # is in exactly as many seeds as every other
    assert counts.tolist() == [DEVICES * n_seeds * 2 // C] * C, counts.tolist()
    # and every device's own seeds cover every label, evenly
    for cid in eng.training_clients:
        mine = torch.bincount(s.labels[s.owner == cid].flatten(), minlength=C)
        assert mine.tolist() == [n_seeds * 2 // C] * C, (cid, mine.tolist())


def test_devices_missing_labels_still_leave_no_label_out():
    """launch/mix2fld_digits.yaml keeps a fifth of each device's data for its local test split, so
    a device may hold no training sample of a minority label: its slots that would use the label
    take the next labels it holds, and the server's set still covers every label."""
    for seed in range(5):
        eng = engine("mixfld", seed, 10, 10, PARTITIONS[0], extra=("--client-test-fraction", "0.2"))
        assert any(len(eng.data.client(c).y.unique()) < C for c in eng.training_clients)  # the case in point
        s = collected_seeds(eng)
        counts = torch.bincount(s.labels.flatten(), minlength=C)
        assert int(counts.min()) >= DEVICES, counts.tolist()
        for cid in eng.training_clients:  # each device: every label it holds
            held = set(eng.data.client(cid).y.tolist())
            assert set(s.labels[s.owner == cid].flatten().tolist()) == held


@pytest.mark.parametrize("n_seeds", [7, 13])
def test_a_number_of_seeds_that_does_not_divide_evenly_spreads_labels_within_one_slot(n_seeds):
    """N_S * N label slots that 10 labels do not divide: label counts differ by at most one slot's
    worth (one seed on each device)."""
    for seed in range(3):
        s = collected_seeds(engine("mixfld", seed, n_seeds, n_seeds, PARTITIONS[0]))
        counts = torch.bincount(s.labels.flatten(), minlength=C)
        assert int(counts.min()) > 0 and int(counts.max() - counts.min()) <= DEVICES, counts.tolist()


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("n_seeds", [10, 20, 50])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mix2fld_inverts_every_label_at_twice_as_many_samples_as_seeds(seed, n_seeds, partition):
    """(N_S, N_I) = (N_S, 2 N_S), the paper's most demanding ratio: the server finds enough pairs of
    seeds from different devices with mirrored label pairs, every label is among its hard-labelled
    samples, and each sample's raw sources carry weight 1 on its label and 0 on every other."""
    eng = engine("mix2fld", seed, n_seeds, 2 * n_seeds, partition)
    collected = collected_seeds(eng)
    out = eng.algo.server_samples(collected)
    assert len(out) == 2 * n_seeds * DEVICES
    hard = out.labels.flatten()
    counts = torch.bincount(hard, minlength=C)
    assert int(counts.min()) > 0, counts.tolist()
    raw_labels = {cid: eng.data.client(cid).y for cid in eng.training_clients}
    for row in range(len(out)):
        by_label = torch.zeros(C, dtype=torch.float64)
        for cid, idx, w in zip(out.source_cid[row].tolist(), out.source_index[row].tolist(), out.weights[row].tolist()):
            by_label[int(raw_labels[cid][idx])] += w
        want = torch.zeros(C, dtype=torch.float64)
        want[int(hard[row])] = 1.0
        assert torch.allclose(by_label, want, atol=1e-9), (row, by_label.tolist())
        assert len(set(out.source_cid[row].tolist())) == 2  # two different devices (Sec. III-C)


# ----------------------------------------------------------------------------- resuming under the schedule a run began with

OLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "old_checkpoints")


def restored(argv, out):
    cfg, ao, do = parse_args(argv + ["--out", out, "--resume", "--threads", "1", "--quiet", "--no-tensorboard"])
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.restore()
    return eng


@pytest.mark.parametrize("algo", ["mixfld", "mix2fld"])
def test_a_checkpoint_from_before_the_balanced_schedule_resumes_under_the_shared_one(algo, tmp_path):
    """Its seeds were made under 'shared' (the default then), and a resumed run makes them again:
    --seed-pairing auto (the default) and shared resume it so; balanced is refused, not run on
    other seeds than the checkpointed rounds trained on."""
    # the lr and local epochs the old run had from the defaults of its day (its identity names them;
    # its K_s, 200, is in cases.json)
    argv = json.load(open(os.path.join(OLD, "cases.json")))[algo] + [
        "--rounds", "4", "--checkpoint-every", "2", "--lr", "0.05", "--local-epochs", "1"]
    for flag, want in (([], "shared"), (["--seed-pairing", "shared"], "shared")):
        out = str(tmp_path / f"run{len(flag)}")
        shutil.copytree(os.path.join(OLD, algo), out)
        eng = restored(argv + flag, out)
        assert eng.start_round == 2 and eng.algo.seed_pairing == want
        eng.client_state.close(), eng.data.close()
    out = str(tmp_path / "balanced")
    shutil.copytree(os.path.join(OLD, algo), out)
    with pytest.raises(CheckpointError, match="resume with --seed-pairing auto"):
        restored(argv + ["--seed-pairing", "balanced"], out)


def test_a_new_run_records_its_schedule_and_a_resume_asking_for_another_is_refused(tmp_path):
    out = str(tmp_path / "run")
    argv = ["--algo", "mix2fld", "--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=8",
            "--num-clients", "6", "--clients-per-round", "6", "--server-steps", "2", "--seeds-per-device", "5",
            "--inverse-per-device", "5"]
    cfg, ao, do = parse_args(argv + ["--rounds", "1", "--out", out, "--threads", "1", "--quiet", "--no-tensorboard"])
    Engine(cfg, ao, do, World(threads=1)).run()
    eng = restored(argv + ["--rounds", "2"], out)
    assert eng.algo.seed_pairing == "balanced"
    eng.client_state.close(), eng.data.close()
    with pytest.raises(CheckpointError, match="made with --seed-pairing balanced, this run asks for shared"):
        restored(argv + ["--rounds", "2", "--seed-pairing", "shared"], out)
