"""Guards of the personalised methods: Ditto's diverging personal model reaches the engine's
non-finite guard, Per-FedAvg's --adapt-steps beyond one epoch and --finetune-epochs (pMixFed
App. 10.1), the finite option checks, and pMixFed's Eq. 5 mix factor at extreme inputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import ClientContext
from fedhpc.algorithms.ditto import Ditto
from fedhpc.algorithms.per_fedavg import PerFedAvg
from fedhpc.algorithms.pmixfed import PMixFed, mix_factor
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import ConfigError, NonFiniteLossError
from fedhpc.world import World
from reference_steps import autograd, batch_indices
from reference_steps_pmixfed import model_at

#: hand computations compared within tolerances that must hold on any CPU (scripts/test.sh runs them twice)
pytestmark = pytest.mark.cross_cpu

BASE = ["--dataset", "digits", "--num-clients", "8", "--clients-per-round", "3", "--rounds", "2",
        "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--partition", "classes:5",
        "--seed", "2", "--threads", "1", "--quiet", "--no-tensorboard"]


def engine(argv):
    cfg, ao, do = parse_args(argv)
    return Engine(cfg, ao, do, World(threads=1))


# ----------------------------------------------------------------------------- Ditto

def test_ditto_diverging_personal_model_stops_the_run():
    """lam * lr = 50 > 2: the proximal term makes v_k oscillate with growing amplitude until it
    overflows. The global model (what ctx.loss_sum reported alone) stays finite, so the run used
    to store and evaluate NaN personal models; now the round raises and keeps nothing."""
    eng = engine(["--algo", "ditto", *BASE, "--model", "mlp", "--lam", "1000", "--personal-steps", "4",
                  "--rounds", "1"])
    with pytest.raises(NonFiniteLossError, match="round 1"):
        eng.run_round(0)
    assert dict(eng.client_state.items()) == {}  # no NaN personal model was stored


def test_ditto_personal_model_that_overflows_on_its_last_step_stops_the_run(monkeypatch):
    """The losses of the personal steps are taken before each step: a v_k that overflows on the
    last step has only finite losses. The trained v_k itself enters the guard too."""
    original = Ditto.personal_step

    def finite_loss_but_poisoned(self, x, y, opt, anchor):
        original(self, x, y, opt, anchor)
        with torch.no_grad():
            self.personal_flat.flat[0] = math.inf
        return torch.zeros(())  # a finite loss: only the state check can see it

    monkeypatch.setattr(Ditto, "personal_step", finite_loss_but_poisoned)
    eng = engine(["--algo", "ditto", *BASE, "--model", "mlp", "--rounds", "1"])
    with pytest.raises(NonFiniteLossError):
        eng.run_round(0)


def test_ditto_reports_the_global_models_training_loss_unchanged():
    """While v_k is finite its part adds exactly 0: Ditto's global model is FedAvg's (mlp: no
    dropout, the same batches), and so is its training loss, bit for bit."""
    ditto = engine(["--algo", "ditto", *BASE, "--model", "mlp", "--lam", "0.5", "--personal-steps", "2"])
    fedavg = engine(["--algo", "fedavg", *BASE, "--model", "mlp"])
    for t in range(2):
        a, b = ditto.run_round(t), fedavg.run_round(t)
        assert a["train_loss"] == b["train_loss"]
        assert torch.equal(ditto.global_state, fedavg.global_state)


@pytest.mark.parametrize("lam", ["inf", "nan", "-1"])
def test_ditto_refuses_a_lam_that_is_not_finite_and_non_negative(lam):
    with pytest.raises(ConfigError, match="--lam must be a finite number >= 0"):
        parse_args(["--algo", "ditto", "--lam", lam])
    parse_args(["--algo", "ditto", "--lam", "0"])


# ----------------------------------------------------------------------------- Per-FedAvg

def test_per_fedavg_takes_every_adapt_step_asked_for_over_several_epochs(monkeypatch):
    """--adapt-steps beyond one epoch's batches continues on epoch 1's batches (their own
    shuffle), then epoch 2's, ...: it used to stop at the end of epoch 0."""
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--alpha", "0.05"])
    eng.run_round(0)
    cid = 0
    c = eng.data.client(cid)
    per_epoch = math.ceil(c.num_train / eng.cfg.batch_size)
    asked = 2 * per_epoch + 3
    eng.algo.options.adapt_steps = asked
    steps, epochs = [], []
    sgd, batches = PerFedAvg.sgd_step, ClientContext.batches
    monkeypatch.setattr(PerFedAvg, "sgd_step", lambda self, m, g, lr: (steps.append(lr), sgd(self, m, g, lr))[1])
    monkeypatch.setattr(ClientContext, "batches",
                        lambda self, epoch, batch_size=None: (epochs.append(epoch), batches(self, epoch, batch_size))[1])
    got = eng.algo.client_model(cid)
    assert len(steps) == asked and set(steps) == {0.05}
    assert epochs == [0, 1, 2]
    # against plain SGD of size alpha on the documented batch order (float64)
    index = eng.algo.evaluation_context(cid).round.index
    order = [idx for e in range(3) for idx in batch_indices(eng.cfg.seed, index, cid, e, c.num_train,
                                                           eng.cfg.batch_size)][:asked]
    m = model_at(eng, eng.global_state.double())
    for idx in order:
        g = autograd(m, F.cross_entropy(m(c.x[idx].double()), c.y[idx]))
        with torch.no_grad():
            for p, gi in zip(m.parameters(), g):
                p -= 0.05 * gi
    want = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert torch.allclose(got[:eng.flat.num_params].double(), want, atol=1e-5)
    # at most one epoch's batches: the steps are those of epoch 0, as before
    steps.clear(); epochs.clear()
    eng.algo.options.adapt_steps = per_epoch - 1
    eng.algo.client_model(cid)
    assert len(steps) == per_epoch - 1 and epochs == [0]


@pytest.mark.parametrize("epochs", [0, 2])
def test_per_fedavg_finetune_epochs_fine_tunes_all_layers_for_cold_start_and_final_adapt(epochs):
    """pMixFed App. 10.1: the final global model is personalised by each baseline's fine-tuning
    for r local epochs, Per-FedAvg's "updating all layers jointly": --finetune-epochs r > 0 is r
    epochs of the run's optimiser (plain SGD, lr decayed to round T) on the client's batches of
    round T, for a cold-start client and under --final-adapt. 0 (Per-FedAvg's default) keeps
    Per-FedAvg's own adaptation, --adapt-steps SGD steps of size alpha. The option used to be
    accepted and ignored."""
    extra = [] if epochs == 0 else ["--finetune-epochs", str(epochs)]
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--alpha", "0.2", "--lr-decay", "0.9",
                  "--cold-start-fraction", "0.25", "--final-adapt", *extra])
    assert eng.algo.options.finetune_epochs == epochs
    for t in range(2):
        eng.run_round(t)
    local = eng.evaluate()
    cold = eng._evaluate_cold_start(local)
    final = eng._evaluate_final_adapted()
    T, bs = eng.cfg.rounds, eng.cfg.batch_size
    lr = 0.05 * 0.9 ** T

    def adapted_accuracy(cid):
        c = eng.data.client(cid)
        x, y = eng.data.client_test_split(cid)
        m = model_at(eng, eng.global_state.double())
        if epochs == 0:
            plan = [(batch_indices(eng.cfg.seed, T, cid, 0, c.num_train, bs)[0], 0.2)]
        else:
            plan = [(idx, lr) for e in range(epochs) for idx in batch_indices(eng.cfg.seed, T, cid, e, c.num_train, bs)]
        for idx, step in plan:
            g = autograd(m, F.cross_entropy(m(c.x[idx].double()), c.y[idx]))
            with torch.no_grad():
                for p, gi in zip(m.parameters(), g):
                    p -= step * gi
        with torch.no_grad():
            return int((m(x.double()).argmax(-1) == y).sum()), len(y)

    rows = [adapted_accuracy(cid) for cid in eng.cold_start]
    assert cold["cold_start_accuracy"] == pytest.approx(sum(r for r, _ in rows) / sum(n for _, n in rows), abs=1e-12)
    rows = [adapted_accuracy(cid) for cid in eng.training_clients]
    assert final["local_test_accuracy_adapted_mean"] == pytest.approx(sum(r / n for r, n in rows) / len(rows),
                                                                      abs=1e-12)


@pytest.mark.parametrize("flag", ["--alpha", "--delta"])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_per_fedavg_refuses_an_alpha_or_delta_that_is_not_finite_and_positive(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be a finite number > 0"):
        parse_args(["--algo", "per_fedavg", flag, value])
    parse_args(["--algo", "per_fedavg", flag, "1e-3"])


# ----------------------------------------------------------------------------- pMixFed's Eq. 5

def old_mix_factor(acc, delta, b=2.0):
    """The implementation before overflow was handled (for finite acc^b it must not change)."""
    z = delta * (acc ** b - 1.0)
    if z >= 0:
        e = math.exp(-z)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(z))


def eq5(acc, delta, b):
    """Eq. 5 as the paper writes it: mu = 1 - 1 / (1 + e^(-delta (Acc^b - 1)))."""
    return 1.0 - 1.0 / (1.0 + math.exp(-delta * (acc ** b - 1.0)))


@pytest.mark.parametrize("acc", [0.0, 0.3, 0.9, 1.0, 1.7, 5.0, 40.0])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("b", [0.5, 1.0, 2.0, 3.0, 10.0])
def test_mix_factor_is_unchanged_at_ordinary_inputs(acc, delta, b):
    mu = mix_factor(acc, delta, b)
    assert mu == old_mix_factor(acc, delta, b)  # bit for bit
    assert mu == pytest.approx(eq5(acc, delta, b), rel=1e-12, abs=1e-15)
    assert 0.0 <= mu <= 1.0


@pytest.mark.parametrize("acc,delta,b,want", [
    (1e6, 0.5, 60.0, 0.0),      # acc^b = 1e360: z -> +inf, mu = sigmoid(-inf) = 0 (it raised OverflowError)
    (3.0, 0.5, 700.0, 0.0),
    (1e6, 1.0, 1e6, 0.0),
    (math.inf, 0.5, 2.0, 0.0),
    (1e6, 0.0, 60.0, 0.5),      # delta = 0 (the first round): mu = 0.5 whatever acc is
    (0.0, 1.0, 700.0, 1.0 / (1.0 + math.exp(-1.0))),   # acc^b = 0: z = -delta, mu = sigmoid(delta)
    (0.5, 1.0, 1e6, 1.0 / (1.0 + math.exp(-1.0))),     # acc^b underflows to 0: the same
])
def test_mix_factor_at_extreme_inputs_returns_the_limit(acc, delta, b, want):
    assert mix_factor(acc, delta, b) == want


def test_mix_factor_beyond_the_float_range_still_weighs_a_tiny_delta():
    """acc^b overflows but delta acc^b does not: z = exp(log delta + b log acc), not infinity."""
    acc, delta, b = 10.0, 1e-320, 310.0            # z = 1e-320 * 1e310 = 1e-10
    assert mix_factor(acc, delta, b) == pytest.approx(1.0 / (1.0 + math.exp(1e-10)), rel=1e-6)


def test_broadcast_mu_with_a_zero_overall_accuracy_and_a_large_b():
    """Acc_overall = 0 caps the broadcast's ratio at 1e6: with b = 700 (seen in round 3 of a
    run) mu used to raise OverflowError mid-run; it is the limit 0."""
    algo = SimpleNamespace(acc_global=0.0, options=SimpleNamespace(b=700.0), delta=lambda t: t / 4)
    assert PMixFed.broadcast_mu(algo, 0.4, 2) == 0.0
    assert PMixFed.broadcast_mu(algo, 0.0, 2) == mix_factor(1.0, 0.5, 700.0) == 0.5
    assert PMixFed.broadcast_mu(algo, 0.4, 0) == 0.5
