"""The pMixFed family's rounds computed by hand (contract: tests/reference_steps.py).

pMixFed (Eqs. 5-8) and pMixFed-Dynamic, FedPer, FedSim, FedAlt, LG-FedAvg, FedBABU, Ditto and
Per-FedAvg on a 3-block MLP (blocks.0, blocks.1, head), plain SGD, float64. Shared with
fedhpc: the data, the initial weights, the documented batch order and the model's declared
``layers()``. Written out again here: accuracies (argmax over a float64 forward), the mix
factor with math.exp, every mix as a loop over parameters with that parameter's own
lambda, each client's G'_k before the weighted sum, the shared/personal split by layer
name, the frozen head, Ditto's proximal gradient, Per-FedAvg's inner step / restore / meta step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fedhpc.engine import sample_clients
from reference_steps import autograd, batch_indices, flat_of, load_flat, reference, start_model

MLP3 = ["--model-opt", "depth=3"]


def model_at(eng, flat):
    """A float64 copy of the engine's model holding the flat state ``flat``."""
    return load_flat(eng, start_model(eng), flat)


def layer_index(eng, name: str) -> int:
    """The declared block (0 = base) holding parameter ``name``."""
    for i, (prefix, _) in enumerate(eng.model.layers()):
        if name == prefix or name.startswith(prefix + "."):
            return i
    raise AssertionError(name)


def accuracy(eng, flat, x, y) -> float:
    if len(y) == 0:
        return float("nan")
    m = model_at(eng, flat)
    with torch.no_grad():
        return float((m(eng.data.transform(x, False, None).double()).argmax(-1) == y).double().mean())


def sgd(eng, m, cid, t, epochs, first_epoch=0, trainable=None, extra_grad=None, lr=None):
    """Plain SGD steps of the engine's batch order; only parameters whose name passes
    ``trainable`` move; ``extra_grad(name, p)`` is added to the loss gradient."""
    cfg = eng.cfg
    c = eng.data.client(cid)
    x, y = c.x.double(), c.y
    lr = cfg.lr if lr is None else lr
    for epoch in range(first_epoch, first_epoch + epochs):
        for idx in batch_indices(cfg.seed, t, cid, epoch, c.num_train, cfg.batch_size):
            grads = autograd(m, F.cross_entropy(m(x[idx]), y[idx]))
            with torch.no_grad():
                for (name, p), g in zip(m.named_parameters(), grads):
                    if trainable is None or trainable(name):
                        if extra_grad is not None:
                            g = g + extra_grad(name, p)
                        p -= lr * g
    return m


def mix_per_parameter(eng, a, b, lam_of_layer):
    """lam_i a + (1 - lam_i) b, one flat entry (parameter) at a time."""
    out = a.clone()
    for e in eng.flat.entries:
        lam = lam_of_layer(layer_index(eng, e.name))
        sl = slice(e.offset, e.offset + e.numel)
        out[sl] = lam * a[sl] + (1 - lam) * b[sl]
    return out


def mu_eq5(acc, t, T, b=2.0):
    return 1 - 1 / (1 + math.exp(-(t / T) * (acc ** b - 1)))


def weighted_mean(eng, flats):
    sizes = {cid: eng.data.client(cid).num_train for cid in flats}
    return sum(sizes[c] * f for c, f in flats.items()) / sum(sizes.values())


# ----------------------------------------------------------------------------- pMixFed

def pmixfed_rounds(eng, fixed_mu=None):
    """``cfg.rounds`` rounds of Eqs. 5-8 with the algorithm's options (b, direction, first_local,
    first_layer_index: the base is layer 0 in this file's loops, layer ``first_layer_index`` in Eq. 6)."""
    cfg, data, o = eng.cfg, eng.data, eng.algo.options
    G = eng.global_state.double().clone()
    G0 = G.clone()
    n = len(eng.model.layers()) - 1
    steps = (lambda i: n - i) if o.direction == "formulas" else (lambda i: i)  # noqa: E731
    local = {}
    for t in range(cfg.rounds):
        sampled = sample_clients(cfg.seed, t, data.num_clients, cfg.clients_per_round)
        tests = {cid: data.client_test_split(cid) for cid in sampled}
        if fixed_mu is None:
            acc_g = sum(accuracy(eng, G, *tests[c]) for c in sampled) / len(sampled)
            mu_agg = mu_eq5(acc_g, t, cfg.rounds, o.b)
        else:
            mu_agg = fixed_mu
        g_prime = {}
        for cid in sampled:
            L = local.get(cid, G if o.first_local == "global" else G0)
            if fixed_mu is None:  # Acc = Acc_k / Acc_overall (a zero denominator: 1 if both are 0, else capped)
                acc_k = accuracy(eng, L, *tests[cid])
                ratio = acc_k / acc_g if acc_g > 0 else (1.0 if acc_k == 0 else 1e6)
                mu = mu_eq5(min(ratio, 1e6), t, cfg.rounds, o.b)
            else:
                mu = fixed_mu
            start = mix_per_parameter(eng, G, L, lambda i: min(1.0, mu * steps(i)))          # Eqs. 6-7
            local[cid] = flat_of(eng, sgd(eng, model_at(eng, start), cid, t, cfg.local_epochs))
            g_prime[cid] = mix_per_parameter(eng, G, local[cid], lambda i: max(0.0, 1 - (i + o.first_layer_index) * mu_agg))  # Eq. 8
        G = weighted_mean(eng, g_prime)
    return {"global_state": G, "client_models": local}


@reference("pmixfed")
def ref_pmixfed(eng):
    return pmixfed_rounds(eng)


@reference("pmixfed_dynamic")
def ref_pmixfed_dynamic(eng):
    return pmixfed_rounds(eng, fixed_mu=eng.algo.options.mu)


ref_pmixfed.rounds = 3
ref_pmixfed.argv = MLP3 + ["--rounds", "3"]
ref_pmixfed_dynamic.rounds = 3
ref_pmixfed_dynamic.argv = MLP3 + ["--rounds", "3", "--mu", "0.3"]
ref_pmixfed_dynamic.standard_argv = ["--mu", "0.3", "--direction", "prose"]
ref_pmixfed.standard_argv = ["--layer-unit", "tensor"]


# ----------------------------------------------------------------------------- shared / personal splits

def partial_rounds(eng, personal_blocks, rounds, alternate=False):
    """Shared layers averaged, personal ones kept per client (FedPer, FedSim, LG-FedAvg);
    ``alternate``: FedAlt's personal epochs (shared fixed), then shared epochs (personal fixed)."""
    cfg, data = eng.cfg, eng.data
    names = [n for n, _ in eng.model.layers()]
    is_personal = lambda name: names[layer_index(eng, name)] in personal_blocks  # noqa: E731
    G = eng.global_state.double().clone()
    mine = {}
    for t in range(rounds):
        sampled = sample_clients(cfg.seed, t, data.num_clients, cfg.clients_per_round)
        trained = {}
        for cid in sampled:
            m = model_at(eng, G)
            if cid in mine:  # the client's own personal layers over the global shared ones
                own = model_at(eng, mine[cid])
                with torch.no_grad():
                    for (name, p), q in zip(m.named_parameters(), own.parameters()):
                        if is_personal(name):
                            p.copy_(q)
            if alternate:
                sgd(eng, m, cid, t, cfg.local_epochs, trainable=is_personal)
                sgd(eng, m, cid, t, cfg.local_epochs, first_epoch=cfg.local_epochs,
                    trainable=lambda name: not is_personal(name))
            else:
                sgd(eng, m, cid, t, cfg.local_epochs)
            trained[cid] = mine[cid] = flat_of(eng, m)
        avg = weighted_mean(eng, trained)
        new = G.clone()
        for e in eng.flat.entries:
            if not is_personal(e.name):
                new[e.offset:e.offset + e.numel] = avg[e.offset:e.offset + e.numel]
        G = new
    clients = {}
    for cid, flat in mine.items():  # what each client evaluates: global shared + own personal
        f = G.clone()
        for e in eng.flat.entries:
            if is_personal(e.name):
                f[e.offset:e.offset + e.numel] = flat[e.offset:e.offset + e.numel]
        clients[cid] = f
    return {"global_state": G, "client_models": clients}


@reference("fedper")
def ref_fedper(eng):
    return partial_rounds(eng, {"head"}, 2)


@reference("fedsim")
def ref_fedsim(eng):  # first half shared: 3 layers -> blocks.0 shared
    return partial_rounds(eng, {"blocks.1", "head"}, 2)


@reference("fedalt")
def ref_fedalt(eng):
    return partial_rounds(eng, {"blocks.1", "head"}, 2, alternate=True)


@reference("lg_fedavg")
def ref_lg_fedavg(eng):  # global top layer (head), local representation
    return partial_rounds(eng, {"blocks.0", "blocks.1"}, 2)


for _f in (ref_fedper, ref_fedsim, ref_fedalt, ref_lg_fedavg):
    _f.rounds = 2
    _f.argv = MLP3 + ["--rounds", "2"]


# ----------------------------------------------------------------------------- FedBABU

@reference("fedbabu")
def ref_fedbabu(eng):
    """One round with the head fixed (only the body averaged), then, this being the last round,
    every client's evaluated model: the new global fine-tuned for finetune_epochs (round index 1)."""
    cfg, data = eng.cfg, eng.data
    body = lambda name: not name.startswith("head")  # noqa: E731
    G = eng.global_state.double().clone()
    sampled = sample_clients(cfg.seed, 0, data.num_clients, cfg.clients_per_round)
    trained = {cid: flat_of(eng, sgd(eng, model_at(eng, G), cid, 0, cfg.local_epochs, trainable=body))
               for cid in sampled}
    avg = weighted_mean(eng, trained)
    for e in eng.flat.entries:
        if body(e.name):
            G[e.offset:e.offset + e.numel] = avg[e.offset:e.offset + e.numel]
    tuned = {cid: flat_of(eng, sgd(eng, model_at(eng, G), cid, 1, eng.algo.options.finetune_epochs))
             for cid in range(data.num_clients)}
    return {"global_state": G, "client_models": tuned}


ref_fedbabu.argv = MLP3 + ["--finetune-epochs", "2"]


# ----------------------------------------------------------------------------- Ditto

@reference("ditto")
def ref_ditto(eng):
    """Two rounds: per batch, personal steps on F(v) + lam/2 ||v - w^t||^2, then a global step;
    v starts as the global model a client first receives. The global model is FedAvg's (the
    standard test's "differs from FedAvg" check does not apply: ``global_is_fedavg``)."""
    cfg, data, o = eng.cfg, eng.data, eng.algo.options
    G = eng.global_state.double().clone()
    personal = {}
    for t in range(2):
        sampled = sample_clients(cfg.seed, t, data.num_clients, cfg.clients_per_round)
        anchor = {name: p.detach().clone() for name, p in model_at(eng, G).named_parameters()}
        trained = {}
        for cid in sampled:
            c = data.client(cid)
            x, y = c.x.double(), c.y
            w = model_at(eng, G)
            v = model_at(eng, personal.get(cid, G))
            for idx in batch_indices(cfg.seed, t, cid, 0, c.num_train, cfg.batch_size):
                for _ in range(o.personal_steps):
                    gv = autograd(v, F.cross_entropy(v(x[idx]), y[idx]))
                    with torch.no_grad():
                        for (name, p), g in zip(v.named_parameters(), gv):
                            p -= cfg.lr * (g + o.lam * (p - anchor[name]))
                gw = autograd(w, F.cross_entropy(w(x[idx]), y[idx]))
                with torch.no_grad():
                    for p, g in zip(w.parameters(), gw):
                        p -= cfg.lr * g
            trained[cid] = flat_of(eng, w)
            personal[cid] = flat_of(eng, v)
        G = weighted_mean(eng, trained)
    return {"client_models": personal, "global_state": G}


ref_ditto.rounds = 2
ref_ditto.global_is_fedavg = True
ref_ditto.argv = MLP3 + ["--rounds", "2", "--lam", "0.5", "--personal-steps", "2"]


# ----------------------------------------------------------------------------- Per-FedAvg

def per_fedavg_step_fo(eng, m, b1, b2, alpha):
    """FO meta-gradient at w: grad f(w - alpha grad f(w; b1); b2), parameters restored to w."""
    w = [p.detach().clone() for p in m.parameters()]
    g1 = autograd(m, F.cross_entropy(m(b1[0]), b1[1]))
    with torch.no_grad():
        for p, g in zip(m.parameters(), g1):
            p -= alpha * g
    g2 = autograd(m, F.cross_entropy(m(b2[0]), b2[1]))
    with torch.no_grad():
        for p, a in zip(m.parameters(), w):
            p.copy_(a)
    return g2


@reference("per_fedavg")
def ref_per_fedavg(eng):
    """One round of FO meta-steps on batch pairs (0,1), (2,3), ... (a short last pair wraps to
    batch 0), SGD outer step beta = lr; then each client's evaluated model: one SGD step of size
    alpha on its first batch of round index 1."""
    cfg, data, o = eng.cfg, eng.data, eng.algo.options
    G = eng.global_state.double().clone()
    sampled = sample_clients(cfg.seed, 0, data.num_clients, cfg.clients_per_round)
    trained = {}
    for cid in sampled:
        c = data.client(cid)
        x, y = c.x.double(), c.y
        m = model_at(eng, G)
        batches = [(x[i], y[i]) for i in batch_indices(cfg.seed, 0, cid, 0, c.num_train, cfg.batch_size)]
        for s in range(0, len(batches), 2):
            g = per_fedavg_step_fo(eng, m, batches[s], batches[(s + 1) % len(batches)], o.alpha)
            with torch.no_grad():
                for p, gi in zip(m.parameters(), g):
                    p -= cfg.lr * gi
        trained[cid] = flat_of(eng, m)
    G = weighted_mean(eng, trained)
    adapted = {}
    for cid in range(data.num_clients):
        c = data.client(cid)
        first = batch_indices(cfg.seed, 1, cid, 0, c.num_train, cfg.batch_size)[0]
        m = model_at(eng, G)
        g = autograd(m, F.cross_entropy(m(c.x[first].double()), c.y[first]))
        with torch.no_grad():
            for p, gi in zip(m.parameters(), g):
                p -= o.alpha * gi
        adapted[cid] = flat_of(eng, m)
    return {"global_state": G, "client_models": adapted}


ref_per_fedavg.argv = MLP3 + ["--alpha", "0.05"]
ref_per_fedavg.standard_argv = ["--variant", "hf"]
