"""Batched clients (fedhpc.batched) for the FedAlign study's methods: MOON and FedAlign train K
clients at once within float rounding of the sequential path, client by client (clients of unequal
sizes, 2 epochs, momentum + weight decay, a narrow residual network with BatchNorm); so do
StochDepth, each client dropping its own blocks, and GradAug, each client's sub-networks on its own;
the one-shot methods are refused with the reason. (Mixup: tests/test_batched_more.py.)

MOON's contrastive term needs a previous model, which a client has only from its second round on:
the client-by-client check therefore runs round 1 after a sequential round 0, with clients that
have a previous model and clients that have none in the same groups.
"""

from __future__ import annotations

import pytest

from fedhpc.batched import check_batchable
from fedhpc.errors import ConfigError
from test_batched import (TOL, assert_close_or_discrete, assert_rounds_equal, assert_same_clients, batched_clients,
                          make_engine, round_info, rounds_envelope, run_rounds, sequential_clients)

#: Both at lr 0.01, momentum 0.5 (as tests/test_batched_more.py's residual network): at test_batched.py's
#: lr 0.05, momentum 0.9 this network amplifies rounding. FedAlign's power iterations in the sequential
#: path alone (a start moved by 1e-7 ends a client's round 1e-4 away; the batched path 3e-5), and from
#: the state round 0 leaves, BatchNorm statistics reduced in another order, on CE alone (a round-1 client
#: of MOON's run with mu 0, i.e. FedAvg's update, ends 9e-3 from the sequential one; 4e-7 at lr 0.01).
SLOW = dict(lr=0.01, momentum=0.5)
#: mu not 1, so that a loss without it differs
MOON_OPTIONS = {"mu": 0.5}
#: MOON's model as its tests build it (tests/test_fedalign.py): resnet_digits, width 4, a projection head
MOON = dict(model="resnet_digits", model_options={"width": 4, "projection_dim": 8}, **SLOW)
#: FedAlign's: the same network without the head, with dropout before the classifier (per-client masks)
FEDALIGN = dict(model="resnet_digits", model_options={"width": 4, "dropout": 0.3}, **SLOW)
#: FedAlign with the launcher's default (the authors' rescaling) and Eq. 5 as printed with the sliced input
FEDALIGN_OPTIONS = {"rescaled": {"lip_rescale": True},
                    "printed": {"lip_rescale": False, "mu": 0.01, "student_input": "sliced"}}


def same_as_sequential(algo, options, t=0, k=4, rerun=False, **kw):
    """Round ``t``'s clients, sequential and batched, after ``t`` sequential rounds in each engine.
    ``rerun``: a client beyond TOL is checked against perturbed sequential runs (round 0 only; see
    assert_close_or_discrete)."""
    engines = [make_engine(algo, options, **kw) for _ in range(2)]
    for eng in engines:
        for r in range(t):
            eng.run_round(r)
    start = engines[0].global_state.clone()
    seq = sequential_clients(engines[0], t)
    bat = batched_clients(engines[1], t, k)
    again = (lambda s: sequential_clients(make_engine(algo, options, perturb=s, **kw), 0)) if rerun and t == 0 else None
    assert_same_clients(seq, bat, start, rerun=again)
    return engines


@pytest.mark.parametrize("variant", list(FEDALIGN_OPTIONS))
def test_fedalign_clients_equal_sequential(variant):
    """Round 0 client by client: the full forward grouped, each client's slimmed last stage on its own
    real rows and weights, L_Lip its mean over them."""
    same_as_sequential("fedalign", FEDALIGN_OPTIONS[variant], **FEDALIGN)


def test_moon_clients_with_and_without_a_previous_model_equal_sequential():
    """Round 1 after a sequential round 0: in each group, clients contrasting with their own previous
    model and clients without one (CE alone), each with its own z_prev."""
    seq_eng, bat_eng = same_as_sequential("moon", MOON_OPTIONS, t=1, **MOON)
    rnd = round_info(make_engine("moon", MOON_OPTIONS, **MOON), 1)
    had = [seq_eng.client_state.get_slot(cid, "algo") is not None for cid in rnd.my_clients]
    assert any(had[:4]) and not all(had[:4]), "the first group must mix clients with and without a previous model"


def test_moon_round_0_equals_sequential_in_groups_that_do_not_divide():
    """Round 0 (no previous models yet: CE alone), 6 clients in groups of 5 and 1."""
    same_as_sequential("moon", MOON_OPTIONS, k=5, **MOON)


@pytest.mark.parametrize("algo", ["moon", "fedalign"])
def test_three_rounds_through_the_engine_equal_sequential(algo):
    """Engine.run_round with --clients-at-once 4 against 1: the global model, the round losses and,
    for MOON, every client's stored previous model (what it contrasts with from round 1 on).
    """
    options, kw = (MOON_OPTIONS, MOON) if algo == "moon" else (FEDALIGN_OPTIONS["rescaled"], FEDALIGN)
    seq, m_seq = run_rounds(1, algo, options, rounds=3, **kw)
    bat, m_bat = run_rounds(4, algo, options, rounds=3, **kw)
    env = rounds_envelope(seq, algo, options, **kw)  # another CPU's rounding: see assert_close_or_discrete
    assert_rounds_equal(seq, bat, m_seq, m_bat, env)
    assert float((seq.global_state - make_engine(algo, options, **kw).global_state).abs().max()) > 1e-2
    if algo == "moon":
        stored = 0
        for cid in range(seq.data.num_clients):
            a, b = seq.client_state.get_slot(cid, "algo"), bat.client_state.get_slot(cid, "algo")
            assert (a is None) == (b is None), cid
            if a is not None:
                stored += 1
                assert_close_or_discrete(float((a.float() - b.float()).abs().max()), 3 * TOL,
                                         env(lambda e, c=cid: e.client_state.get_slot(c, "algo")),
                                         f"client {cid}'s stored previous model")
        assert stored >= 6


def test_moon_with_lost_broadcasts_contrasts_each_device_with_the_model_it_kept():
    """Under a channel model whose downlinks fail, devices start (and take their positive pair) from
    the models they kept, each its own in a batched group: three rounds equal the sequential ones."""
    kw = dict(MOON, channel="symmetric",
              channel_options={"distance_m": 1800, "t_max_s": 0.008, "num_channels": 12})
    seq, m_seq = run_rounds(1, "moon", MOON_OPTIONS, rounds=3, **kw)
    bat, m_bat = run_rounds(4, "moon", MOON_OPTIONS, rounds=3, **kw)
    assert sum(m["downlink_outages"] for m in m_seq[:-1]) > 0, "the check needs devices that kept their model"
    for a, b in zip(m_seq, m_bat):
        assert a["downlink_outages"] == b["downlink_outages"]
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
    assert float((seq.global_state - bat.global_state).abs().max()) <= 3 * TOL


#: StochDepth on the narrow ResNet (3 blocks) with BatchNorm, keep probabilities 0.8, 0.6, 0.4: most
#: steps some client drops some block and another keeps it
STOCHDEPTH = dict(model="resnet_digits", model_options={"width": 4}, **SLOW)
STOCHDEPTH_OPTIONS = {"final_keep_prob": 0.4}


def test_stochdepth_clients_equal_sequential():
    """Round 0 client by client: each client's blocks dropped by its own draws; a dropped block's
    branch takes no step (weight decay and momentum would move it) and keeps its running statistics."""
    same_as_sequential("stochdepth", STOCHDEPTH_OPTIONS, **STOCHDEPTH)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stochdepth_in_groups_that_do_not_divide_and_with_adam(optimizer):
    """Groups of 5 + 1; with Adam, a parameter counts its own steps (torch skips it, count and all,
    where a dropped block leaves it without gradient), so its bias corrections are those of its steps.
    Adam without weight decay: with the file's 1e-3 a ulp-sized move of the start moves the sequential
    clients themselves by up to 6e-3 (measured, 4 perturbed runs), where without it both paths agree
    to 4e-7 and a step count per client instead of per parameter moves a client by 1.7e-2."""
    kw = dict(STOCHDEPTH, optimizer=optimizer)
    if optimizer == "adam":
        kw.update(lr=0.003, momentum=0.0, weight_decay=0.0)
    same_as_sequential("stochdepth", STOCHDEPTH_OPTIONS, k=5, **kw)


def test_stochdepth_groups_drop_blocks_client_by_client(monkeypatch):
    """What the equality above relies on: steps where some clients of a group drop a block (its branch
    skipped for them) and the others keep it, so that a drop applied to the whole group would show."""
    from fedhpc.batched import ClientGroup

    skips = []  # (step's group, client, the branch's parameter columns)
    original = ClientGroup.skip

    def watch(self, clients, columns):
        skips.extend((self, k, columns) for k in clients)  # the group kept alive: its id names its step
        return original(self, clients, columns)
    monkeypatch.setattr(ClientGroup, "skip", watch)
    eng = make_engine("stochdepth", STOCHDEPTH_OPTIONS, **STOCHDEPTH)
    batched_clients(eng, 0, 4)
    by_step = {}
    for step, k, columns in skips:  # a block's columns are one cached tensor: its id names the block
        by_step.setdefault((id(step), id(columns)), set()).add(k)
    assert any(0 < len(clients) < 4 for clients in by_step.values())
    projections = [n for n, _ in eng.model.named_modules() if n.endswith(".projection")]
    shortcut = eng.flat.mask(projections)[:eng.flat.num_params]
    assert projections and shortcut.any()
    assert all(bool(columns.any()) and not bool((columns & shortcut).any()) for _, _, columns in skips)


def test_stochdepth_rounds_through_the_engine_equal_sequential():
    """Engine.run_round with --clients-at-once 4 against 1, three rounds: the global model and the
    round losses (BatchNorm statistics included in the global model)."""
    seq, m_seq = run_rounds(1, "stochdepth", STOCHDEPTH_OPTIONS, rounds=3, **STOCHDEPTH)
    bat, m_bat = run_rounds(4, "stochdepth", STOCHDEPTH_OPTIONS, rounds=3, **STOCHDEPTH)
    env = rounds_envelope(seq, "stochdepth", STOCHDEPTH_OPTIONS, **STOCHDEPTH)
    assert_rounds_equal(seq, bat, m_seq, m_bat, env)


#: GradAug's paper reading (n = 2 drawn widths) and the authors' code's (the narrowest first, n = 3), on the
#: narrow ResNet with dropout before the classifier (the sub-networks' masks come from each client's stream)
GRADAUG_OPTIONS = {"paper": {}, "sandwich": {"sandwich": True, "num_subnets": 3}}


@pytest.mark.parametrize("variant", list(GRADAUG_OPTIONS))
def test_gradaug_clients_equal_sequential(variant):
    """Round 0 client by client: the full forward grouped, each client's sub-networks (its own widths
    and resolutions) on its real rows under its own weights and dropout stream."""
    same_as_sequential("gradaug", GRADAUG_OPTIONS[variant], rerun=True, **FEDALIGN)


def test_gradaug_rounds_through_the_engine_equal_sequential():
    """Two rounds: the aggregation and the next round's streams. A third reaches a rounding event on
    AVX-512 (9e-4; under avx2 already the second, 3.4e-3), which the envelope then has to take: 8 more
    sequential runs, 51 s of CI for what two rounds check."""
    seq, m_seq = run_rounds(1, "gradaug", {}, rounds=2, **FEDALIGN)
    bat, m_bat = run_rounds(4, "gradaug", {}, rounds=2, **FEDALIGN)
    assert_rounds_equal(seq, bat, m_seq, m_bat, rounds_envelope(seq, "gradaug", {}, rounds=2, **FEDALIGN))
