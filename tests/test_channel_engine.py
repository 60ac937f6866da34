"""The channel model inside the engine: payloads from the ledger, stragglers, downlink outages,
the simulated clock, Mix2FLD's stopping rule, and rank independence with a channel."""

import json
import os

import pytest
import torch

from conftest import FAST, final_weights, launch, max_diff

from fedhpc.algorithms import ClientContext, RoundInfo
from fedhpc.config import parse_args
from fedhpc.engine import Engine, sample_clients
from fedhpc.server.channel import Channel, ChannelOptions
from fedhpc.world import World

BASE = ["--dataset", "digits", "--model", "mlp", "--num-clients", "6", "--clients-per-round", "4",
        "--rounds", "2", "--lr", "0.1", "--seed", "2", "--threads", "1", "--quiet", "--no-tensorboard",
        "--client-test-fraction", "0"]


def engine(*argv):
    cfg, ao, do = parse_args([*BASE, *argv])
    return Engine(cfg, ao, do, World(threads=1))


def test_outages_and_clock_equal_the_channel_called_directly():
    eng = engine("--channel", "asymmetric", "--channel-opt", "p_up_dbm=30", "--channel-opt", "p_down_dbm=10")
    m = eng.run_round(0)
    ch = Channel("asymmetric", ChannelOptions(p_up_dbm=30, p_down_dbm=10), 2)
    sampled = sample_clients(2, 0, 6, 4)
    model_bytes = eng.flat.numel * 4
    ups = [ch.uplink(0, c, model_bytes, 4) for c in sampled]
    downs = [ch.downlink(0, c, model_bytes) for c in sampled]
    assert m["uplink_outages"] == sum(not u.ok for u in ups)
    assert m["downlink_outages"] == sum(not d.ok for d in downs)
    assert m["comm_seconds"] == pytest.approx(max(u.seconds for u in ups) + max(d.seconds for d in downs))
    assert 0 < m["uplink_outages"] + m["downlink_outages"], "settings chosen so that some links fail"
    assert m["sim_seconds_total"] >= m["comm_seconds"]


def test_a_round_whose_uploads_all_fail_keeps_the_global_model():
    eng = engine("--channel", "asymmetric", "--channel-opt", "p_up_dbm=-40")
    before = eng.global_state.clone()
    m = eng.run_round(0)
    assert m["uplink_outages"] == 4
    assert torch.equal(eng.global_state, before)
    assert m["train_loss"] > 0  # the devices did train: only their uploads were lost
    m = eng.run_round(1)
    assert "relative_change" not in m  # nothing arrived: that is not convergence


@pytest.mark.parametrize("argv", [["--algo", "fedavg", "--server-momentum", "0.9"],
                                  ["--algo", "fld", "--server-steps", "3", "--seeds-per-device", "4"]])
def test_a_round_after_one_that_arrived_keeps_the_model_when_nothing_arrives(argv):
    """Server state from an earlier round (FedAvgM's velocity, FLD's last G_out) must not move the
    model in a round whose uploads were all lost: before, momentum stepped it again and FLD ran
    K_s more server steps on the old table."""
    eng = engine(*argv)
    start = eng.global_state.clone()
    eng.run_round(0)
    assert not torch.equal(eng.global_state, start)
    totals = {name: torch.zeros(spec.numel, dtype=torch.float64) for name, (_, spec) in eng.uploads.items()}
    rnd = RoundInfo(1, [], [], 0.1)
    kept = eng.algo.aggregate(eng.global_state, totals, 0.0, rnd)
    assert torch.equal(kept, eng.global_state)


def test_a_downlink_outage_leaves_the_device_on_its_own_model():
    """Round 1: uplinks get through, every downlink fails, so each device keeps its local model;
    round 2 must train each sampled device from that model, not from the new global one."""
    argv = ("--channel", "symmetric", "--channel-opt", "p_down_dbm=-40", "--num-clients", "2",
            "--clients-per-round", "2")
    eng = engine(*argv)
    m0 = eng.run_round(0)
    assert m0["uplink_outages"] == 0 and m0["downlink_outages"] == 2
    kept = {cid: eng.client_state.get_slot(cid, "device_model").clone() for cid in (0, 1)}
    assert not torch.equal(kept[0], eng.global_state)
    # round 2 by hand: each device trains from what it kept, the server averages by n_k
    rnd = RoundInfo(1, [0, 1], [0, 1], eng.cfg.lr)
    eng.algo.global_state = eng.global_state
    models, weights = [], []
    from fedhpc.algorithms.base import derive_seed, seed_torch
    for cid in (0, 1):
        seed_torch(derive_seed(2, "client", 1, cid))
        eng.flat.load_(kept[cid])
        ctx = ClientContext(eng.algo, cid, eng.data.client(cid), rnd)
        eng.algo.local_update(eng.model, ctx)
        models.append(eng.flat.flat.clone().double())
        weights.append(eng.data.client(cid).num_train)
    expected = sum(w * x for w, x in zip(weights, models)) / sum(weights)
    eng.run_round(1)
    assert torch.allclose(eng.global_state.double(), expected, atol=1e-6)


@pytest.mark.parametrize("model", [[], ["--model", "cnn", "--model-opt", "width=4", "--model-opt", "norm=batch"]],
                         ids=["mlp", "batchnorm"])
def test_stop_epsilon_ends_the_run_on_the_relative_change_of_the_global_state(tmp_path, model):
    """|w_2 - w_1| / |w_1| over the model's parameters; BatchNorm's running statistics, which
    are in the flat state but not weights, stay out of it."""
    out = str(tmp_path / "run")
    cfg, ao, do = parse_args([*BASE, "--rounds", "6", "--stop-epsilon", "10", "--out", out, *model])
    eng = Engine(cfg, ao, do, World(threads=1))
    states = []
    run_round = eng.run_round

    def spy(t):
        states.append(eng.global_state.clone())
        return run_round(t)

    eng.run_round = spy
    final = eng.run()
    assert final["round"] == 2  # the first round with a previous state to compare with
    params = sum(p.numel() for p in eng.model.parameters())
    assert (params < eng.flat.numel) == bool(model), "the BatchNorm case needs buffers in the flat state"
    # parameters come first in the flat layout (named_parameters, then named_buffers)
    g1, g2 = states[1][:params].double(), eng.global_state[:params].double()
    assert final["relative_change"] == pytest.approx(float((g2 - g1).norm() / g1.norm()), rel=1e-9)
    # a checkpoint written when the whole flat state was compared resumes without a comparison
    eng._previous_convergence_state = torch.ones(eng.flat.numel + (0 if model else 1), dtype=torch.float64)
    assert eng._relative_change() is None
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["round"] for r in rows] == [1, 2]
    assert os.path.exists(os.path.join(out, "final_model.pt"))


def run_on_one_and_two_ranks(args, tmp_path):
    """The output folders of the same run on 1 and on 2 MPI ranks."""
    outs = []
    for ranks in (1, 2):
        out = str(tmp_path / f"r{ranks}")
        p = launch(args + ["--out", out], ranks=ranks)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(out)
    return outs


def test_mix2fld_under_the_channel_gives_the_same_run_on_one_and_two_ranks(tmp_path):
    args = FAST + ["--algo", "mix2fld", "--channel", "asymmetric", "--server-steps", "20",
                   "--seeds-per-device", "4", "--inverse-per-device", "4", "--client-test-fraction", "0.2",
                   "--num-clients", "6", "--clients-per-round", "6"]
    outs = run_on_one_and_two_ranks(args, tmp_path)
    assert max_diff(final_weights(outs[0]), final_weights(outs[1])) <= 1e-5
    rows = [[json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))] for o in outs]
    for key in ("uplink_outages", "downlink_outages", "reference_device_accuracy", "local_test_accuracy",
                "sample_privacy_server", "bytes_up_seeds"):
        assert [r[key] for r in rows[0]] == pytest.approx([r[key] for r in rows[1]], abs=1e-9), key


def test_mix2fld_with_seeds_lost_to_the_channel_gives_the_same_run_on_one_and_two_ranks(tmp_path):
    """--seed-delivery channel: whose round-1 upload (and seeds) arrived comes from the round's
    sum, so the server set, and so the run, is the same on any number of ranks. One shared uplink
    channel and 8 slots per direction at P_up 12 dBm: some round-1 uploads (2 good slots) fail."""
    args = FAST + ["--algo", "mix2fld", "--channel", "asymmetric", "--server-steps", "20",
                   "--seeds-per-device", "4", "--inverse-per-device", "4", "--client-test-fraction", "0.2",
                   "--num-clients", "6", "--clients-per-round", "6", "--seed", "2", "--seed-delivery", "channel",
                   "--channel-opt", "num_channels=1", "--channel-opt", "t_max_s=0.016", "--channel-opt", "p_up_dbm=12"]
    outs = run_on_one_and_two_ranks(args, tmp_path)
    rows = [[json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))] for o in outs]
    assert 0 < rows[0][0]["seeds_delivered"] < rows[0][0]["seeds_uploaded"], "some seeds must be lost"
    assert rows[0][0]["server_samples"] > 0
    assert max_diff(final_weights(outs[0]), final_weights(outs[1])) == 0  # bit for bit
    for key in ("uplink_outages", "downlink_outages", "seeds_delivered", "server_samples", "sample_privacy_server",
                "relative_change", "reference_device_accuracy", "local_test_accuracy"):
        assert [r.get(key) for r in rows[0]] == pytest.approx([r.get(key) for r in rows[1]], abs=1e-9), key
