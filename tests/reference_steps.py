"""One round of every registered algorithm computed by hand, to check what the engine runs.

Each reference takes a fresh single-rank :class:`fedhpc.engine.Engine` (built but not
run) and returns the global flat state, in float64, that one round with its sampled
clients should produce. It shares with fedhpc only the data, the initial weights and
the documented random streams (batch order, the algorithm's own seeded draws); the
losses, gradients, optimizer steps and aggregation are written out here again, plainly
(SGD without momentum; FedMix's second-order term as a forward-mode directional
derivative of the first-order gradient), so that a wiring mistake in the algorithm or the engine (the
wrong loss, unweighted averaging, a client mixing with its own mean...) shows up.

A new algorithm adds its reference here, or a family in its own file
``tests/reference_steps_<family>.py`` (imported by :func:`load_family_references`), using
the ``@reference`` decorator and these helpers: tests/test_algorithm_standard.py fails for
every registered algorithm without one. A reference function may set attributes:
``rounds`` (rounds to run, default 1), ``argv`` (extra flags for the check), and
``standard_argv`` (flags that exercise the algorithm's randomness in the resume and
1-vs-2-rank checks), ``standard_models`` ({"dropout": flags, "batchnorm": flags}: small
models of the architecture the method needs, one with dropout and one with BatchNorm). It returns the expected global flat state, or a dict with any of
``global_state``, ``client_models`` ({cid: flat state}, compared with
``algo.client_model(cid)``) and names of algorithm attributes to compare.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List

import numpy as np
import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import derive_seed
from fedhpc.engine import sample_clients

REFERENCES: Dict[str, Callable] = {}


def load_family_references() -> None:
    """Import every tests/reference_steps_*.py so that its references register."""
    import importlib
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    for fn in sorted(os.listdir(here)):
        if fn.startswith("reference_steps_") and fn.endswith(".py"):
            importlib.import_module(fn[:-3])


def reference(name: str):
    def deco(fn):
        REFERENCES[name] = fn
        return fn
    return deco


# ----------------------------------------------------------------------------- shared pieces

def load_flat(eng, m, flat) -> torch.nn.Module:
    """Copy a flat state (the engine's layout) into the float64 model ``m``; returns ``m``."""
    views = {e.name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in eng.flat.entries}
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if name in views:
                t.copy_(views[name].double())
    return m


def start_model(eng) -> torch.nn.Module:
    """A float64 copy of the engine's model holding the initial global weights."""
    return load_flat(eng, copy.deepcopy(eng.model).double(), eng.global_state)


def flat_of(eng, m) -> torch.Tensor:
    named = dict(m.named_parameters())
    named.update(dict(m.named_buffers()))
    return torch.cat([named[e.name].detach().reshape(-1) for e in eng.flat.entries])


def batch_indices(seed, t, cid, epoch, n, bs) -> List[torch.Tensor]:
    """The documented batch order (fedhpc.algorithms.base.ClientContext.batches)."""
    g = torch.Generator().manual_seed(derive_seed(seed, "batches", t, cid, epoch))
    perm = torch.randperm(n, generator=g)
    return [perm[s:s + bs] for s in range(0, n, bs)]


def soft_ce(logits, target_probs):
    return -(target_probs * F.log_softmax(logits, -1)).sum(-1).mean()


def onehot(y, c=10):
    return F.one_hot(y, c).double()


def sgd_round(eng, grad_fn) -> torch.Tensor:
    """Round 0 by hand: every sampled client runs plain SGD with ``grad_fn`` from the global
    weights; the server takes the n_k-weighted mean of the client models."""
    cfg = eng.cfg
    sampled = sample_clients(cfg.seed, 0, eng.data.num_clients, cfg.clients_per_round)
    total, weight = 0, 0
    for cid in sampled:
        c = eng.data.client(cid)
        x, y = c.x.double(), c.y
        m = start_model(eng)
        state = {}
        for epoch in range(cfg.local_epochs):
            for idx in batch_indices(cfg.seed, 0, cid, epoch, c.num_train, cfg.batch_size):
                grads = grad_fn(m, x[idx], y[idx], cid, state)
                with torch.no_grad():
                    for p, g in zip(m.parameters(), grads):
                        p -= cfg.lr * g
        total = total + c.num_train * flat_of(eng, m)
        weight += c.num_train
    return total / weight


def autograd(m, loss):
    return torch.autograd.grad(loss, list(m.parameters()))


# ----------------------------------------------------------------------------- the algorithms

@reference("fedavg")
def ref_fedavg(eng):
    return sgd_round(eng, lambda m, x, y, cid, st: autograd(m, F.cross_entropy(m(x), y)))


@reference("fedprox")
def ref_fedprox(eng):
    mu = eng.algo.options.mu
    w0 = [p.detach().clone() for p in start_model(eng).parameters()]

    def grad(m, x, y, cid, st):  # the proximal gradient mu (w - w_global), added by hand
        return [g + mu * (p.detach() - a) for g, p, a in
                zip(autograd(m, F.cross_entropy(m(x), y)), m.parameters(), w0)]
    return sgd_round(eng, grad)


@reference("localmix")
def ref_localmix(eng):
    o, seed = eng.algo.options, eng.cfg.seed

    def grad(m, x, y, cid, st):
        if "perm" not in st:  # one stream per client, drawn batch after batch
            st["perm"] = torch.Generator().manual_seed(derive_seed(seed, "local_mix", 0, cid))
            st["lam"] = np.random.default_rng(derive_seed(seed, "mix_lambda", 0, cid))
        perm = torch.randperm(x.shape[0], generator=st["perm"])
        lam = float(st["lam"].beta(o.mix_alpha, o.mix_alpha)) if o.mix_alpha > 0 else o.lam
        logits = m((1 - lam) * x + lam * x[perm])
        return autograd(m, (1 - lam) * soft_ce(logits, onehot(y)) + lam * soft_ce(logits, onehot(y[perm])))
    return sgd_round(eng, grad)


@reference("globalmix")
def ref_globalmix(eng):
    o, seed, data = eng.algo.options, eng.cfg.seed, eng.data
    assert o.raw_per_client == 0 and o.mix_alpha == 0
    # every client's raw training samples, in (client, index) order
    pool = [(cid, data.client(cid)) for cid in range(data.num_clients)]

    def grad(m, x, y, cid, st):
        if "gen" not in st:
            st["gen"] = torch.Generator().manual_seed(derive_seed(seed, "raw_select", 0, cid))
            st["px"] = torch.cat([c.x for k, c in pool if k != cid]).double()
            st["py"] = torch.cat([c.y for k, c in pool if k != cid])
        # one partner per sample (the default) or one for the whole batch
        j = torch.randint(len(st["py"]), (x.shape[0] if o.select == "sample" else 1,), generator=st["gen"])
        logits = m((1 - o.lam) * x + o.lam * st["px"][j])
        return autograd(m, (1 - o.lam) * soft_ce(logits, onehot(y)) + o.lam * soft_ce(logits, onehot(st["py"][j])))
    return sgd_round(eng, grad)


def client_means(eng):
    """Mean input and mean one-hot label of every client's training data (M_k = n_k)."""
    out = []
    for cid in range(eng.data.num_clients):
        c = eng.data.client(cid)
        out.append((c.x.double().mean(0), onehot(c.y).mean(0)))
    return out


def mean_pick(st, seed, cid, means):
    """The entry drawn for this batch among the OTHER clients' means, in client order."""
    if "gen" not in st:
        st["gen"] = torch.Generator().manual_seed(derive_seed(seed, "mean_select", 0, cid))
        st["others"] = [mv for k, mv in enumerate(means) if k != cid]
    return st["others"][int(torch.randint(len(st["others"]), (1,), generator=st["gen"]))]


@reference("naivemix")
def ref_naivemix(eng):
    o, seed = eng.algo.options, eng.cfg.seed
    assert o.mean_batch == 0 and o.select == "batch" and o.prox_mu == 0
    means, lam = client_means(eng), o.lam

    def grad(m, x, y, cid, st):
        xbar, ybar = mean_pick(st, seed, cid, means)
        logits = m((1 - lam) * x + lam * xbar)  # Eq. 1
        return autograd(m, (1 - lam) * soft_ce(logits, onehot(y)) + lam * soft_ce(logits, ybar))
    return sgd_round(eng, grad)


@reference("fedmix")
def ref_fedmix(eng):
    from torch.func import functional_call, grad, jvp

    o, seed = eng.algo.options, eng.cfg.seed
    assert o.mean_batch == 0 and o.select == "batch" and o.prox_mu == 0
    means, lam = client_means(eng), o.lam

    def grad_fn(m, x, y, cid, st):
        xbar, ybar = mean_pick(st, seed, cid, means)
        xp = (1 - lam) * x
        logits = m(xp)
        g12 = autograd(m, (1 - lam) * soft_ce(logits, onehot(y)) + lam * soft_ce(logits, ybar))
        # l3 = lam <dL/dx at x', xbar>; its weight gradient is lam * d/de grad_w L(x' + e xbar) at
        # e = 0: the directional derivative of the first-order gradient along xbar, taken here
        # forward-over-reverse (the engine differentiates l3 reverse-over-reverse). Central
        # differences would do too, but not on a ReLU net: a unit within e of its kink jumps.
        params = {k: v.detach() for k, v in m.named_parameters()}

        def grad_w(xin):
            return grad(lambda p: soft_ce(functional_call(m, p, (xin,)), onehot(y)))(params)

        _, along = jvp(grad_w, (xp,), (xbar.expand_as(xp),))
        return [a + lam * along[k] for a, (k, _) in zip(g12, m.named_parameters())]
    return sgd_round(eng, grad_fn)


@reference("fd")
def ref_fd(eng):
    """Two rounds of federated distillation: round 0 trains on CE alone and yields the first
    global per-label outputs; round 1 distils from them. Devices keep their own models."""
    cfg, beta, C = eng.cfg, eng.algo.options.beta, eng.data.num_classes
    models, teacher = {}, None
    for t in range(2):
        sampled = sample_clients(cfg.seed, t, eng.data.num_clients, cfg.clients_per_round)
        tables, present = [], []
        for cid in sampled:
            c = eng.data.client(cid)
            m = models.get(cid) or start_model(eng)
            sums, counts = torch.zeros(C, C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
            for idx in batch_indices(cfg.seed, t, cid, 0, c.num_train, cfg.batch_size):
                x, y = c.x[idx].double(), c.y[idx]
                logits = m(x)
                p = F.softmax(logits, -1).detach()
                for i in range(len(y)):  # Eq. 2, one sample at a time
                    sums[y[i]] += p[i]
                    counts[y[i]] += 1
                loss = F.cross_entropy(logits, y)
                if teacher is not None:  # Eq. 3 per sample, then the batch mean: psi = cross-entropy
                    g, has = teacher      # to G_out[label], 0 for a label without a global output
                    psi = [-(g[y[i]] * F.log_softmax(logits[i], -1)).sum() if has[y[i]] else 0.0
                           for i in range(len(y))]
                    loss = loss + beta * sum(psi) / len(y)
                grads = autograd(m, loss)
                with torch.no_grad():
                    for prm, gr in zip(m.parameters(), grads):
                        prm -= cfg.lr * gr
            models[cid] = m
            tables.append(torch.stack([sums[n] / counts[n] if counts[n] else torch.zeros(C, dtype=torch.float64)
                                       for n in range(C)]))
            present.append(counts > 0)
        has = torch.stack(present).any(0)
        g = torch.stack([sum((tb[n] for tb, pr in zip(tables, present) if pr[n]), torch.zeros(C, dtype=torch.float64))
                         / max(1, sum(int(pr[n]) for pr in present)) for n in range(C)])  # a label no one holds: 0
        teacher = (g, has)
    return {"teacher": teacher[0], "client_models": {cid: flat_of(eng, m) for cid, m in models.items()}}


ref_fd.rounds = 2
# classes:3: round 1's devices hold labels round 0's did not, so some samples have no teacher row
# (where Eq. 3's batch mean and a mean over the distilled samples differ)
ref_fd.argv = ["--beta", "0.5", "--partition", "classes:3"]
