"""The FedAlign family's rounds computed by hand (see tests/reference_steps.py for the contract).

FedAlign, MOON, Mixup, StochDepth and GradAug on ``resnet_digits``, a small ResNet on the
8x8 digits. Shared with fedhpc: the data, the initial weights, the documented random
streams, and the model's layers (its residual blocks and its width-sliced passes, which
tests/test_fedalign.py checks against networks built from copied weight slices). The
losses are written out here again: FedAlign's transmitting matrices with an einsum and
their top singular values with ``torch.linalg.svdvals`` (the algorithm's power iteration
runs long enough to agree), MOON's contrastive term with explicit exponentials,
stochastic depth with a hand-written forward, GradAug's KL as sum p (log p - log q).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import derive_seed
from fedhpc.engine import sample_clients
from reference_steps import autograd, batch_indices, flat_of, load_flat, reference, start_model

TINY = ["--model", "resnet_digits", "--model-opt", "width=4"]
#: the standard set's small models: a dropout one (and no BatchNorm) and a BatchNorm one
MODELS = {"dropout": TINY + ["--model-opt", "norm=none", "--model-opt", "dropout=0.3"],
          "batchnorm": TINY + ["--model-opt", "norm=batch"]}
MOON_MODELS = {k: v + ["--model-opt", "projection_dim=8"] for k, v in MODELS.items()}


def sgd_rounds(eng, rounds, grad_fn, on_client_done=None):
    """``rounds`` rounds by hand: plain SGD with ``grad_fn(m, x, y, cid, t, state)`` on every sampled
    client from the round's global weights, then the n_k-weighted mean of the client states."""
    cfg = eng.cfg
    global_flat = eng.global_state.double().clone()
    for t in range(rounds):
        sampled = sample_clients(cfg.seed, t, eng.data.num_clients, cfg.clients_per_round)
        total, weight = 0, 0
        for cid in sampled:
            c = eng.data.client(cid)
            x, y = c.x.double(), c.y
            m = load_flat(eng, start_model(eng), global_flat)
            state = {"global_flat": global_flat}
            for epoch in range(cfg.local_epochs):
                for idx in batch_indices(cfg.seed, t, cid, epoch, c.num_train, cfg.batch_size):
                    grads = grad_fn(m, x[idx], y[idx], cid, t, state)
                    with torch.no_grad():
                        for p, g in zip(m.parameters(), grads):
                            p -= cfg.lr * g
            if on_client_done is not None:
                on_client_done(cid, m)
            total = total + c.num_train * flat_of(eng, m)
            weight += c.num_train
        global_flat = total / weight
    return global_flat


# ----------------------------------------------------------------------------- FedAlign

def transmitting(f1, f2):
    """f1^T f2 / HW per sample, f1 average-pooled to f2's size (Eqs. 6-7 as the authors compute them)."""
    k = f1.shape[-1] // f2.shape[-1]
    if k > 1:
        f1 = F.avg_pool2d(f1, k)
    return torch.einsum("bip,bjp->bij", f1.flatten(2), f2.flatten(2)) / f2.shape[-1] / f2.shape[-2]


@reference("fedalign")
def ref_fedalign(eng):
    o = eng.algo.options
    assert o.power_iters >= 200 and not o.lip_rescale

    def grad(m, x, y, cid, t, st):
        logits, feats = m(x, return_features=True)
        f_in, f_out = feats["last_block_in"].detach(), feats["last_block_out"].detach()
        slim_in, slim = m.run_last_block(f_in, o.width, return_input=True)
        k_full = torch.linalg.svdvals(transmitting(f_in, f_out))[:, 0]
        k_slim = torch.linalg.svdvals(transmitting(f_in if o.student_input == "full" else slim_in, slim))[:, 0]
        return autograd(m, F.cross_entropy(logits, y) + o.mu * ((k_slim - k_full) ** 2).mean())
    return sgd_rounds(eng, 1, grad)


ref_fedalign.argv = TINY + ["--model-opt", "norm=batch", "--mu", "2.0", "--power-iters", "300", "--no-lip-rescale"]
ref_fedalign.standard_argv = ["--momentum", "0.5", "--student-input", "sliced", "--lip-rescale"]
ref_fedalign.standard_models = MODELS


# ----------------------------------------------------------------------------- MOON

@reference("moon")
def ref_moon(eng):
    """Two rounds with every client each round: round 0 is CE alone (no previous models yet),
    round 1 contrasts with the round-0 global model and each client's round-0 model."""
    o = eng.algo.options
    previous = {}

    def frozen(flat_or_model):
        net = copy.deepcopy(flat_or_model).eval()
        for p in net.parameters():
            p.requires_grad_(False)
        return net

    def grad(m, x, y, cid, t, st):
        logits, feats = m(x, return_features=True)
        loss = F.cross_entropy(logits, y)
        if cid in previous:
            if "glob" not in st:
                st["glob"] = frozen(load_flat(eng, start_model(eng), st["global_flat"]))
            z = feats["projection"]
            zg = st["glob"](x, return_features=True)[1]["projection"]
            zp = previous[cid](x, return_features=True)[1]["projection"]
            pos = torch.exp(F.cosine_similarity(z, zg) / o.temperature)
            neg = torch.exp(F.cosine_similarity(z, zp) / o.temperature)
            loss = loss + o.mu * (-torch.log(pos / (pos + neg))).mean()
        return autograd(m, loss)

    # a client's model after its local training is its "previous" one in its next round
    return sgd_rounds(eng, 2, grad, on_client_done=lambda cid, m: previous.__setitem__(cid, frozen(m)))


ref_moon.rounds = 2
ref_moon.argv = TINY + ["--model-opt", "norm=batch", "--model-opt", "projection_dim=8", "--clients-per-round", "4",
                        "--mu", "5.0"]
ref_moon.standard_argv = ["--momentum", "0.5", "--mu", "2.0"]
ref_moon.standard_models = MOON_MODELS


# ----------------------------------------------------------------------------- Mixup

@reference("mixup")
def ref_mixup(eng):
    o, seed = eng.algo.options, eng.cfg.seed

    def grad(m, x, y, cid, t, st):
        if "beta" not in st:
            st["beta"] = np.random.default_rng(derive_seed(seed, "mixup_beta", t, cid))
            st["perm"] = torch.Generator().manual_seed(derive_seed(seed, "mixup_perm", t, cid))
        beta = float(st["beta"].beta(o.gamma, o.gamma))
        j = torch.randperm(x.shape[0], generator=st["perm"])
        logits = m(beta * x + (1 - beta) * x[j])
        return autograd(m, beta * F.cross_entropy(logits, y) + (1 - beta) * F.cross_entropy(logits, y[j]))
    return sgd_rounds(eng, 1, grad)


ref_mixup.argv = TINY + ["--model-opt", "norm=batch", "--gamma", "0.5"]
ref_mixup.standard_argv = ["--momentum", "0.5", "--gamma", "0.4"]
ref_mixup.standard_models = MODELS


# ----------------------------------------------------------------------------- StochDepth

@reference("stochdepth")
def ref_stochdepth(eng):
    o, seed = eng.algo.options, eng.cfg.seed
    n_blocks = len(start_model(eng).blocks)
    keep = [1 - l / n_blocks * (1 - o.final_keep_prob) for l in range(1, n_blocks + 1)]

    def grad(m, x, y, cid, t, st):
        g = st.setdefault("gen", torch.Generator().manual_seed(derive_seed(seed, "stochdepth", t, cid)))
        h = m.stem(x)
        for block, p in zip(m.blocks, keep):
            alive = float(torch.rand((), generator=g)) < p  # one draw per block per batch
            h = F.relu((block.residual(h) if alive else 0) + block.shortcut(h))
        loss = F.cross_entropy(m.head(h.mean((2, 3))), y)
        # a dropped block's weights get no gradient (plain SGD leaves them where they are)
        grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(m.parameters(), grads)]
    return sgd_rounds(eng, 1, grad)


ref_stochdepth.argv = TINY + ["--model-opt", "norm=batch", "--final-keep-prob", "0.4"]
ref_stochdepth.standard_argv = ["--momentum", "0.5", "--final-keep-prob", "0.5"]
ref_stochdepth.standard_models = MODELS


# ----------------------------------------------------------------------------- GradAug

@reference("gradaug")
def ref_gradaug(eng):
    o, seed = eng.algo.options, eng.cfg.seed
    scales = [float(s) for s in o.scales.split(",")]

    def grad(m, x, y, cid, t, st):
        g = st.setdefault("gen", torch.Generator().manual_seed(derive_seed(seed, "gradaug", t, cid)))
        u = torch.rand(o.num_subnets, generator=g, dtype=torch.float64)
        widths = sorted((o.min_width + (1 - o.min_width) * float(v) for v in u), reverse=True)
        picks = torch.randint(len(scales), (o.num_subnets,), generator=g)
        logits = m(x)
        p = F.softmax(logits.detach(), -1)
        loss = F.cross_entropy(logits, y)
        for w, k in zip(widths, picks):
            size = round(scales[int(k)] * x.shape[-1])
            xs = x if size == x.shape[-1] else F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            logq = F.log_softmax(m.forward_width(xs, w), -1)
            loss = loss + o.mu * (p * (torch.log(p) - logq)).sum(-1).mean()
        return autograd(m, loss)
    return sgd_rounds(eng, 1, grad)


ref_gradaug.argv = TINY + ["--model-opt", "norm=batch", "--min-width", "0.3", "--mu", "3.0"]
ref_gradaug.standard_argv = ["--momentum", "0.5", "--min-width", "0.5", "--num-subnets", "2"]
ref_gradaug.standard_models = MODELS
