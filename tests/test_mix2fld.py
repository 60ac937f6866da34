"""The FLD family through the engine: what crosses the network by kind, the privacy audit,
the per-label stopping rule of FD / FLD, and which seeds reach the server (--seed-delivery)."""

import json
import math
import os

import pytest
import torch

from fedhpc.algorithms.fd import label_relative_change
from fedhpc.config import parse_args
from fedhpc.errors import ConfigError
from fedhpc.engine import Engine
from fedhpc.world import World

#: hand computations compared within tolerances that must hold on any CPU (scripts/test.sh runs them twice)
pytestmark = pytest.mark.cross_cpu

COMMON = ["--dataset", "digits", "--model", "mlp", "--num-clients", "5", "--clients-per-round", "5",
          "--rounds", "2", "--threads", "1", "--quiet", "--no-tensorboard", "--partition", "iid"]
ARGS = COMMON + ["--server-steps", "3", "--seeds-per-device", "4", "--inverse-per-device", "6"]


def run_two_rounds(algo):
    cfg, ao, do = parse_args(["--algo", algo, *ARGS])
    eng = Engine(cfg, ao, do, World(threads=1))
    return eng, [eng.run_round(0), eng.run_round(1)]


@pytest.mark.parametrize("algo", ["fld", "mixfld", "mix2fld"])
def test_ledger_books_outputs_seeds_and_parameters_by_kind(algo):
    eng, (r1, r2) = run_two_rounds(algo)
    C, devices = 10, 5
    pixels = 64  # 8x8 digits, 8 bits each; plus one byte per label of a seed
    labels = 1 if algo == "fld" else 2
    assert r1["bytes_up_outputs"] == r2["bytes_up_outputs"] == devices * C * C * 4  # 32-bit table
    assert r1["bytes_up_seeds"] == devices * 4 * (pixels + labels)                     # round 1 only
    assert r2["bytes_up_seeds"] == 0
    assert r1["bytes_up_parameters"] == 0                                              # never weights up
    assert r1["bytes_down_parameters"] == devices * eng.flat.numel * 4                 # weights down


@pytest.mark.parametrize("algo", ["fld", "mix2fld"])
def test_each_device_books_its_own_seeds_and_a_held_out_device_none(algo):
    """seed_bytes against a brute-force selection of each device's rows of the collected set;
    cold-start devices upload no seeds, so the counts differ between devices. N_I = 4: the three
    training devices (two in one rotation, one in the other) under the default 'balanced' label
    schedule, whose four slots hold four different pairs, have 4 x 2 = 8 inverse-mixup
    combinations, 16 samples, fewer than ARGS' 6 per device asks for."""
    cfg, ao, do = parse_args(["--algo", algo, *ARGS, "--cold-start-fraction", "0.4", "--inverse-per-device", "4"])
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.run_round(0)
    c = eng.algo.collected
    by_hand = {cid: c.select((c.owner == cid).nonzero().flatten()).wire_bytes() for cid in range(5)}
    assert eng.algo.seed_bytes == by_hand
    assert sorted(by_hand.values())[:2] == [0, 0] and min(v for v in by_hand.values() if v) > 0


def test_privacy_audit_flags_raw_seeds_and_passes_mixtures():
    for algo, leaks in (("fld", True), ("mixfld", False), ("mix2fld", False)):
        _, (r1, _) = run_two_rounds(algo)
        assert r1["seeds_uploaded"] == 20
        assert (r1["seeds_leaking_raw"] == 20) if leaks else (r1["seeds_leaking_raw"] == 0), algo
        if algo != "fld":
            assert torch.isfinite(torch.tensor(r1["sample_privacy_uploaded"]))
        if algo == "mix2fld":
            assert r1["server_samples"] == 30 and "sample_privacy_server" in r1


def test_mix2fld_inverts_seeds_mixed_from_three_samples():
    """General N (Eq. 8): seeds mixing 3 samples, inverted three devices at a time."""
    cfg, ao, do = parse_args(["--algo", "mix2fld", *ARGS, "--seed-mix-n", "3", "--seed-lam", "0.2"])
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.run_round(0)
    s = eng.algo.server_set
    assert len(s) == 30 and torch.equal(s.y.max(1).values, torch.ones(30))  # hard labels
    assert s.source_cid.shape[1] == 9  # 3 parent seeds of 3 raw samples each


@pytest.mark.parametrize("algo,extra", [("fld", []), ("mixfld", []), ("mix2fld", []),
                                        ("mix2fld", ["--seed-pairing", "shared"]),
                                        ("mix2fld", ["--seed-mix-n", "3", "--seed-lam", "0.2"])],
                         ids=["fld", "mixfld", "mix2fld", "mix2fld-shared", "mix2fld-N3"])
def test_the_server_trains_on_seeds_built_from_the_raw_data_and_inverse_mixups_with_the_right_hard_labels(algo, extra):
    """The set the server converts on, built independently from the devices' raw data in
    tests/reference_steps_mix2fld.py (raw seeds; Eq. 6 mixtures under the documented label schedule,
    'balanced' by default or 'shared'; Eqs. 7-8 inverse mixups, lambda_hat = lambda / (2 lambda - 1) for N = 2 and the circulant's
    inverse for N = 3), whose hard labels are checked there against the raw labels behind each
    sample: the algorithm's set has the same inputs and labels, row for row. An inverse mixup that
    labels its outputs wrongly, or weights its seeds wrongly, fails here."""
    from reference_steps_mix2fld import server_samples_by_hand

    cfg, ao, do = parse_args(["--algo", algo, *ARGS, *extra])
    eng = Engine(cfg, ao, do, World(threads=1))
    fit, seen = eng.algo.trainer.fit, []

    def spy(x, targets, *args, **kw):  # what the server's trainer is handed
        seen.append((x.detach().clone(), targets.detach().clone()))
        return fit(x, targets, *args, **kw)

    eng.algo.trainer.fit = spy
    if algo != "fld":  # the label schedule the hand computation follows: the default, or the one asked for
        assert eng.algo.seed_pairing == ("shared" if "shared" in extra else "balanced")
    eng.run_round(0)
    want = server_samples_by_hand(eng)
    assert len(seen) == 1 and len(seen[0][0]) == len(want) == (30 if algo == "mix2fld" else 20)
    gx, gy = seen[0]
    wx = torch.stack([s.x for s in want])
    wy = torch.stack([s.soft for s in want])
    assert float((gx.double() - wx).abs().max()) <= 1e-5, "the server trains on other inputs than the hand-built ones"
    assert torch.allclose(gy.double(), wy, atol=1e-6, rtol=0), "the server trains on other labels than the hand-built ones"
    if algo == "mix2fld":  # hard labels, of several labels, with negative weights in the mix
        assert torch.equal(gy.argmax(1), wy.argmax(1)) and torch.equal(wy.max(1).values, torch.ones(len(wy)))
        assert len(set(wy.argmax(1).tolist())) > 2 and min(min(s.sources.values()) for s in want) < 0


# ----------------------------------------------------------------------------- stopping rule (--stop-epsilon)

def brute_label_change(before, after):
    """max_n |G_n^p - G_n^p-1| / |G_n^p-1|, one row and one entry at a time; a row that was zero
    counts 0 while it stays zero and infinity once it is not (fedhpc.algorithms.fd's reading)."""
    worst = 0.0
    for n in range(before.shape[0]):
        d = math.sqrt(sum((float(a) - float(b)) ** 2 for a, b in zip(after[n], before[n])))
        b = math.sqrt(sum(float(v) ** 2 for v in before[n]))
        worst = max(worst, (0.0 if d == 0 else math.inf) if b == 0 else d / b)
    return worst


def near_one_hot(C=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.eye(C, dtype=torch.float64) * 0.9 + torch.rand(C, C, generator=g, dtype=torch.float64) * 0.01
    return t / t.sum(1, keepdim=True)


def test_label_relative_change_is_the_largest_row_ratio_of_a_brute_force_loop():
    before = near_one_hot()
    g = torch.Generator().manual_seed(1)
    after = (before + 0.03 * torch.rand(10, 10, generator=g, dtype=torch.float64)).abs()
    assert label_relative_change(before, after) == pytest.approx(brute_label_change(before, after), rel=1e-12)
    # rows without a global output: a label nobody holds (zero -> zero) does not block; a label
    # heard of for the first time (zero -> row) is not converged; one whose uploads were lost
    # (row -> zero) changed by 100%
    still = before.clone(); still[4] = 0
    s_after = still.clone(); s_after[0] *= 1.001
    assert label_relative_change(still, s_after) == pytest.approx(brute_label_change(still, s_after), rel=1e-12)
    assert 0 < label_relative_change(still, s_after) < 0.01
    appears = still.clone(); appears[4] = before[4]
    assert label_relative_change(still, appears) == math.inf == brute_label_change(still, appears)
    assert label_relative_change(before, still) == pytest.approx(1.0) == brute_label_change(before, still)
    zero = torch.zeros(10, 10, dtype=torch.float64)
    assert label_relative_change(zero, zero) == 0.0  # never NaN


@pytest.mark.parametrize("algo", ["fd", "fld"])
def test_stop_epsilon_is_not_met_while_one_label_still_moves(algo):
    """Mix2FLD l.95 / Alg. 1 line 2: "< epsilon for all n". A table whose Frobenius ratio is
    below epsilon while one label's row moved by more must not stop the run (it did when the
    engine compared the whole table)."""
    before = near_one_hot()
    moved = before.clone()
    moved[3] += torch.tensor([0.05, -0.05] + [0.0] * 8, dtype=torch.float64)  # one label's row
    eps = 0.05
    whole = float((moved - before).norm() / before.norm())
    assert whole < eps < brute_label_change(before, moved), "the tables must separate the two rules"
    settled = before.clone()
    settled[3] += torch.tensor([0.01, -0.01] + [0.0] * 8, dtype=torch.float64)
    assert brute_label_change(before, settled) < eps
    for table, converges in ((moved, False), (settled, True)):
        cfg, ao, do = parse_args(["--algo", algo, *(ARGS if algo == "fld" else COMMON), "--rounds", "3",
                                  "--stop-epsilon", str(eps)])
        eng = Engine(cfg, ao, do, World(threads=1))
        eng._previous_convergence_state = before.clone()  # the last round's G_out
        aggregate = eng.algo.aggregate

        def aggregate_then_set(global_state, totals, weight_total, rnd, table=table):
            out = aggregate(global_state, totals, weight_total, rnd)
            eng.algo.teacher = (table.clone(), torch.ones(10, dtype=torch.float64))  # this round's G_out
            return out

        eng.algo.aggregate = aggregate_then_set
        m = eng.run_round(0)
        assert m["relative_change"] == pytest.approx(brute_label_change(before, table), rel=1e-9)
        assert m.get("converged", False) is converges, (algo, m["relative_change"])


def test_fd_logs_the_largest_label_change_and_a_resumed_run_logs_the_same(tmp_path):
    """Each round's relative_change is the brute-force largest row ratio of consecutive G_out
    tables; the checkpoint keeps the whole previous table, so a run interrupted after round 2
    and resumed logs what the uninterrupted run logs."""
    from standard_runner import run_case
    from fedhpc.engine import Preempted

    argv = ["--algo", "fd", *COMMON, "--rounds", "4", "--partition", "dirichlet:0.5", "--clients-per-round", "3",
            "--stop-epsilon", "1e-9", "--checkpoint-every", "1"]
    tables = []
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    run_round = eng.run_round

    def spy(t):
        m = run_round(t)
        tables.append(eng.algo.teacher[0].double().clone())
        return m

    eng.run_round = spy
    rows = []
    eng._log = lambda metrics, echo=True: rows.append(dict(metrics))
    eng.run()
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and "relative_change" not in rows[0]
    for t in range(1, 4):
        assert rows[t]["relative_change"] == pytest.approx(brute_label_change(tables[t - 1], tables[t]), rel=1e-9)

    out, uninterrupted = str(tmp_path / "run"), str(tmp_path / "whole")
    run_case(argv + ["--out", uninterrupted], World(threads=1))
    whole = [json.loads(line) for line in open(os.path.join(uninterrupted, "metrics.jsonl"))]
    with pytest.raises(Preempted):
        run_case(argv + ["--out", out], World(threads=1), interrupt_after=2)
    run_case(argv + ["--out", out, "--resume"], World(threads=1))
    resumed = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r.get("relative_change") for r in resumed] == [r.get("relative_change") for r in whole]
    assert [r.get("relative_change") for r in whole][1:] == pytest.approx([r["relative_change"] for r in rows[1:]])


def test_fd_reports_its_devices_models_and_no_global_test_accuracy(tmp_path):
    """FD trains no global model: its global state stays the initial model, so the run reports no
    test accuracy or loss (that model's) and no global model on the local splits, yet logs every
    evaluated round, and its final line leads with the devices' own models. A reference device
    that has not trained yet is evaluated with the (initial) global model."""
    from standard_runner import run_case

    argv = ["--algo", "fd", *COMMON, "--rounds", "3", "--clients-per-round", "2", "--eval-every", "2"]
    eng = Engine(*parse_args(argv), World(threads=1))
    before = eng.evaluate()
    eng.flat.load_(eng.global_state)
    eng.model.eval()
    x, y = eng.data.test_slice(0, eng.data.num_test())
    with torch.no_grad():
        initial = float((eng.model(eng.data.transform(x, False, None)).argmax(-1) == y).double().mean())
    assert before["reference_device_accuracy"] == pytest.approx(initial, abs=1e-12)

    out = str(tmp_path / "run")
    ran, final, _ = run_case(argv + ["--out", out], World(threads=1))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["round"] for r in rows] == [1, 2, 3] and "reference_device_accuracy" not in rows[0]
    rows = rows[1:]  # the evaluated rounds
    for r in rows + [final]:
        assert not {"test_accuracy", "test_loss", "local_test_accuracy_global_model"} & set(r), r.keys()
        assert 0 <= r["reference_device_accuracy"] <= 1 and 0 <= r["local_test_accuracy_mean"] <= 1
    line = ran._final_line(final)
    assert line.startswith(f"final mean accuracy of the devices' own models {final['local_test_accuracy_mean']:.4f} "
                           f"(their local splits) after 3 rounds; fd trains no global model"), line


@pytest.mark.parametrize("epochs", [0, 2])
def test_a_cold_start_fd_device_trains_its_own_model_distilling_from_the_final_outputs(epochs):
    """FD has no global model to hand a device that joins after training: a cold-start device trains
    one of its own from the initial model, --finetune-epochs epochs of Eq. 3 with the last global
    outputs as teacher (the batches of round T, as every adaptation), and is evaluated on its split;
    0 epochs leave the untrained initial model. No global-model column: that is FD's initial model."""
    import torch.nn.functional as F
    from reference_steps import autograd, batch_indices, start_model

    argv = ["--algo", "fd", *COMMON, "--num-clients", "6", "--clients-per-round", "4", "--cold-start-fraction",
            "0.34", "--finetune-epochs", str(epochs), "--beta", "0.5"]
    eng = Engine(*parse_args(argv), World(threads=1))
    for t in range(2):
        eng.run_round(t)
    got = eng._evaluate_cold_start({})
    assert got["cold_start_clients"] == 2 and "cold_start_accuracy_global_model" not in got
    cfg, beta, (g, has) = eng.cfg, eng.algo.options.beta, eng.algo.teacher
    hits, counts = 0, 0
    for cid in eng.cold_start:
        c = eng.data.client(cid)
        m = start_model(eng)
        for epoch in range(epochs):
            for idx in batch_indices(cfg.seed, 2, cid, epoch, c.num_train, cfg.batch_size):
                logits, y = m(c.x[idx].double()), c.y[idx]
                psi = [-(g[y[i]].double() * F.log_softmax(logits[i], -1)).sum() * has[y[i]] for i in range(len(y))]
                grads = autograd(m, F.cross_entropy(logits, y) + beta * sum(psi) / len(y))
                with torch.no_grad():
                    for prm, gr in zip(m.parameters(), grads):
                        prm -= cfg.lr * gr
        x, y = eng.data.client_test_split(cid)
        with torch.no_grad():
            hits += int((m(x.double()).argmax(-1) == y).sum())
        counts += len(y)
    assert got["cold_start_accuracy"] == pytest.approx(hits / counts, abs=1e-12)


# ----------------------------------------------------------------------------- which seeds arrive (--seed-delivery)

# 6 devices, all in every round; one uplink channel shared by 6: 416 bytes per good slot, so a
# round-1 upload (400-byte table + 4 seeds of 64 pixels and 1-2 label bytes) needs 2 good slots
# and a later one 1.
CHANNEL = ["--dataset", "digits", "--model", "mlp", "--num-clients", "6", "--clients-per-round", "6",
           "--lr", "0.1", "--seed", "2", "--threads", "1", "--quiet", "--no-tensorboard", "--client-test-fraction", "0",
           "--channel", "asymmetric", "--channel-opt", "num_channels=1"]
# 8 slots per direction and P_up 12 dBm: round 1's uplinks of devices 0, 2, 3 get through (seed 2)
SOME_LOST = CHANNEL + ["--channel-opt", "t_max_s=0.016", "--channel-opt", "p_up_dbm=12"]
# 1 slot per direction: no round-1 upload fits (2 good slots needed), most later ones do
ALL_LOST = CHANNEL + ["--channel-opt", "t_max_s=0.002"]


def channel_engine(algo, argv, delivery, *extra):
    from reference_steps_mix2fld import FAMILY_ARGV
    # lr and local epochs as RunConfig's (digits' own 0.1 x 2 epochs move the weights ~4x as far,
    # and the 2e-5 agreement below was derived for these)
    cfg, ao, do = parse_args(["--algo", algo, *argv, *FAMILY_ARGV, "--lr", "0.05", "--local-epochs", "1",
                              "--seed-delivery", delivery, *extra])
    return Engine(cfg, ao, do, World(threads=1))


def delivered_by_the_channel(eng, label_ids):
    """Brute force from the channel's own draws: the devices whose round-1 upload (the table plus
    their seeds, counted here from the sizes) has no outage."""
    from fedhpc.server.channel import Channel, ChannelOptions
    cfg = eng.cfg
    ch = Channel(cfg.channel, ChannelOptions(**cfg.channel_options), cfg.seed)
    C, pixels, n_s = eng.data.num_classes, 64, eng.algo.options.seeds_per_device
    payload = C * C * 4 + n_s * (pixels + label_ids)
    return [cid for cid in range(6) if ch.uplink(0, cid, payload, 6).ok]


@pytest.mark.parametrize("algo", ["fld", "mix2fld"])
def test_seed_delivery_channel_uses_exactly_the_seeds_of_the_devices_whose_round1_upload_arrived(algo):
    from reference_steps_mix2fld import fld_round, server_samples_by_hand

    eng = channel_engine(algo, SOME_LOST, "channel")
    arrived = delivered_by_the_channel(eng, 1 if algo == "fld" else 2)
    assert 0 < len(arrived) < 6 and {c % 2 for c in arrived} == {0, 1}, \
        f"settings chosen so that some round-1 uplinks fail, devices of both rotations arrive: {arrived}"
    expected = fld_round(eng, arrived=arrived)  # only their tables and only their seeds
    everyone = fld_round(eng, arrived=sorted(set(arrived) | {next(c for c in range(6) if c not in arrived)}))
    assert float((everyone["global_state"] - expected["global_state"]).abs().max()) > 1e-3, \
        "one more device's seeds and table must change the round, or the check could not fail"
    m = eng.run_round(0)
    assert m["uplink_outages"] == 6 - len(arrived)
    assert eng.algo.seed_deliverers == arrived
    assert m["seeds_uploaded"] == 6 * 4 and m["seeds_delivered"] == 4 * len(arrived)
    assert m["bytes_up_seeds"] == 6 * 4 * (64 + (1 if algo == "fld" else 2))  # sent, lost or not
    # built from the raw data of the delivering devices alone (tests/reference_steps_mix2fld.py)
    want = server_samples_by_hand(eng, arrived)
    if algo == "mix2fld":  # N_I per delivering device, from their seeds only (fewer if they have too few partners)
        assert {cid for s in want for cid, _ in s.sources} <= set(arrived) and 0 < len(want) <= 4 * len(arrived)
        assert m["server_samples"] == len(want)
    got = eng.algo.server_set
    assert len(got) == len(want)
    assert float((got.x.double() - torch.stack([s.x for s in want])).abs().max()) <= 1e-5
    assert torch.allclose(got.y.double(), torch.stack([s.soft for s in want]), atol=1e-6, rtol=0)
    assert set(eng.algo.server_set.source_cid.flatten().tolist()) == set(arrived)
    diff = float((eng.global_state.double() - expected["global_state"]).abs().max())
    assert diff <= 2e-5, f"{algo}: round 1 differs from the hand computation on the delivered seeds by {diff:.2e}"


@pytest.mark.parametrize("algo", ["fld", "mix2fld"])
def test_seed_delivery_channel_with_every_round1_upload_lost_never_converts(algo, recwarn):
    """No seed at the server: the tables of round 2 arrive, but the global model is not trained
    (a warning once, seeds_delivered 0); ``always`` trains on every device's seeds regardless."""
    eng = channel_engine(algo, ALL_LOST, "channel")
    start = eng.global_state.clone()
    m1 = eng.run_round(0)
    assert m1["uplink_outages"] == 6 and m1["seeds_delivered"] == 0 and m1["seeds_uploaded"] == 24
    assert len(eng.algo.server_set) == 0 and eng.algo.seed_deliverers == []
    warned = [w for w in recwarn.list if "no samples for the output-to-model conversion" in str(w.message)]
    assert len(warned) == 1 and "0 of the 6 devices" in str(warned[0].message)
    m2 = eng.run_round(1)
    assert m2["uplink_outages"] < 6 and eng.algo.teacher is not None, "round 2's tables must arrive"
    assert torch.equal(eng.global_state, start)  # no seed, no conversion
    assert m2["seeds_delivered"] == 0 and m2["bytes_up_seeds"] == 0
    assert len([w for w in recwarn.list if "no samples for" in str(w.message)]) == 1  # once

    always = channel_engine(algo, ALL_LOST, "always")
    always.run_round(0)
    assert len(always.algo.server_set) == 24  # 6 devices x N_S (FLD) or N_I (Mix2FLD) = 4
    always.run_round(1)
    assert not torch.equal(always.global_state, start)


@pytest.mark.parametrize("algo", ["fld", "mixfld", "mix2fld"])
def test_seed_delivery_channel_without_outages_is_always(algo):
    """Full participation and a channel that drops nothing: every device's seeds arrive either
    way, and the runs are the same."""
    engines = [channel_engine(algo, COMMON, d) for d in ("always", "channel")]
    metrics = [[e.run_round(t) for t in range(2)] for e in engines]
    assert torch.equal(engines[0].global_state, engines[1].global_state)
    assert torch.equal(engines[0].algo.server_set.x, engines[1].algo.server_set.x)
    for key in ("seeds_uploaded", "seeds_delivered", "bytes_up_seeds", "relative_change"):
        assert [m.get(key) for m in metrics[0]] == [m.get(key) for m in metrics[1]], key


def test_seed_delivery_channel_sends_no_seeds_from_devices_not_sampled_in_round1():
    eng = channel_engine("fld", [*COMMON, "--clients-per-round", "3"], "channel")
    m = eng.run_round(0)
    sampled = eng.algo.seed_senders
    assert len(sampled) == 3 and m["seeds_uploaded"] == m["seeds_delivered"] == 12
    assert m["bytes_up_seeds"] == 12 * 65
    assert sorted(set(eng.algo.server_set.owner.tolist())) == sampled
    eng = channel_engine("fld", [*COMMON, "--clients-per-round", "3"], "always")
    m = eng.run_round(0)
    assert m["seeds_delivered"] == 20 and m["bytes_up_seeds"] == 20 * 65  # all 5 devices' seeds


def test_seed_delivery_channel_resumed_after_round1_equals_uninterrupted(tmp_path):
    """Whose seeds arrived is checkpointed: a run resumed after round 1 rebuilds the same server set."""
    from standard_runner import run_case
    from reference_steps_mix2fld import FAMILY_ARGV
    from fedhpc.engine import Preempted

    argv = ["--algo", "mix2fld", *SOME_LOST, *FAMILY_ARGV, "--seed-delivery", "channel", "--rounds", "3"]
    whole, _, _ = run_case(argv + ["--out", str(tmp_path / "whole")], World(threads=1))
    with pytest.raises(Preempted):
        run_case(argv + ["--out", str(tmp_path / "cut")], World(threads=1), interrupt_after=1)
    resumed, _, _ = run_case(argv + ["--out", str(tmp_path / "cut"), "--resume"], World(threads=1))
    assert resumed.algo.seed_deliverers == whole.algo.seed_deliverers and 0 < len(whole.algo.seed_deliverers) < 6
    assert torch.equal(resumed.global_state, whole.global_state)
    rows = [[json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("whole", "cut")]
    for key in ("seeds_delivered", "server_samples", "sample_privacy_server", "relative_change", "uplink_outages"):
        assert [r.get(key) for r in rows[0]] == [r.get(key) for r in rows[1]], key


def test_seed_delivery_must_be_always_or_channel():
    with pytest.raises(ConfigError, match="--seed-delivery must be one of always, channel"):
        parse_args(["--algo", "mix2fld", *ARGS, "--seed-delivery", "sometimes"])


# ----------------------------------------------------------------------------- next-character data

def test_fd_tables_and_distillation_on_next_character_data_are_loops_over_positions():
    """Text (Shakespeare): every position of a sequence is one output of the label it predicts
    (Eq. 2), and Eq. 3's psi is averaged over positions, as the task loss is."""
    from fedhpc.exchanges import label_outputs

    g = torch.Generator().manual_seed(0)
    B, T, C = 3, 5, 6
    logits = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    y = torch.randint(0, C - 1, (B, T), generator=g)           # label C-1 never occurs
    outs = label_outputs.LabelOutputs(C, "cpu")
    outs.add(logits, y)
    table, present = outs.table()
    sums, counts = torch.zeros(C, C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sums[y[b, t]] += torch.softmax(logits[b, t], -1)
            counts[y[b, t]] += 1
    for n in range(C):
        want = sums[n] / counts[n] if counts[n] else torch.zeros(C, dtype=torch.float64)
        assert torch.allclose(table[n], want, rtol=0, atol=1e-15) and present[n] == (counts[n] > 0)
    teacher = torch.softmax(torch.randn(C, C, dtype=torch.float64, generator=g), -1)
    mask = torch.ones(C, dtype=torch.float64)
    mask[2] = 0                                                # a label without a global output
    got = label_outputs.distillation_loss(logits, teacher[y], mask[y])
    psi = [-(teacher[y[b, t]] * torch.log_softmax(logits[b, t], -1)).sum() * mask[y[b, t]]
           for b in range(B) for t in range(T)]
    assert float(got) == pytest.approx(float(sum(psi) / (B * T)), rel=1e-12)


def test_fd_trains_on_shakespeare_and_the_seed_methods_refuse_it(tmp_path):
    """FD distils per-character outputs on next-character data; FLD, MixFLD and Mix2FLD, whose
    seeds carry one label each, are refused when the engine is built, naming FD."""
    from test_formats import write_tff_shakespeare
    write_tff_shakespeare(str(tmp_path / "shakespeare"))
    text = ["--dataset", "shakespeare", "--data-dir", str(tmp_path), "--model", "lstm_char", "--model-opt",
            "embed_dim=4", "--model-opt", "hidden=8", "--model-opt", "num_layers=1", "--data-opt", "seq_len=8",
            "--partition", "natural", "--num-clients", "3", "--clients-per-round", "3", "--batch-size", "4",
            "--threads", "1", "--quiet", "--no-tensorboard"]
    eng = Engine(*parse_args(["--algo", "fd", *text, "--rounds", "2", "--beta", "0.5"]), World(threads=1))
    for t in range(2):
        eng.run_round(t)
    table, has = eng.algo.teacher
    assert table.shape == (80, 80) and 1 < int(has.sum()) < 80          # the characters the roles use
    assert torch.allclose(table[has > 0].sum(1), torch.ones(int(has.sum()), dtype=table.dtype))
    assert math.isfinite(eng.evaluate()["local_test_accuracy"])
    for algo in ("fld", "mixfld", "mix2fld"):
        with pytest.raises(ConfigError, match=rf"--algo {algo} uploads seed samples that carry one label each .* "
                                              r"shakespeare is next_char data.* Use --algo fd"):
            Engine(*parse_args(["--algo", algo, *text]), World(threads=1))
