"""FedBABU, FedAlt, Ditto and Per-FedAvg on the batched path (fedhpc.batched, --clients-at-once > 1): every client's
model within float rounding of its sequential local update (clients of unequal sizes, 2 epochs,
momentum + weight decay, the MLP and the digits CNN with dropout and BatchNorm), and the parts their
updates freeze bit for bit where they started.

Their updates are more than train_group's one phase of plain steps: FedBABU's head is frozen (not given
to the optimiser, BatchNorm in it in eval mode), FedAlt trains its personal part then its shared part
(each phase a fresh optimiser, the other part frozen, epochs numbered on through both), Ditto steps a
personal model towards the global one before each step of the global model (two stacked models, one
dropout stream per client), Per-FedAvg takes meta-steps on groups of 2 (FO) or 3 (HF) batches that wrap
around each client's own epoch (an inner step of size alpha, the gradient at the adapted weights,
the weights restored; HF's two finite-difference passes on rewound dropout masks).
"""

from __future__ import annotations

import pytest
import torch

from fedhpc.algorithms.base import derive_seed, seed_torch
from fedhpc.batched import GroupTraining, check_batchable, train_in_groups
from fedhpc.round import ClientContext
from test_batched import (TOL, Round0Envelope, assert_close_or_discrete, assert_own_models_equal, make_engine,
                          round_info, run_rounds)
from test_batched_more import BATCHNORM, BOTH

#: options that make each method do all it can: FedAlt's phases of unequal length (the second phase's
#: epochs numbered from 1), Ditto's two personal steps per batch and a proximal pull that matters
PERSONAL = {
    "fedbabu": {},
    "fedalt": {"personal_epochs": 1},
    "ditto": {"lam": 0.5, "personal_steps": 2},
    # HF: the first-order meta-step and the Hessian-vector product's two passes; alpha twice the default
    "per_fedavg": {"variant": "hf", "alpha": 0.02},
}


def personal_model(algo):
    """What a client's upload saves besides the model it trained: Ditto's personal model."""
    return algo.personal_flat.flat.clone() if hasattr(algo, "personal_flat") else None


def sequential_round0(eng):
    """cid -> (trained flat state, loss sum, samples, personal model), the engine's loop body."""
    algo, rnd = eng.algo, round_info(eng, 0)
    out = {}
    for cid in rnd.my_clients:
        seed_torch(derive_seed(eng.cfg.seed, "client", 0, cid), eng.world.device)
        eng.flat.load_(eng.global_state)
        ctx = ClientContext(algo, cid, eng.data.client(cid).training_on(eng.world.device), rnd)
        algo.download(ctx)
        algo.local_update(eng.model, ctx)
        out[cid] = (eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples, personal_model(algo))
    return out


def batched_round0(eng, k=4):
    check_batchable(eng.algo, eng.model, eng.cfg)
    rnd = round_info(eng, 0)
    return {cid: (eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples, personal_model(eng.algo))
            for cid, ctx, _, _ in train_in_groups(eng, rnd, rnd.my_clients, k)}


def lower_rate_for(algo, model):
    """FedAlt on the CNN with dropout and BatchNorm at lr 0.05, momentum 0.9: its personal phase runs
    the frozen convolutions' BatchNorm on their initial statistics, and one client's sequential
    training alone then moves 9.5e-4 when its start moves 1e-7 (the batched run lands exactly there):
    float rounding amplified, not a difference of the paths. At lr 0.01, momentum 0.5: 1e-7 apart."""
    return dict(lr=0.01, momentum=0.5) if (algo, model) == ("fedalt", "dropout+batchnorm") else {}


@pytest.mark.parametrize("model", ["mlp", "dropout+batchnorm"])
@pytest.mark.parametrize("algo", list(PERSONAL))
def test_round_zero_clients_equal_sequential(algo, model):
    kw = {**({} if model == "mlp" else BOTH), **lower_rate_for(algo, model)}
    start = make_engine(algo, PERSONAL[algo], **kw).global_state.clone()
    seq = sequential_round0(make_engine(algo, PERSONAL[algo], **kw))
    bat = batched_round0(make_engine(algo, PERSONAL[algo], **kw))
    assert list(seq) == list(bat), "clients must come back in the sequential order"
    # sequential runs from perturbed initial models, made if another CPU's rounding needs them
    envelope = Round0Envelope(seq, lambda s: sequential_round0(make_engine(algo, PERSONAL[algo], perturb=s, **kw)))
    for cid in seq:
        (w_s, loss_s, n_s, v_s), (w_b, loss_b, n_b, v_b) = seq[cid], bat[cid]
        diff = float((w_s - w_b).abs().max())
        assert_close_or_discrete(diff, TOL, envelope(cid, 0), f"client {cid}'s weights")
        assert n_s == n_b
        if diff <= TOL:  # after a discrete event the losses part too
            assert abs(loss_s - loss_b) <= TOL * max(1.0, abs(loss_s)), cid
        assert float((w_s - start).abs().max()) > 1e-2  # the client trained
        assert (v_s is None) == (v_b is None)
        if v_s is not None:  # Ditto's personal model, as its upload saves it
            assert_close_or_discrete(float((v_s - v_b).abs().max()), TOL, envelope(cid, 3),
                                     f"client {cid}'s personal model")
            assert float((v_s - w_s).abs().max()) > 1e-3  # a model of its own, not the global one


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_per_fedavg_first_order_in_groups_that_do_not_divide(optimizer):
    """FO meta-steps (groups of 2 batches) in groups of 5 + 1 clients, with SGD and with Adam (the outer
    step; the inner one stays plain SGD of size alpha), on the CNN with dropout and BatchNorm."""
    kw = dict(BOTH, optimizer=optimizer, **({"lr": 0.003, "momentum": 0.0} if optimizer == "adam" else {}))
    opts = {"variant": "fo"}
    start = make_engine("per_fedavg", opts, **kw).global_state.clone()
    seq = sequential_round0(make_engine("per_fedavg", opts, **kw))
    bat = batched_round0(make_engine("per_fedavg", opts, **kw), k=5)
    envelope = Round0Envelope(seq, lambda s: sequential_round0(make_engine("per_fedavg", opts, perturb=s, **kw)))
    for cid in seq:
        diff = float((seq[cid][0] - bat[cid][0]).abs().max())
        assert_close_or_discrete(diff, TOL, envelope(cid, 0), f"client {cid}'s weights")
        assert seq[cid][2] == bat[cid][2]
        assert float((seq[cid][0] - start).abs().max()) > 1e-2


@pytest.mark.parametrize("algo", list(PERSONAL))
def test_personal_methods_over_rounds_equal_sequential(algo):
    """Three rounds through Engine.run_round: from round 1 on FedAlt's and Ditto's clients start from
    their own personal part / model in the client-state store; the global model, those stores and the
    round losses match the sequential run (lr 0.01, momentum 0.5, as tests/test_batched_more.py's
    test_personal_methods_over_rounds_equal_sequential explains). FedBABU keeps no client state: its
    personalised models (the final global model fine-tuned per client) are compared instead.

    FedBABU on the CNN with BatchNorm only: with dropout too, its sequential run alone ends round 3
    6e-4 away when its start moves 1e-7 (with BatchNorm alone 5e-7; the batched run 4e-8 from it).
    Per-FedAvg first-order over rounds: HF's finite differences (alpha / 2d = 10 here) amplify rounding,
    its sequential run alone ending round 3 1e-2 away when its start moves by a few ulps (the batched run
    2e-3; round 1: 6e-8); FO's 1.2e-7 (HF is checked client by client in round 0 above)."""
    kw = dict(BATCHNORM if algo == "fedbabu" else BOTH, lr=0.01, momentum=0.5)
    options = {"variant": "fo"} if algo == "per_fedavg" else PERSONAL[algo]
    seq, m_seq = run_rounds(1, algo, options, rounds=3, **kw)
    bat, m_bat = run_rounds(4, algo, options, rounds=3, **kw)
    assert float((seq.global_state - bat.global_state).abs().max()) <= 3 * TOL
    for a, b in zip(m_seq, m_bat):
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
    if algo == "fedbabu":
        seq.algo.final_evaluation = bat.algo.final_evaluation = True
    assert assert_own_models_equal(seq, bat) >= 6  # most clients trained, some twice: the check covers their own states


def _columns(eng, layers):
    """The flat state's columns (parameters and BatchNorm statistics) of ``layers``."""
    cols = torch.zeros(eng.flat.numel, dtype=torch.bool)
    for a, b in eng.algo.layer_map.ranges(layers):
        cols[a:b] = True
    return cols


def test_fedbabu_head_stays_where_it_started():
    """The frozen layers (here the first convolution block with its BatchNorm, and the head) bit for
    bit their initial values after batched training with momentum and weight decay: no gradient step,
    no decay, no running statistic updated. The body moved."""
    eng = make_engine("fedbabu", {"head_layers": "conv1,head"}, **BOTH)
    frozen = _columns(eng, eng.algo.head.layers)
    start = eng.global_state.clone()
    for cid, (w, _, _, _) in batched_round0(eng).items():
        assert torch.equal(w[frozen], start[frozen]), cid
        assert float((w[~frozen] - start[~frozen]).abs().max()) > 1e-2, cid


def test_fedalt_phases_train_one_part_each_personal_first(monkeypatch):
    """The batched update's first phase moves the personal part only (the shared part, BatchNorm
    statistics included, bit for bit), its second the shared part only, from where the first ended."""
    phases = []
    train = GroupTraining.train

    def recorded(self, states, *args, **kw):
        out = train(self, states, *args, **kw)
        phases.append((states.clone(), out.clone()))
        return out

    monkeypatch.setattr(GroupTraining, "train", recorded)
    eng = make_engine("fedalt", PERSONAL["fedalt"], **BOTH, lr=0.01, momentum=0.5)
    personal = _columns(eng, eng.algo.personal.layers)
    assert eng.algo.shared.layers == [0, 1] and eng.flat.numel > eng.flat.num_params  # convolutions + BatchNorm
    batched_round0(eng)
    assert len(phases) == 4  # two groups (6 clients by 4), two phases each
    for (before1, after1), (before2, after2) in (phases[0:2], phases[2:4]):
        assert torch.equal(before2, after1)
        assert torch.equal(after1[:, ~personal], before1[:, ~personal])
        assert float((after1[:, personal] - before1[:, personal]).abs().max()) > 1e-2
        assert torch.equal(after2[:, personal], before2[:, personal])
        assert float((after2[:, ~personal] - before2[:, ~personal]).abs().max()) > 1e-2


def test_ditto_diverging_personal_model_still_fails_the_round():
    """lam * lr >> 2 makes the proximal term diverge: as in the sequential path, every client's
    training loss is NaN (the engine's non-finite guard then fails the round), while a finite run
    reports the global model's loss alone (test_round_zero_clients_equal_sequential)."""
    opts = {"lam": 1e4}
    for clients in (sequential_round0(make_engine("ditto", opts)), batched_round0(make_engine("ditto", opts))):
        assert all(loss != loss for _, loss, _, _ in clients.values())
