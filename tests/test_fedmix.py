"""FedMix and the MAFL family: the losses, their second-order term, text mixing, the ledger,
and a privacy audit of the traffic of whole runs.

Expected values are computed independently here (per-sample loops, finite
differences, explicit pairwise mixup), never by the function under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedhpc.algorithms.base import soft_loss
from fedhpc.algorithms.mixing import (MixSpace, fedmix_loss, global_mixup_loss, mixup_loss,
                                      naivemix_loss, one_hot)
from fedhpc.errors import ConfigError

# float(loss) on graph-carrying losses is intended here (values only).
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")



def smooth_net(d=12, c=4, seed=0):
    """A float64 tanh MLP: smooth in inputs and weights, so Taylor and finite differences are clean."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, c)).double()


def batch(b=6, m=5, d=12, c=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, d, generator=g, dtype=torch.float64)
    y = one_hot(torch.randint(c, (b,), generator=g), c, torch.float64)
    xs = torch.rand(m, d, generator=g, dtype=torch.float64) + 0.5  # another client's raw samples
    ys = one_hot(torch.randint(c, (m,), generator=g), c, torch.float64)
    return x, y, xs, ys


# --------------------------------------------------------------------------- l3 is second order

def test_l3_is_the_input_gradient_of_the_loss_per_sample():
    net = smooth_net()
    x, y, xs, ys = batch()
    xbar, ybar = xs.mean(0, keepdim=True), ys.mean(0, keepdim=True)
    lam = 0.2
    _, terms = fedmix_loss(net, x, y, xbar, ybar, lam, return_terms=True)
    ref = 0.0
    for i in range(x.shape[0]):  # l3 = lam * mean_i <dL_i/dx at ((1-lam) x_i, y_i), xbar>
        xi = ((1 - lam) * x[i:i + 1]).requires_grad_(True)
        li = -(y[i] * torch.log_softmax(net(xi), -1)).sum()
        (gi,) = torch.autograd.grad(li, xi)
        ref += float((gi * xbar).sum()) / x.shape[0]
    assert math.isclose(terms["l3"].item(), lam * ref, rel_tol=1e-10)
    assert math.isclose(terms["l1"].item(), (1 - lam) * soft_loss(net((1 - lam) * x), y).item(), rel_tol=1e-12)
    assert math.isclose(terms["l2"].item(), lam * soft_loss(net((1 - lam) * x), ybar).item(), rel_tol=1e-12)


@pytest.mark.parametrize("model", ["tanh_mlp", "digits_cnn"])
def test_l3_weight_gradient_is_nonzero_and_matches_finite_differences(model):
    if model == "tanh_mlp":
        net = smooth_net()
        x, y, xs, ys = batch()
    else:  # the registry's ReLU CNN on 8x8 inputs, in float64
        from fedhpc.models import build_model
        torch.manual_seed(0)
        net = build_model("cnn", (1, 8, 8), 10).double()
        g = torch.Generator().manual_seed(2)
        x, xs = torch.rand(4, 1, 8, 8, generator=g).double(), torch.rand(7, 1, 8, 8, generator=g).double()
        y = one_hot(torch.randint(10, (4,), generator=g), 10, torch.float64)
        ys = one_hot(torch.randint(10, (7,), generator=g), 10, torch.float64)
    xbar, ybar = xs.mean(0, keepdim=True), ys.mean(0, keepdim=True)
    lam = 0.1
    params = list(net.parameters())

    def l3():
        return fedmix_loss(net, x, y, xbar, ybar, lam, return_terms=True)[1]["l3"]

    grads = torch.autograd.grad(l3(), params)
    gnorm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    assert gnorm > 1e-4, "l3 does not move the weights (create_graph missing?)"

    gen = torch.Generator().manual_seed(5)
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    analytic = float(sum((g * v).sum() for g, v in zip(grads, direction)))
    eps = 1e-6
    with torch.no_grad():
        for p, v in zip(params, direction):
            p.add_(eps * v)
    plus = l3().item()
    with torch.no_grad():
        for p, v in zip(params, direction):
            p.sub_(2 * eps * v)
    minus = l3().item()
    with torch.no_grad():
        for p, v in zip(params, direction):
            p.add_(eps * v)
    numeric = (plus - minus) / (2 * eps)
    assert abs(analytic) > 1e-5
    assert math.isclose(analytic, numeric, rel_tol=1e-5, abs_tol=1e-9), (analytic, numeric)

    # l3's gradient is part of the total: the gradient of l1 + l2 alone differs by exactly it.
    total, terms = fedmix_loss(net, x, y, xbar, ybar, lam, return_terms=True)
    g_total = torch.autograd.grad(total, params, retain_graph=True)
    g_12 = torch.autograd.grad(terms["l1"] + terms["l2"], params)
    diff = sum(float(((a - b - c) ** 2).sum()) for a, b, c in zip(g_total, g_12, grads))
    assert diff < 1e-20 + 1e-12 * gnorm ** 2


# --------------------------------------------------------------------------- FedMix ~ global mixup

def test_fedmix_matches_global_mixup_to_second_order():
    net = smooth_net(seed=3)
    x, y, xs, ys = batch(seed=4)
    xbar, ybar = xs.mean(0, keepdim=True), ys.mean(0, keepdim=True)
    lams = [0.08 / 2 ** k for k in range(5)]

    def gap(loss_fn, lam):
        return abs(float(loss_fn(lam)) - float(global_mixup_loss(net, x, y, xs, ys, lam)))

    def fedmix(lam):
        return fedmix_loss(net, x, y, xbar, ybar, lam)

    def fedmix_without_l3(lam):  # the public-reimplementation bug: l3 contributes nothing
        _, t = fedmix_loss(net, x, y, xbar, ybar, lam, return_terms=True)
        return t["l1"] + t["l2"]

    gaps = [gap(fedmix, lam) for lam in lams]
    ratios = [a / b for a, b in zip(gaps, gaps[1:])]
    assert all(3.4 < r < 4.6 for r in ratios), ratios            # halving lambda quarters the gap
    over_sq = [g / lam ** 2 for g, lam in zip(gaps, lams)]
    assert max(over_sq) < 1.5 * min(over_sq)                      # gap / lambda^2 stays bounded
    over_lin = [g / lam for g, lam in zip(gaps, lams)]
    assert over_lin[-1] < over_lin[0] / 10                         # gap / lambda does not
    # Control: dropping l3 leaves a first-order error (the gap only halves), so the test can fail.
    bad = [gap(fedmix_without_l3, lam) for lam in lams]
    assert all(1.7 < a / b < 2.3 for a, b in zip(bad, bad[1:]))
    assert bad[-1] > 10 * gaps[-1]


def test_mixup_losses_are_the_two_point_formulas():
    net = smooth_net()
    x, y, xs, ys = batch(m=6)
    lam = 0.3
    # Explicit soft-label cross-entropy of the mixed pair, sample by sample.
    ref = 0.0
    for i in range(6):
        xm = (1 - lam) * x[i] + lam * xs[i]
        ym = (1 - lam) * y[i] + lam * ys[i]
        ref -= float((ym * torch.log_softmax(net(xm[None]), -1)[0]).sum()) / 6
    assert math.isclose(float(mixup_loss(net, x, y, xs, ys, lam)), ref, rel_tol=1e-12)
    assert math.isclose(float(naivemix_loss(net, x, y, xs, ys, lam)), ref, rel_tol=1e-12)
    # Global mixup over J with |J| = 1 is the two-point mixup.
    assert math.isclose(float(global_mixup_loss(net, x[:1], y[:1], xs[:1], ys[:1], lam)),
                        float(mixup_loss(net, x[:1], y[:1], xs[:1], ys[:1], lam)), rel_tol=1e-12)


# --------------------------------------------------------------------------- text: embedding space

class TinyCharLSTM(nn.Module):
    def __init__(self, vocab=7, dim=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, 8, batch_first=True)
        self.out = nn.Linear(8, vocab)

    def embed(self, ids):
        return self.emb(ids)

    def forward_embedded(self, e):
        return self.out(self.rnn(e)[0])

    def forward(self, ids):
        return self.forward_embedded(self.embed(ids))


def text_data(n=30, t=6, v=7, clients=3, stored="int64"):
    """Next-character toy data; ``stored="uint8"``: character ids kept as Shakespeare keeps them,
    turned into int64 ids by the dataset's transform."""
    from fedhpc.data import ArrayFederatedData
    from fedhpc.data.augment import token_ids

    rng = np.random.default_rng(0)
    x = rng.integers(0, v, size=(n, t)).astype(stored)
    y = np.roll(x, -1, axis=1)
    parts = np.array_split(np.arange(n), clients)
    return ArrayFederatedData("toytext", x, y, x[:4], y[:4], parts, num_classes=v, client_test_fraction=0.0,
                              task="next_char", transform=token_ids if stored == "uint8" else None)


def test_text_means_are_mean_one_hot_and_mix_as_mean_embeddings():
    from fedhpc.exchanges.mean_data import MeanDataOptions, exchange_means

    class OneRank:
        rank, size = 0, 1

        def all_gather(self, t):
            return [t]

    data = text_data()
    md = exchange_means(data, OneRank(), MeanDataOptions(), seed=0, refresh=0)
    assert md.x.shape == (3, 6, 7) and md.y.shape == (3, 6, 7)
    torch.manual_seed(0)
    model = TinyCharLSTM().double()
    space = MixSpace("next_char", 7)
    space.check(model, "'tiny'")
    for cid in range(3):
        c = data.client(cid)
        freq = torch.stack([torch.bincount(c.x[:, p], minlength=7) for p in range(6)]).double() / c.num_train
        assert torch.allclose(md.x[cid].double(), freq, atol=1e-7)
        mean_emb = model.embed(c.x).mean(0)                     # what FedMix wants to mix with
        assert torch.allclose(space.lift_means(model, md.x[cid:cid + 1].double())[0], mean_emb, atol=1e-6)
    # FedMix in embedding space: l3 moves every parameter, the embedding table included.
    c = data.client(0)
    xin = space.lift(model, c.x)
    total = fedmix_loss(space.f(model), xin, space.labels(c.y, torch.float64),
                        space.lift_means(model, md.x[1:2].double()), md.y[1:2].double(), 0.1)
    grads = torch.autograd.grad(total, list(model.parameters()))
    assert all(float(g.abs().sum()) > 0 for g in grads)
    with pytest.raises(ConfigError, match=r"embed\(\) .*the run's model 'cnn' has not: pass --model lstm_char"):
        MixSpace("next_char", 7).check(nn.Linear(3, 3), "'cnn'")  # no embedding to mix in


def test_fedmix_runs_the_lstm_forward_without_cudnn_on_cuda_and_unchanged_on_cpu(monkeypatch):
    """cuDNN's RNN kernels have no double backward, and l3's backward is differentiated again:
    on CUDA the LSTM's forward inside fedmix_loss must run with cuDNN off. No GPU here, so the
    helper's device check is made to answer "CUDA" (monkeypatch): the LSTM layers then see cuDNN
    off during the forward (on again after), and the loss and its weight-gradients are bit for bit
    those of the plain CPU run, which equal Eq. 5 written out below (no fused ops, no helper).
    The CUDA kernels themselves are not run by this test."""
    import torch.nn.functional as F

    import fedhpc.models.double_backward as db
    from fedhpc.models import build_model

    torch.manual_seed(0)
    model = build_model("lstm_char", (6,), 7, {"hidden": 8, "embed_dim": 4}).double()
    space, lam = MixSpace("next_char", 7), 0.1
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(7, (5, 6), generator=g), torch.randint(7, (5, 6), generator=g)
    pbar = torch.softmax(torch.randn(1, 6, 7, generator=g, dtype=torch.float64), -1)  # mean one-hot chars
    ybar = torch.softmax(torch.randn(1, 6, 7, generator=g, dtype=torch.float64), -1)
    seen = []
    for layer in model.lstm:
        layer.register_forward_pre_hook(lambda mod, inp: seen.append(torch.backends.cudnn.enabled))
    params = list(model.parameters())

    def run():
        seen.clear()
        total = fedmix_loss(space.f(model), space.lift(model, ids), space.labels(y, torch.float64),
                            space.lift_means(model, pbar), ybar, lam)
        return total.detach(), torch.autograd.grad(total, params), list(seen)

    def eq5():
        emb = model.embed(ids)
        xbar = pbar @ model.embed(torch.arange(7)[None])[0]
        xp = (1 - lam) * emb
        logp = F.log_softmax(model.forward_embedded(xp), -1)
        yo = F.one_hot(y, 7).double()
        ce = -(yo * logp).sum(-1).mean()
        (dx,) = torch.autograd.grad(ce, xp, create_graph=True)
        total = (1 - lam) * ce + lam * -(ybar * logp).sum(-1).mean() + lam * (dx * xbar).sum()
        return total.detach(), torch.autograd.grad(total, params)

    cpu_total, cpu_grads, cpu_seen = run()
    monkeypatch.setattr(db, "_on_cuda", lambda device: True)
    cuda_total, cuda_grads, cuda_seen = run()
    monkeypatch.undo()
    assert cpu_seen == [True, True] and cuda_seen == [False, False]
    assert torch.backends.cudnn.enabled is True
    assert torch.equal(cpu_total, cuda_total) and all(torch.equal(a, b) for a, b in zip(cpu_grads, cuda_grads))
    ref_total, ref_grads = eq5()
    assert torch.allclose(cpu_total, ref_total, rtol=1e-12, atol=0)
    for a, b in zip(cpu_grads, ref_grads):
        assert float(b.abs().max()) > 0 and torch.allclose(a, b, rtol=1e-9, atol=1e-14)
    # a model without an RNN keeps cuDNN (its convolutions need no help)
    net, seen_net = smooth_net(), []
    net.register_forward_pre_hook(lambda mod, inp: seen_net.append(torch.backends.cudnn.enabled))
    x, yy, xs, _ = batch()
    monkeypatch.setattr(db, "_on_cuda", lambda device: True)
    fedmix_loss(net, x, yy, xs[:1], yy[:1], lam)
    assert seen_net == [True]


# --------------------------------------------------------------------------- engine runs

def make_engine(algo, rounds=2, partition="classes:2", **algo_options):
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    from fedhpc.config import RunConfig, build_options
    from fedhpc.engine import Engine
    from fedhpc.world import World

    load_algorithm_modules()
    cfg = RunConfig(algo=algo, dataset="digits", num_clients=8, clients_per_round=3, rounds=rounds,
                    partition=partition, model="mlp", lr=0.1, quiet=True, tensorboard=False,
                    threads=1, seed=1, algo_options=algo_options)
    cfg.validate()
    opts = build_options(ALGORITHMS.get(algo).Options, algo_options, algo)
    world = World("cpu", threads=1)
    return Engine(cfg, opts, None, world)


def test_ledger_counts_mean_data_and_raw_samples():
    eng = make_engine("fedmix")
    entry = (64 + 10) * 4  # float32 input mean + label mean
    n = eng.data.num_clients
    m1, m2 = eng.run_round(0), eng.run_round(1)
    assert m1["bytes_up_mean_data"] == n * entry and m2["bytes_up_mean_data"] == 0  # sent once
    # received once: in round 2 only the clients not sampled in round 1 download the means
    from fedhpc.engine import sample_clients
    first, second = sample_clients(1, 0, n, 3), sample_clients(1, 1, n, 3)
    new = [c for c in second if c not in first]
    assert 0 < len(new) < 3  # this seed covers both: a client that downloads again and one that does not
    assert m1["bytes_down_mean_data"] == 3 * (n - 1) * entry
    assert m2["bytes_down_mean_data"] == len(new) * (n - 1) * entry
    assert m1["bytes_up_parameters"] == 3 * eng.flat.numel * 4

    with pytest.warns(UserWarning, match="VIOLATES PRIVACY"):
        eng = make_engine("globalmix")
    sizes = eng.data.client_sizes()
    per_sample = 64 * 4 + 8  # float32 pixels as stored + an int64 label
    m1, m2 = eng.run_round(0), eng.run_round(1)
    assert m1["bytes_up_raw_samples"] == int(sizes.sum()) * per_sample and m2["bytes_up_raw_samples"] == 0
    from fedhpc.engine import sample_clients
    # the pool is received once per client, the first round it is sampled, as the means are
    assert m1["bytes_down_raw_samples"] == sum(int(sizes.sum() - sizes[c]) for c in first) * per_sample
    assert m2["bytes_down_raw_samples"] == sum(int(sizes.sum() - sizes[c]) for c in new) * per_sample > 0


def run_audited(algo, mk, **algo_options):
    """Run 2 rounds; capture every tensor a client hands over: its uploads and its collective rows."""
    from fedhpc.exchanges.traffic_audit import audit_traffic

    eng = make_engine(algo, **algo_options)
    gathered, uploads = [], []
    world_gather, algo_upload = eng.world.all_gather, eng.algo.upload

    def spy_gather(t):
        gathered.append(t.detach().clone())
        return world_gather(t)

    def spy_upload(model, ctx):
        out = algo_upload(model, ctx)
        uploads.extend((k, v.detach().clone()) for k, v in out.items())
        return out

    eng.world.all_gather, eng.algo.upload = spy_gather, spy_upload
    with audit_traffic() as audit:
        eng.run()
    return eng, gathered, uploads, audit.records


def audit_violations(eng, gathered, uploads, records, mk):
    """Everything a client sends must be a parameter tensor or an average of >= M_k of its samples."""
    bad = []
    for name, t in uploads:
        if name != "params" or t.numel() != eng.flat.numel:
            bad.append(f"upload {name} of {t.numel()} values is not the parameter vector")
    by_row = {}
    for rec in records:
        by_row.setdefault(rec.row.double().numpy().tobytes(), rec)
    dx = 64
    for t in gathered:
        for row in t.reshape(t.shape[0], -1):
            rec = by_row.get(row.double().cpu().numpy().tobytes())
            if rec is None:
                bad.append("a collective row with no record of its origin")
                continue
            if len(rec.sources) < mk:
                bad.append(f"client {rec.cid} sent {rec.kind} built from {len(rec.sources)} sample(s) < M_k={mk}")
                continue
            c = eng.data.client(rec.cid)
            recomputed = eng.data.transform(c.x[torch.as_tensor(rec.sources)], False, None).double().mean(0)
            if not torch.allclose(row[:dx].double(), recomputed.flatten(), atol=1e-6):
                bad.append(f"client {rec.cid}: row is not the mean of its recorded samples")
    return bad


def test_privacy_audit_fedmix_passes_and_globalmix_fails():
    mk = 5
    eng, gathered, uploads, records = run_audited("fedmix", mk, mean_batch=mk)
    assert len(uploads) == 2 * 3 and len(gathered) >= 1
    n_rows = sum(t.shape[0] for t in gathered)
    assert n_rows == sum(int(n) // mk for n in eng.data.client_sizes())  # every mean was inspected
    assert audit_violations(eng, gathered, uploads, records, mk) == []

    with pytest.warns(UserWarning, match="VIOLATES PRIVACY"):
        eng, gathered, uploads, records = run_audited("globalmix", mk)
    bad = audit_violations(eng, gathered, uploads, records, mk)
    assert bad and all("raw_samples built from 1 sample(s)" in b for b in bad)
    assert len(bad) == 2 * int(eng.data.client_sizes().sum())  # every input row and label row


def test_fedmix_and_naivemix_train_on_digits():
    """End to end: both improve on the untrained model within a few rounds (per-sample selection too)."""
    for algo, extra in (("fedmix", {"lam": 0.1, "select": "sample"}), ("naivemix", {"prox_mu": 0.01})):
        eng = make_engine(algo, rounds=6, partition="iid", **extra)
        before = eng.evaluate()["test_accuracy"]
        after = eng.run()["test_accuracy"]
        assert after > before + 0.15, (algo, before, after)


@pytest.mark.parametrize("stored", ["int64", "uint8"])
@pytest.mark.parametrize("algo", ["fedmix", "naivemix", "localmix", "globalmix"])
def test_algorithms_train_lstm_char_on_text_in_embedding_space(algo, stored, recwarn):
    """The hooks end to end on next-character data with the registry's lstm_char; uint8 ids, as
    Shakespeare stores them, reach the embedding through the dataset's transform (GlobalMix's
    partners from the shared pool skipped it and crashed the embedding)."""
    from fedhpc.algorithms import ALGORITHMS, ClientContext, RoundInfo, load_algorithm_modules
    from fedhpc.config import RunConfig, build_options
    from fedhpc.flat import FlatModel
    from fedhpc.models import build_model

    class OneRank:
        rank, size = 0, 1

        def all_gather(self, t):
            return [t]

    load_algorithm_modules()
    data = text_data(stored=stored)
    torch.manual_seed(0)
    model = build_model("lstm_char", (6,), 7, {"hidden": 16, "embed_dim": 4})
    flat = FlatModel(model)
    cfg = RunConfig(algo=algo, batch_size=4, local_epochs=1, lr=0.5)
    cls = ALGORITHMS.get(algo)
    opts = build_options(cls.Options, {"lam": 0.2}, algo)
    a = cls(cfg, opts, model, flat, data, OneRank(), None)
    a.global_state = flat.flat.detach().clone()
    a.setup()
    rnd = RoundInfo(0, [0, 2], [0, 2], 0.5)
    a.ledger.reset()  # the engine's order: reset, then round_begin
    a.round_begin(rnd)
    ctx = ClientContext(a, 0, data.client(0), rnd)
    a.download(ctx)
    a.local_update(model, ctx)
    assert math.isfinite(float(ctx.loss_sum)) and ctx.samples == data.client(0).num_train
    assert float((flat.flat - a.global_state).abs().max()) > 1e-4
    if algo in ("fedmix", "naivemix"):  # 2 external entries of (T, V) input and label means, float32
        metrics = a.ledger.as_metrics(a.ledger.values)
        assert metrics["bytes_down_mean_data"] == 2 * 2 * 6 * 7 * 4
        assert metrics["bytes_up_mean_data"] == 3 * 2 * 6 * 7 * 4  # booked once, by rank 0, in round_begin


def full_and_resumed_rows(tmp_path, algo, extra=()):
    """metrics.jsonl rows of an 8-client, 5-round run of ``algo`` ("full") and of the same run
    interrupted after round 2 and resumed from its checkpoint ("cut"); and its argv."""
    import json
    import os

    from standard_runner import run_case

    from fedhpc.engine import Preempted
    from fedhpc.world import World

    argv = ["--algo", algo, "--dataset", "digits", "--num-clients", "8", "--clients-per-round", "3",
            "--rounds", "5", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--model", "mlp",
            "--partition", "iid", "--seed", "1", "--threads", "1", "--quiet", "--no-tensorboard",
            "--checkpoint-every", "1", *extra]
    run_case(argv + ["--out", str(tmp_path / "full")], World(threads=1))
    out = str(tmp_path / "cut")
    with pytest.raises(Preempted):
        run_case(argv + ["--out", out], World(threads=1), interrupt_after=2)
    run_case(argv + ["--out", out, "--resume"], World(threads=1))
    rows = {d: [json.loads(line) for line in open(os.path.join(tmp_path, d, "metrics.jsonl"))]
            for d in ("full", "cut")}
    return rows, argv


@pytest.mark.parametrize("refresh", ["once", "every_round"])
def test_mean_download_is_booked_once_per_refresh_and_survives_a_resume(tmp_path, refresh):
    """Round by round, bytes_down_mean_data is the brute-force count of clients sampled for the first
    time since the last refresh times their n-1 external means; a run interrupted after round 2 and
    resumed from its checkpoint books the same rounds and the same cumulative total."""
    from fedhpc.engine import sample_clients

    n, k, rounds, seed = 8, 3, 5, 1
    rows, _ = full_and_resumed_rows(tmp_path, "naivemix", ["--mean-refresh", refresh])
    entry = (64 + 10) * 4  # one float32 mean per client: 64 pixels and 10 label entries
    assert rows["full"][0]["bytes_up_mean_data"] == n * entry
    expect, have = [], set()
    for t in range(rounds):
        if refresh == "every_round":
            have = set()
        fresh = [c for c in sample_clients(seed, t, n, k) if c not in have]
        have.update(fresh)
        expect.append(len(fresh) * (n - 1) * entry)
    if refresh == "once":
        assert len(set(expect)) > 2  # rounds with all, some and (here) no new clients
    for d in ("full", "cut"):
        assert [r["bytes_down_mean_data"] for r in rows[d]] == expect, d
    assert rows["full"][-1]["bytes_down_total"] == rows["cut"][-1]["bytes_down_total"]


def test_globalmix_pool_download_is_booked_once_per_client_and_survives_a_resume(tmp_path):
    """The raw pool is received the first round a client is sampled; which clients hold it is
    checkpointed, so a run interrupted after round 2 books what the uninterrupted run books."""
    from fedhpc.engine import sample_clients

    n, k, rounds, seed = 8, 3, 5, 1
    with pytest.warns(UserWarning, match="VIOLATES PRIVACY"):
        rows, argv = full_and_resumed_rows(tmp_path, "globalmix")
    from fedhpc.config import parse_args
    from fedhpc.data import build_dataset

    cfg, _, do = parse_args(argv)
    sizes = build_dataset(cfg, do).client_sizes()
    per_sample = 64 * 4 + 8  # float32 pixels as stored + an int64 label
    assert rows["full"][0]["bytes_up_raw_samples"] == int(sizes.sum()) * per_sample
    expect, have = [], set()
    for t in range(rounds):
        fresh = [c for c in sample_clients(seed, t, n, k) if c not in have]
        have.update(fresh)
        expect.append(sum(int(sizes.sum() - sizes[c]) for c in fresh) * per_sample)  # the others' samples
    assert len(set(expect)) > 2 and 0 in expect
    for d in ("full", "cut"):
        assert [r["bytes_down_raw_samples"] for r in rows[d]] == expect, d


def test_fedmix_two_mpi_ranks_match_one_process(tmp_path):
    """The whole run (mean exchange, selection, ledger) does not depend on the number of ranks."""
    import json
    import os

    from conftest import FAST, final_weights, launch, max_diff, mpiexec
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    args = FAST + ["--algo", "fedmix", "--partition", "classes:2", "--model", "cnn", "--mean-batch", "6",
                   "--lam", "0.1", "--select", "sample"]
    outs = {}
    for ranks in (1, 2):
        out = str(tmp_path / f"r{ranks}")
        proc = launch(args + ["--out", out], ranks=ranks)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[ranks] = out
    assert max_diff(final_weights(outs[1]), final_weights(outs[2])) < 1e-5
    rows = {r: [json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))] for r, o in outs.items()}
    for a, b in zip(rows[1], rows[2]):
        for k in ("bytes_up_mean_data", "bytes_down_mean_data", "bytes_up_parameters"):
            assert a[k] == b[k], k
    assert rows[1][0]["bytes_up_mean_data"] > 0 and rows[1][1]["bytes_up_mean_data"] == 0


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_fedmix_with_a_batchnorm_model_warns_that_it_can_diverge(norm, recwarn, capsys):
    import warnings

    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    from fedhpc.config import RunConfig, build_options
    from fedhpc.engine import Engine
    from fedhpc.world import World

    load_algorithm_modules()
    cfg = RunConfig(algo="fedmix", dataset="digits", num_clients=4, clients_per_round=2, rounds=1,
                    model="cnn", model_options={"norm": norm, "width": 4}, quiet=True, tensorboard=False,
                    threads=1, algo_options={"lam": 0.5})
    cfg.validate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Engine(cfg, build_options(ALGORITHMS.get("fedmix").Options, {"lam": 0.5}, "fedmix"), None,
               World("cpu", threads=1))
    said = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    if norm == "batch":
        assert len(said) == 1 and "unbounded below" in said[0] and "--lam (now 0.5)" in said[0]
        assert "warning: FedMix with a BatchNorm model can diverge" in capsys.readouterr().err
    else:
        assert not said


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
def test_fedmix_on_an_lstm_on_a_real_gpu_equals_the_cpu_and_needs_cudnn_off():
    """On a GPU: FedMix's l3 differentiates the LSTM's backward again. With the helper the CUDA loss
    and weight-gradients equal the CPU's (float64); with cuDNN left on (the helper's device check
    made to answer "not CUDA") the second backward fails, which is why the helper exists."""
    import fedhpc.models.double_backward as db
    from fedhpc.models import build_model

    torch.manual_seed(0)
    model = build_model("lstm_char", (6,), 7, {"hidden": 16, "embed_dim": 8}).double()
    space, lam = MixSpace("next_char", 7), 0.1
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(7, (9, 6), generator=g), torch.randint(7, (9, 6), generator=g)
    pbar = torch.softmax(torch.randn(1, 6, 7, generator=g, dtype=torch.float64), -1)
    ybar = torch.softmax(torch.randn(1, 6, 7, generator=g, dtype=torch.float64), -1)

    def run(device):
        m = model.to(device)
        total = fedmix_loss(space.f(m), space.lift(m, ids.to(device)), space.labels(y.to(device), torch.float64),
                            space.lift_means(m, pbar.to(device)), ybar.to(device), lam)
        return total.detach().cpu(), [gr.cpu() for gr in torch.autograd.grad(total, list(m.parameters()))]

    before = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = True
    try:
        cpu_total, cpu_grads = run("cpu")
        gpu_total, gpu_grads = run("cuda")
        assert torch.allclose(gpu_total, cpu_total, rtol=1e-10, atol=0)
        for a, b in zip(gpu_grads, cpu_grads):
            assert float(b.abs().max()) > 0 and torch.allclose(a, b, rtol=1e-8, atol=1e-12)
        assert torch.backends.cudnn.enabled is True
        orig = db._on_cuda
        db._on_cuda = lambda device: False
        try:
            with pytest.raises((RuntimeError, NotImplementedError)):
                run("cuda")
        finally:
            db._on_cuda = orig
    finally:
        torch.backends.cudnn.enabled = before
        model.cpu()


# --------------------------------------------------------------------------- FedMix's loss is not NaiveMix's

def hand_mafl_losses(net, x, y, xbar, ybar, lam):
    """Eq. 1 (NaiveMix) and Eq. 5 (FedMix) written out on a float64 model, sample by sample:
    NaiveMix  mean_i [(1-l) CE(f((1-l) x_i + l xbar), y_i) + l CE(same, ybar)];
    FedMix    mean_i [(1-l) CE(f(x'_i), y_i) + l CE(f(x'_i), ybar) + l <dCE(f(x'_i), y_i)/dx'_i, xbar>],
    x'_i = (1-l) x_i, the input gradient kept in the graph (l3 trains through it)."""
    naive, fed = 0.0, 0.0
    for i in range(x.shape[0]):
        xm = (1 - lam) * x[i:i + 1] + lam * xbar
        logp = torch.log_softmax(net(xm), -1)[0]
        naive = naive + (1 - lam) * -(y[i] * logp).sum() + lam * -(ybar[0] * logp).sum()
        xp = ((1 - lam) * x[i:i + 1]).requires_grad_(True)
        logp = torch.log_softmax(net(xp), -1)[0]
        ce = -(y[i] * logp).sum()
        (dx,) = torch.autograd.grad(ce, xp, create_graph=True)
        fed = fed + (1 - lam) * ce + lam * -(ybar[0] * logp).sum() + lam * (dx * xbar).sum()
    return naive / x.shape[0], fed / x.shape[0]


@pytest.mark.parametrize("algo", ["fedmix", "naivemix"])
def test_each_mafl_algorithm_trains_on_its_own_loss_and_not_the_others(algo):
    """FedMix's and NaiveMix's loss hooks as a client's round calls them (the mean exchange, the
    download, the drawn entry, algo.loss): the value and the weight-gradient equal the algorithm's
    own equation (Eq. 5 for fedmix, Eq. 1 for naivemix) written out above, and lie far from the
    other one's. The drawn entry is recomputed here: derive_seed(seed, "mean_select", round, cid)
    picks among the other clients' mean inputs / mean one-hot labels, in client order. The model
    has trained a round, so its outputs are not the uniform start's, where both losses are ln 10."""
    import copy

    from fedhpc.algorithms.base import ClientContext, RoundInfo, derive_seed

    lam, cid = 0.4, 1
    eng = make_engine(algo, lam=lam)
    eng.run_round(0)
    method = eng.algo
    rnd = RoundInfo(1, [cid], [cid], eng.cfg.lr)
    method.round_begin(rnd)
    c = eng.data.client(cid)
    ctx = ClientContext(method, cid, c, rnd)
    method.download(ctx)
    x, y = c.x[:12], c.y[:12]
    params = list(eng.model.parameters())
    loss = method.loss(eng.model, x, y, ctx)
    got_grads = torch.autograd.grad(loss, params)

    others = [k for k in range(eng.data.num_clients) if k != cid]
    g = torch.Generator().manual_seed(derive_seed(eng.cfg.seed, "mean_select", 1, cid))
    k = others[int(torch.randint(len(others), (1,), generator=g))]
    ck = eng.data.client(k)
    xbar, ybar = ck.x.double().mean(0, keepdim=True), one_hot(ck.y, 10, torch.float64).mean(0, keepdim=True)
    net = copy.deepcopy(eng.model).double()
    naive, fed = hand_mafl_losses(net, x.double(), one_hot(y, 10, torch.float64), xbar, ybar, lam)
    own, other = (fed, naive) if algo == "fedmix" else (naive, fed)
    tol = 1e-6 * abs(float(own))  # float32 rounding
    assert abs(float(loss) - float(own)) <= tol, (algo, float(loss), float(own), float(other))
    assert abs(float(other) - float(own)) > 100 * tol, "the two losses are too close to tell apart here"
    own_grads = torch.autograd.grad(own, list(net.parameters()))
    other_grads = torch.autograd.grad(other, list(net.parameters()))
    scale = max(float(gr.abs().max()) for gr in own_grads)
    gdiff = max(float((a.double() - b).abs().max()) for a, b in zip(got_grads, own_grads))
    odiff = max(float((a - b).abs().max()) for a, b in zip(other_grads, own_grads))
    assert gdiff <= 1e-4 * scale, (algo, gdiff, scale)
    assert odiff > 100 * 1e-4 * scale, "the two gradients are too close to tell apart here"
