"""pMixFed (Eqs. 5-8): the mix factor's values, the layer coefficients, the segmented mix over
flat states against a per-parameter loop, and whole rounds through the engine against the
hand computation of tests/reference_steps_pmixfed.py under the options' other readings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhpc.algorithms.personal import LayerMap
from fedhpc.algorithms.pmixfed import aggregation_lambdas, broadcast_lambdas, mix_factor
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import ConfigError
from fedhpc.flat import FlatModel
from fedhpc.models import build_model
from fedhpc.world import World
from reference_steps_pmixfed import pmixfed_rounds

#: hand computations compared within tolerances that must hold on any CPU (scripts/test.sh runs them twice)
pytestmark = pytest.mark.cross_cpu


# ----------------------------------------------------------------------------- Eq. 5

@pytest.mark.parametrize("acc,delta,b,want", [
    (1.0, 0.7, 2.0, 0.5),                                   # Acc = 1: the sigmoid's midpoint
    (0.3, 0.0, 2.0, 0.5),                                   # t = 0: delta = 0
    (2.0, 1.0, 2.0, 1 - 1 / (1 + np.exp(-3.0))),            # z = 1 * (4 - 1)
    (0.5, 0.5, 2.0, 1 - 1 / (1 + np.exp(0.375))),           # z = 0.5 * (0.25 - 1)
    (0.5, 0.5, 1.0, 1 - 1 / (1 + np.exp(0.25))),            # b = 1
    (0.0, 1.0, 2.0, 1 - 1 / (1 + np.exp(1.0))),             # the largest mu at delta = 1
])
def test_mix_factor_values(acc, delta, b, want):
    assert mix_factor(acc, delta, b) == pytest.approx(float(want), abs=1e-15)


def test_mix_factor_shape_and_extremes():
    # a client better than the global model shares less (smaller mu), and more so later on
    accs = [0.2, 0.8, 1.0, 1.5, 3.0]
    for delta in (0.25, 1.0):
        mus = [mix_factor(a, delta) for a in accs]
        assert all(x > y for x, y in zip(mus, mus[1:]))
    assert mix_factor(1.5, 1.0) < mix_factor(1.5, 0.25) < 0.5 < mix_factor(0.5, 0.25) < mix_factor(0.5, 1.0)
    assert mix_factor(1e6, 1.0) == 0.0 and math.isfinite(mix_factor(1e6, 1e-9))   # no overflow


# ----------------------------------------------------------------------------- Eq. 6

@pytest.mark.parametrize("mu", [0.0, 0.1, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("layers", [2, 5, 15])
def test_layer_coefficients_as_written(mu, layers):
    # default: i = 1 (base) .. n (head), n = number of layers (Sec. 3.1's {1..M})
    n = layers
    got_b = broadcast_lambdas(mu, layers).tolist()
    got_p = broadcast_lambdas(mu, layers, "prose").tolist()
    got_a = aggregation_lambdas(mu, layers).tolist()
    for k, i in enumerate(range(1, n + 1)):
        assert got_b[k] == pytest.approx(1.0 if mu * (n - i) > 1 else mu * (n - i))   # lambda_i > 1 -> 1
        assert got_p[k] == pytest.approx(min(1.0, mu * (i - 1)))                    # reversed reading
        assert got_a[k] == pytest.approx(0.0 if 1 - i * mu <= 0 else 1 - i * mu)     # lambda_i <= 0 -> 0
    assert got_b[-1] == 0.0 and got_a[0] == 1.0 - mu   # head all local at broadcast; the base learns at aggregation
    # "i = 0 -> n" read literally (first_layer_index 0, n = layers - 1): the same broadcast, but the
    # aggregation keeps the global base for ever (lambda_0 = 1)
    n0 = layers - 1
    got_a0 = aggregation_lambdas(mu, layers, first_index=0).tolist()
    for i in range(layers):
        assert got_a0[i] == pytest.approx(max(0.0, 1 - i * mu))
        assert got_b[i] == pytest.approx(min(1.0, mu * (n0 - i)))
    assert got_a0[0] == 1.0


def test_layer_coefficients_for_many_clients_at_once():
    mus = torch.tensor([0.1, 0.4, 0.8])
    b, a = broadcast_lambdas(mus, 5), aggregation_lambdas(mus, 5)
    assert b.shape == a.shape == (3, 5)
    for c in range(3):
        assert torch.equal(b[c], broadcast_lambdas(float(mus[c]), 5))
        assert torch.equal(a[c], aggregation_lambdas(float(mus[c]), 5))


# ----------------------------------------------------------------------------- the mix over flat states

def expected_mix(model, flat, a, b, lam, unit):
    """Per parameter / buffer by name: which layer it is, then lam a + (1 - lam) b."""
    blocks = [n for n, _ in model.layers()]
    params = [n for n, _ in model.named_parameters()]
    out = torch.empty_like(a)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        off = next(e.offset for e in flat.entries if e.name == name)
        if unit == "block":
            layer = next(i for i, p in enumerate(blocks) if name.startswith(p + "."))
        elif name in params:
            layer = params.index(name)
        else:  # a buffer: the last parameter of its module
            module = name.rpartition(".")[0]
            layer = max(i for i, p in enumerate(params) if p.rpartition(".")[0] == module)
        sl = slice(off, off + t.numel())
        out[..., sl] = lam[..., layer:layer + 1] * a[..., sl] + (1 - lam[..., layer:layer + 1]) * b[..., sl]
    return out


@pytest.mark.parametrize("unit", ["block", "tensor"])
def test_segmented_mix_equals_a_loop_over_parameters(unit):
    torch.manual_seed(0)
    model = build_model("pmixfed_cnn_digits", (1, 8, 8), 10, {"norm": "batch"})   # BN: buffers too
    flat = FlatModel(model)
    lmap = LayerMap(model, flat, unit)
    assert lmap.num_layers == (5 if unit == "block" else len(list(model.parameters())))
    a, b = torch.randn(flat.numel), torch.randn(flat.numel)
    lam = torch.rand(lmap.num_layers, dtype=torch.float64)
    want = expected_mix(model, flat, a, b, lam.float(), unit)
    assert torch.allclose(lmap.mix(a, b, lam), want, rtol=0, atol=1e-6)
    # many clients against one global state, one call
    many_a, many_lam = torch.randn(4, flat.numel), torch.rand(4, lmap.num_layers, dtype=torch.float64)
    got = lmap.mix(many_a, b, many_lam)
    want = expected_mix(model, flat, many_a, b.expand(4, -1), many_lam.float(), unit)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    # in place into a model's own buffer
    out = flat.flat
    lmap.mix(a, b, lam, out=out)
    assert torch.allclose(out, expected_mix(model, flat, a, b, lam.float(), unit), atol=1e-6)


# ----------------------------------------------------------------------------- rounds through the engine

BASE = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "3",
        "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--model", "mlp", "--model-opt", "depth=3",
        "--partition", "classes:4", "--seed", "3", "--threads", "1", "--quiet", "--no-tensorboard"]


def engine(argv):
    cfg, ao, do = parse_args(argv)
    return Engine(cfg, ao, do, World(threads=1))


@pytest.mark.parametrize("extra", [[], ["--direction", "prose", "--first-local", "init", "--b", "1"],
                                   ["--first-layer-index", "0"]],
                         ids=["formulas", "prose-init-b1", "base-is-layer-0"])
def test_rounds_equal_eqs_5_to_8_by_hand(extra):
    eng = engine(["--algo", "pmixfed", *BASE, *extra])
    want = pmixfed_rounds(eng)
    mus = []
    for t in range(eng.cfg.rounds):
        m = eng.run_round(t)
        mus.append((m["mu_aggregation"], m["mu_broadcast_mean"]))
    assert float((eng.global_state.double() - want["global_state"]).abs().max()) < 2e-5
    for cid, flat in want["client_models"].items():
        assert float((eng.algo.client_model(cid).double() - flat).abs().max()) < 2e-5, cid
    # the adaptive factors really moved away from Eq. 5's t = 0 value of 0.5
    assert mus[0] == (0.5, 0.5) and all(abs(a - 0.5) > 1e-3 and abs(b - 0.5) > 1e-3 for a, b in mus[1:])


def test_the_readings_change_the_result():
    """direction=prose and the tensor unit are different methods, not aliases of the default."""
    outs = {}
    for name, extra in {"default": [], "prose": ["--direction", "prose"], "tensor": ["--layer-unit", "tensor"],
                        "base0": ["--first-layer-index", "0"]}.items():
        eng = engine(["--algo", "pmixfed", *BASE, *extra])
        for t in range(3):  # the broadcast mixes from a client's second round on
            eng.run_round(t)
        outs[name] = eng.global_state
    assert float((outs["default"] - outs["prose"]).abs().max()) > 1e-3
    assert float((outs["default"] - outs["tensor"]).abs().max()) > 1e-3
    assert float((outs["default"] - outs["base0"]).abs().max()) > 1e-3


@pytest.mark.parametrize("first", [1, 0])
def test_the_global_base_layer_learns_unless_it_is_layer_0(first):
    """With the base numbered 1 the aggregation gives it 1 - mu of the global model and mu of the
    clients' average; numbered 0 (the text's "i = 0") it keeps lambda_0 = 1 and its initial values."""
    eng = engine(["--algo", "pmixfed", *BASE, "--first-layer-index", str(first)])
    base = [e for e in eng.flat.entries if e.name.startswith("blocks.0.")]
    assert base
    start = eng.global_state.clone()
    for t in range(2):
        eng.run_round(t)
    moved = max(float((eng.global_state[e.offset:e.offset + e.numel] - start[e.offset:e.offset + e.numel]).abs().max())
                for e in base)
    if first == 1:
        assert moved > 1e-3
    else:
        assert moved == 0.0


def test_dynamic_keeps_mu_fixed_and_needs_no_accuracies():
    eng = engine(["--algo", "pmixfed_dynamic", *BASE, "--mu", "0.2", "--client-test-fraction", "0"])
    for t in range(2):
        m = eng.run_round(t)
        assert m["mu_aggregation"] == 0.2 and m["mu_broadcast_mean"] == pytest.approx(0.2, abs=1e-15)
        assert "acc_overall" not in m


def test_a_checkpoint_resumes_only_under_its_layer_numbering():
    """--first-layer-index is an option with a default, outside the run identity; checkpoints
    from before it existed numbered the layers from 0."""
    from fedhpc.errors import CheckpointError

    eng = engine(["--algo", "pmixfed", *BASE])
    state = eng.algo.state_dict()
    assert state["first_layer_index"] == 1
    eng.algo.load_state_dict(state)
    with pytest.raises(CheckpointError, match="--first-layer-index 0"):
        eng.algo.load_state_dict({"acc_global": 0.5})                     # written before the option
    old = engine(["--algo", "pmixfed_dynamic", *BASE, "--first-layer-index", "0"])
    old.algo.load_state_dict({"acc_global": 0.5})                        # resumed as it ran
    with pytest.raises(CheckpointError, match="--first-layer-index 1"):
        old.algo.load_state_dict(state)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="--direction"):
        parse_args(["--algo", "pmixfed", "--direction", "upwards"])
    with pytest.raises(ConfigError, match="--first-layer-index"):
        parse_args(["--algo", "pmixfed", "--first-layer-index", "2"])
    with pytest.raises(ConfigError, match="client-test-fraction"):
        engine(["--algo", "pmixfed", *BASE, "--client-test-fraction", "0"])
    engine(["--algo", "pmixfed", *BASE, "--client-test-fraction", "0", "--acc-split", "train"])  # allowed


class SlotComm:
    """One rank's side of the all-reduce: keeps what it would send and returns ``total``."""

    def __init__(self, total=None):
        self.sent, self.total = None, total

    def all_reduce_sum_(self, tensor):
        self.sent = tensor.clone()
        if self.total is not None:
            tensor.copy_(self.total)


@pytest.mark.parametrize("ranks", [[[0, 1, 2, 3, 4]], [[0, 1], [2, 3, 4]], [[0], [1, 2], [3, 4]]])
def test_acc_overall_does_not_depend_on_how_clients_are_spread_over_ranks(ranks, monkeypatch):
    """Acc_overall sets every mu, so it must be the same number on any rank count; accuracies
    chosen so that adding them in another grouping changes the last bit."""
    from fractions import Fraction

    from fedhpc.algorithms import RoundInfo
    eng = engine(["--algo", "pmixfed", *BASE])
    algo = eng.algo
    sampled = [6, 2, 5, 0, 3]
    accs = dict(zip(sampled, [0.84, 0.43, 0.76, 0.0, 0.45]))
    monkeypatch.setattr(algo, "_acc_data", lambda cid, ctx=None: (cid,))
    monkeypatch.setattr(algo, "accuracy", lambda state, cid: accs[cid])
    sends = []
    for shard in ranks:  # what every rank contributes
        algo.comm = SlotComm()
        algo.round_begin(RoundInfo(3, sampled, [sampled[i] for i in shard], 0.1))
        sends.append(algo.comm.sent)
    algo.comm = SlotComm(total=sum(sends))
    algo.round_begin(RoundInfo(3, sampled, [sampled[i] for i in ranks[0]], 0.1))
    exact = sum(Fraction(a) for a in accs.values())  # independent: rational arithmetic
    assert algo.acc_global == float(exact) / len(sampled)
