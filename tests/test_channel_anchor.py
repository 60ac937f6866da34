"""Under a channel model, a device whose last downlink failed starts the round from the model it
kept (``Algorithm.restore_kept_model``): that model, not the global one it never received, is
the anchor of its local update. FedProx's proximal term (and the "+FedProx" variants' through
``add_proximal_term``), MOON's positive pair and the batched path's per-client proximal terms
(``fedhpc.batched.proximal_terms``) all use it.

``--channel-opt p_down_dbm=-40``: uplinks get through, every downlink fails, so every device
sampled in round 1 keeps its own trained model and starts round 2 from it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedhpc.algorithms import ClientContext, RoundInfo
from fedhpc.algorithms.base import derive_seed, seed_torch
from fedhpc.batched import ClientGroup, check_batchable, stacked_params, train_in_groups, vmap_forward
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World
from test_batched import round_info  # what Engine.run_round does before its client loop

BASE = ["--dataset", "digits", "--model", "mlp", "--lr", "0.1", "--seed", "2", "--threads", "1", "--quiet",
        "--no-tensorboard", "--client-test-fraction", "0", "--channel", "symmetric",
        "--channel-opt", "p_down_dbm=-40"]
TOL = 1e-5  # float32: the batched kernels sum in another order than the sequential ones


def engine(*argv):
    cfg, ao, do = parse_args([*BASE, *argv])
    return Engine(cfg, ao, do, World(threads=1))


def after_lost_broadcast(*argv):
    """An engine after round 1, in which every sampled device missed the broadcast: cid -> the
    model each kept (a copy), which differs from the new global model."""
    eng = engine(*argv)
    m0 = eng.run_round(0)
    assert m0["uplink_outages"] == 0 and m0["downlink_outages"] == eng.cfg.clients_per_round
    kept = {cid: state.clone() for cid in range(eng.data.num_clients)
            if (state := eng.client_state.get_slot(cid, "device_model")) is not None}
    assert len(kept) == eng.cfg.clients_per_round
    for state in kept.values():
        assert not torch.equal(state, eng.global_state)
    return eng, kept


def download(eng, rnd, cid):
    """The engine's per-client start: the global model in ``flat``, then the algorithm's download."""
    seed_torch(derive_seed(eng.cfg.seed, "client", rnd.index, cid), eng.world.device)
    eng.flat.load_(eng.global_state)
    ctx = ClientContext(eng.algo, cid, eng.data.client(cid), rnd)
    eng.algo.download(ctx)
    return ctx


# ----------------------------------------------------------------------------- FedProx, sequential

def test_fedprox_is_anchored_at_the_model_a_device_kept():
    """Round 2: at the restored start the proximal term and its gradient are exactly 0, and one
    local step is plain SGD on the cross-entropy around the kept model (checked by hand)."""
    mu = 1.0
    # one batch per epoch (full batch, no momentum or decay): round 1 trains 5 steps, so the kept
    # models lie well away from the global one; round 2 below takes a single step
    eng, kept = after_lost_broadcast("--algo", "fedprox", "--mu", str(mu), "--num-clients", "2",
                                     "--clients-per-round", "2", "--batch-size", "4096", "--local-epochs", "5",
                                     "--lr", "0.5")
    algo, model, n = eng.algo, eng.model, eng.flat.num_params
    rnd = round_info(eng, 1)
    for cid in (0, 1):
        ctx = download(eng, rnd, cid)
        assert torch.equal(eng.flat.flat, kept[cid]), "the device starts from the model it kept"
        # the setting means something only if the kept model's distance to the global one is felt
        assert 0.5 * mu * float((kept[cid][:n] - eng.global_state[:n]).pow(2).sum()) > 1e-3

        x, y = next(ctx.batches(0))
        params = [p for p in model.parameters() if p.requires_grad]
        total = algo.loss(model, x, y, ctx)
        ce = F.cross_entropy(model(x), y)
        assert float((total - ce).detach()) == 0.0, "proximal term at the device's own start"
        g_total = torch.autograd.grad(total, params)
        g_ce = torch.autograd.grad(ce, params)
        for a, b in zip(g_total, g_ce):
            assert torch.equal(a, b), "the proximal term's gradient at the start is 0"

        # by hand: w1 = w_kept - lr * grad CE(w_kept), on a separate copy of the network
        net = copy.deepcopy(model)
        net.load_state_dict(eng.flat.state_dict_from(kept[cid]))
        hand_params = list(net.parameters())
        loss = F.cross_entropy(net(x), y)
        grads = torch.autograd.grad(loss, hand_params)
        want = torch.cat([(p - ctx.lr * g).detach().reshape(-1) for p, g in zip(hand_params, grads)])

        algo.local_update(model, ctx, epochs=1)
        assert ctx.samples == y.shape[0], "one step on the whole local set"
        got = eng.flat.flat[:n]
        assert float((got - want).abs().max()) <= 1e-6
        # the check means something: the global model as anchor would have moved the step by
        # lr * mu * (kept - global)
        assert float((ctx.lr * mu * (kept[cid][:n] - eng.global_state[:n])).abs().max()) > 1e-4


# ----------------------------------------------------------------------------- MOON

def test_moon_contrasts_a_device_that_kept_its_model_with_that_model():
    """The frozen "global" network of MOON's positive pair holds the model the device kept; for
    the next device, which did receive the broadcast, the round's global model again."""
    eng, kept = after_lost_broadcast("--algo", "moon", "--mu", "1.0", "--model", "resnet_digits",
                                     "--model-opt", "width=4", "--model-opt", "projection_dim=8",
                                     "--num-clients", "3", "--clients-per-round", "2", "--batch-size", "64")
    algo = eng.algo
    fresh = [cid for cid in range(3) if cid not in kept]
    assert len(fresh) == 1
    rnd = RoundInfo(1, [*kept, *fresh], [*kept, *fresh], eng.cfg.lr)
    eng.algo.global_state = eng.global_state
    algo.round_begin(rnd)
    frozen_global = algo.frozen["global"][1].flat
    assert torch.equal(frozen_global, eng.global_state)
    for cid in (*kept, *fresh):
        ctx = download(eng, rnd, cid)
        want = kept.get(cid, eng.global_state)
        assert torch.equal(eng.flat.flat, want)
        assert torch.equal(frozen_global, want), f"client {cid}: frozen global is not its start model"
        assert ctx.extra["has_previous"] == (cid in kept)


# ----------------------------------------------------------------------------- batched == sequential

BATCHED = ("--algo", "fedprox", "--mu", "1.0", "--num-clients", "8", "--clients-per-round", "6",
           "--partition", "dirichlet:0.5", "--batch-size", "16", "--momentum", "0.9", "--weight-decay", "1e-3",
           "--local-epochs", "2", "--lr", "0.05", "--seed", "3")


def test_batched_fedprox_uses_each_devices_own_anchor():
    """Round 2, with devices that kept their models and devices that received the global one in
    the same groups: every client's batched proximal term is 0 at its own start, and each
    client's trained model equals the sequential path's."""
    seq_eng, kept = after_lost_broadcast(*BATCHED)
    bat_eng, kept_b = after_lost_broadcast(*BATCHED)  # the same run: same states
    assert torch.equal(seq_eng.global_state, bat_eng.global_state)
    check_batchable(bat_eng.algo, bat_eng.model, bat_eng.cfg)

    # sequential: the engine's loop body, one client at a time
    rnd = round_info(seq_eng, 1)
    mixed = [cid in kept for cid in rnd.my_clients]
    assert any(mixed) and not all(mixed), "the check needs both kinds of start in the round"
    start = seq_eng.global_state.clone()
    seq = {}
    for cid in rnd.my_clients:
        ctx = download(seq_eng, rnd, cid)
        seq_eng.algo.local_update(seq_eng.model, ctx)
        seq[cid] = (seq_eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples)

    # batched: groups of 4 and 2
    rnd_b = round_info(bat_eng, 1)
    bat, ctxs = {}, []
    for cid, ctx, _, _ in train_in_groups(bat_eng, rnd_b, rnd_b.my_clients, 4):
        bat[cid] = (bat_eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples)
        ctxs.append(ctx)

    # the batched proximal terms at the clients' own starts (their downloads done above): all 0
    starts = torch.stack([kept_b.get(cid, bat_eng.global_state) for cid in rnd_b.my_clients])
    params = stacked_params(bat_eng.flat, starts.clone())
    k = len(ctxs)
    group = ClientGroup(vmap_forward(bat_eng.model, params), params, ctxs, [True] * k, [4] * k, bat_eng.flat)
    xs = torch.stack([c.data.x[:4] for c in ctxs])
    ys = torch.stack([c.data.y[:4] for c in ctxs])
    total = bat_eng.algo.batched_loss(group, xs, ys, torch.full((k, 4), 0.25)).detach()
    logits = group.forward(xs).detach()
    ce = torch.stack([F.cross_entropy(logits[i], ys[i]) for i in range(k)])
    assert torch.allclose(total, ce, atol=1e-6, rtol=0), (total - ce).tolist()

    assert list(seq) == list(bat)
    for cid in seq:
        diff = float((seq[cid][0] - bat[cid][0]).abs().max())
        assert diff <= TOL, f"client {cid} (kept: {cid in kept}): batched differs from sequential by {diff:.2e}"
        assert seq[cid][2] == bat[cid][2]
        assert abs(seq[cid][1] - bat[cid][1]) <= TOL * max(1.0, abs(seq[cid][1]))
        assert float((seq[cid][0] - start).abs().max()) > 1e-2  # it trained


@pytest.mark.parametrize("algo", [(), ("--algo", "localmix", "--prox-mu", "1.0"),
                                  ("--algo", "naivemix", "--prox-mu", "1.0")])
def test_engine_rounds_with_clients_at_once_equal_sequential_for_fedprox_with_a_channel(algo):
    """Through Engine.run_round: three rounds of FedProx (and of the "+FedProx" mixup variants,
    whose batched losses build their own proximal terms) with every downlink lost, one client at
    a time and four at once, give the same global model and metrics."""
    runs = {}
    for k in (1, 4):
        eng = engine(*(algo + BATCHED[4:] if algo else BATCHED), "--clients-at-once", str(k))
        runs[k] = (eng, [eng.run_round(t) for t in range(3)])
    (seq, m_seq), (bat, m_bat) = runs[1], runs[4]
    for a, b in zip(m_seq, m_bat):
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
        for key in ("uplink_outages", "downlink_outages", "bytes_up", "bytes_down"):
            assert a[key] == b[key], key
    assert float((seq.global_state - bat.global_state).abs().max()) <= 3 * TOL


# ----------------------------------------------------------------------------- personalised methods

def test_ditto_pulls_a_device_that_kept_its_model_towards_that_model(monkeypatch):
    eng, kept = after_lost_broadcast("--algo", "ditto", "--num-clients", "2", "--clients-per-round", "2",
                                     "--lam", "1.0")
    rnd = round_info(eng, 1)
    seen = []
    real = eng.algo.personal_step
    monkeypatch.setattr(eng.algo, "personal_step",
                        lambda x, y, opt, anchor: (seen.append([a.clone() for a in anchor]), real(x, y, opt, anchor))[1])
    for cid in (0, 1):
        ctx = download(eng, rnd, cid)
        seen.clear()
        eng.algo.local_update(eng.model, ctx)
        want = eng.flat.param_views(kept[cid])
        assert seen and all(torch.equal(a, w) for a, w in zip(seen[0], want)), "w^t as the device holds it"


@pytest.mark.parametrize("algo", ["fedper", "fedbabu", "per_fedavg"])
def test_split_and_fine_tuned_methods_evaluate_from_the_model_a_device_kept(algo):
    """A device that missed the broadcast holds its own shared layers: FedPer's evaluated model is
    that model (its personal part the stored one, which equals it), FedBABU's off the fine-tuning
    rounds is it too, and Per-FedAvg's adaptation starts from it."""
    eng, kept = after_lost_broadcast("--algo", algo, "--num-clients", "3", "--clients-per-round", "2",
                                     "--client-test-fraction", "0.2")
    for cid, state in kept.items():
        if algo != "per_fedavg":  # which adapts from it (the start is checked below)
            assert torch.equal(eng.algo.client_model(cid), state), (algo, cid)
        start = eng.algo.personalise_for_evaluation(cid, lambda model, ctx: None)
        assert torch.equal(start, state), (algo, cid)
    fresh = next(cid for cid in range(3) if cid not in kept)
    start = eng.algo.personalise_for_evaluation(fresh, lambda model, ctx: None)
    assert torch.equal(start, eng.global_state.to(start.dtype)), algo
