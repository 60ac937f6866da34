"""Several clients trained at once (fedhpc.batched) equal the sequential path, client by client.

The sequential path (``Algorithm.local_update`` one client after another, what
``Engine.run_round`` runs) is the reference: every batchable algorithm, on clients of
unequal sizes (different step counts, short last batches), with SGD momentum and weight
decay, must give each client the same trained weights and training loss within float32
rounding. The pieces are checked on their own too: the stacked optimizer against
``torch.optim.SGD`` row by row, a masked-out step, padding, and the batched FedMix loss
against :func:`fedhpc.algorithms.mixing.fedmix_loss` on each client's unpadded batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhpc.algorithms import ALGORITHMS, ClientContext, RoundInfo, load_algorithm_modules
from fedhpc.algorithms.base import derive_seed, seed_torch
from fedhpc.algorithms.fedavg import FedAvg
from fedhpc.algorithms.mixing import batched_fedmix_loss, fedmix_loss, one_hot
from fedhpc.batched import (StackedAdam, StackedSGD, check_batchable, epoch_batches, train_in_groups,
                            weighted_task_loss)
from fedhpc.config import RunConfig, build_options
from fedhpc.engine import Engine, sample_clients
from fedhpc.errors import ConfigError
from fedhpc.world import World

TOL = 1e-5  # float32: the batched kernels sum in another order than the sequential ones

#: clients of unequal sizes (Dirichlet 0.5), 2 epochs, momentum + weight decay, 6 clients in
#: groups of 4 and 2, batch 16 (most clients end an epoch on a short batch)
BASE = dict(num_clients=8, clients_per_round=6, partition="dirichlet:0.5", batch_size=16, momentum=0.9,
            weight_decay=1e-3, local_epochs=2, lr=0.05, seed=3, model="mlp", model_options={"hidden": 32})
ALGO_OPTIONS = {
    "fedavg": {},
    "fedprox": {"mu": 0.5},
    "naivemix": {"lam": 0.2, "prox_mu": 0.1},
    "fedmix": {"lam": 0.2},
    "localmix": {"mix_alpha": 0.5, "prox_mu": 0.1},
}


def make_engine(algo="fedavg", algo_options=None, perturb=None, **kw):
    """``perturb=s``: the initial model moved by a few ulps (relative 1e-6 to 4e-6 by s % 4, seeded
    by s), for :func:`assert_close_or_discrete`'s envelope."""
    cfg = RunConfig(**{"quiet": True, "tensorboard": False, "algo": algo, **BASE, **kw})
    cfg.validate()
    load_algorithm_modules()
    opts = build_options(ALGORITHMS.get(algo).Options, algo_options or {}, algo)
    eng = Engine(cfg, opts, None, World(threads=1))
    if perturb is not None:
        g = torch.Generator().manual_seed(perturb)
        eng.global_state.mul_(1 + 1e-6 * (1 + perturb % 4) * torch.randn(eng.global_state.shape, generator=g,
                                                                         dtype=torch.float64)
                              .to(eng.global_state.dtype))
    return eng


#: perturbed sequential runs that make a client's envelope (see assert_close_or_discrete): a run
#: reaches a given discrete event about one time in two to six (measured under avx2 and default)
ENVELOPE_RUNS = 8


def assert_close_or_discrete(diff, tol, envelope, what):
    """``diff`` (batched vs sequential) within ``tol``, or else no farther than the sequential path
    itself lands when its initial model moves by a few ulps (``envelope()``: those distances, one
    per perturbed run; computed only when needed).

    Why the second branch: with BatchNorm (and dropout) a pre-activation within rounding of 0
    (ReLU) or a max-pool tie decides a gradient by its last bit, so another CPU's kernels (another
    summation order: ``ATEN_CPU_CAPABILITY=default`` or ``avx2`` here) can move a client by 1e-3 to
    1e-2 where the native kernels agree to 1e-7; the sequential path alone, perturbed by 1e-6, jumps
    by the same amounts (measured: mixup's client 7 of test_mixup_without_mixing_and_in_groups_that_do_
    not_divide, 2.8e-3 both ways, under default). A real difference of the batched path (a wrong
    mask, statistic or term) moves the client where no perturbed sequential run goes: the envelope
    must show that the sequential path itself does not hold ``tol`` (its largest distance above it)
    and the batched run must land within twice that."""
    if diff <= tol:
        return
    env = max(envelope())
    assert env > tol and diff <= 2 * env, (
        f"{what}: batched differs from sequential by {diff:.2e} (> {tol:.1e}), and sequential runs perturbed "
        f"by a few ulps moved it by at most {env:.2e}: not a rounding event")


def round_info(eng, t):
    cfg = eng.cfg
    sampled = sample_clients(cfg.seed, t, eng.data.num_clients, cfg.clients_per_round)
    rnd = RoundInfo(t, sampled, sampled, cfg.lr * cfg.lr_decay ** t)
    eng.algo.global_state = eng.global_state
    eng.algo.ledger.reset()
    eng.algo.round_begin(rnd)
    eng.model.train()
    return rnd


def sequential_clients(eng, t):
    """cid -> (trained flat state, loss sum, samples), the engine's loop body one client at a time."""
    cfg, algo, rnd = eng.cfg, eng.algo, round_info(eng, t)
    out = {}
    for cid in rnd.my_clients:
        seed_torch(derive_seed(cfg.seed, "client", t, cid), eng.world.device)
        eng.flat.load_(eng.global_state)
        ctx = ClientContext(algo, cid, eng.data.client(cid).training_on(eng.world.device), rnd)  # on the GPU where there is one
        algo.download(ctx)
        algo.local_update(eng.model, ctx)
        out[cid] = (eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples)
    return out


def batched_clients(eng, t, k):
    check_batchable(eng.algo, eng.model, eng.cfg)
    rnd = round_info(eng, t)
    return {cid: (eng.flat.flat.clone(), float(ctx.loss_sum), ctx.samples)
            for cid, ctx, _, _ in train_in_groups(eng, rnd, rnd.my_clients, k)}


class Round0Envelope:
    """Round 0's clients (cid -> (state, ...), as sequential_clients gives them) of sequential runs
    ``rerun(s)`` from initial models perturbed by seed s, made on first use: ``self(cid, i)`` gives
    the distances of entry ``i`` of client ``cid`` from ``seq``'s (see assert_close_or_discrete)."""

    def __init__(self, seq, rerun):
        self.seq, self.rerun, self.runs = seq, rerun, []

    def __call__(self, cid, i=0):
        def distances():
            while len(self.runs) < ENVELOPE_RUNS:
                self.runs.append(self.rerun(len(self.runs)))
            return [_distance(r[cid][i], self.seq[cid][i]) for r in self.runs]
        return distances


def assert_same_clients(seq, bat, start, rerun=None):
    """``rerun(s)``: the sequential clients from an initial model perturbed by seed s, for the
    envelope of a client that lands beyond TOL (assert_close_or_discrete); None: TOL alone."""
    assert list(seq) == list(bat), "clients must come back in the sequential order"
    envelope = Round0Envelope(seq, rerun) if rerun is not None else (lambda cid: (lambda: [0.0]))
    for cid in seq:
        diff = float((seq[cid][0] - bat[cid][0]).abs().max())
        assert_close_or_discrete(diff, TOL, envelope(cid), f"client {cid}'s weights")
        assert seq[cid][2] == bat[cid][2]
        if diff <= TOL:  # after a discrete event the losses part too
            assert abs(seq[cid][1] - bat[cid][1]) <= TOL * max(1.0, abs(seq[cid][1]))
        # the check means something only if the client actually trained
        assert float((seq[cid][0] - start).abs().max()) > 1e-2


def _distance(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


class SequentialEnvelope:
    """Sequential runs of ``make(perturb=s)`` (an engine after its rounds, from an initial model
    moved by a few ulps), made on first use: how far the sequential path itself lands from ``seq``
    (see assert_close_or_discrete).

    Over several rounds an event in one client's training reaches the global model and, through
    it, every client's next round, and a perturbed run has its events elsewhere: so the envelope
    of any quantity is run-wide, the largest distance of the global model or of any client's own
    model (or of the quantity itself) over the perturbed runs."""

    def __init__(self, seq, make):
        self.seq, self.make, self.runs, self._wide = seq, make, [], None

    def _run_wide(self):
        if self._wide is None:
            while len(self.runs) < ENVELOPE_RUNS:
                self.runs.append(self.make(len(self.runs)))
            wide = []
            for r in self.runs:
                d = _distance(r.global_state, self.seq.global_state)
                for cid in range(self.seq.data.num_clients):
                    a, b = r.algo.client_model(cid), self.seq.algo.client_model(cid)
                    if a is not None and b is not None:
                        d = max(d, _distance(a, b))
                wide.append(d)
            self._wide = wide
        return self._wide

    def __call__(self, measure):
        """A function giving, per perturbed run, the larger of ``measure(engine)``'s distance from
        ``seq``'s (a tensor or a float) and the run-wide distance."""
        def distances():
            wide = self._run_wide()
            want = measure(self.seq)
            return [max(w, _distance(measure(r), want)) for w, r in zip(wide, self.runs)]
        return distances


def rounds_envelope(seq, algo, options, rounds=3, **kw):
    """The SequentialEnvelope of ``run_rounds(1, algo, options, rounds, **kw)``'s engine ``seq``."""
    return SequentialEnvelope(seq, lambda s: run_rounds(1, algo, options, rounds=rounds, perturb=s, **kw)[0])


def assert_rounds_equal(seq, bat, m_seq, m_bat, envelope=None, tol=3 * TOL):
    """The global model and the round losses of a sequential and a batched run (``run_rounds``):
    within ``tol`` / TOL, or within ``envelope``'s (a SequentialEnvelope) discrete events."""
    env = envelope or (lambda measure: (lambda: [0.0]))
    diff = float((seq.global_state.double() - bat.global_state.double()).abs().max())
    assert_close_or_discrete(diff, tol, env(lambda e: e.global_state), "the global model")
    losses = [m["train_loss"] for m in m_bat]
    loss_diff = max(abs(a["train_loss"] - b) for a, b in zip(m_seq, losses))
    assert_close_or_discrete(loss_diff, TOL, env(lambda e: [m["train_loss"] for m in e.round_metrics]),
                             "the round losses")


def assert_own_models_equal(seq, bat, tol=3 * TOL, envelope=None) -> int:
    """Every client's own model (``client_model``: personal state, an FD device's model, a kept
    model) in the sequential and the batched engine within ``tol``, or within ``envelope``'s (a
    SequentialEnvelope) discrete events; returns how many clients had one."""
    own = 0
    for cid in range(seq.data.num_clients):
        a, b = seq.algo.client_model(cid), bat.algo.client_model(cid)
        assert (a is None) == (b is None), cid
        if a is not None:
            own += 1
            diff = float((a.double() - b.double()).abs().max())
            if envelope is None:
                assert diff <= tol, f"client {cid}: its own model differs by {diff:.2e}"
            else:
                assert_close_or_discrete(diff, tol, envelope(lambda e, c=cid: e.algo.client_model(c)),
                                         f"client {cid}'s own model")
    return own


def steps_per_epoch(eng, cids):
    bs = eng.cfg.batch_size
    return [-(-int(eng.data.client(c).num_train) // bs) for c in cids]


@pytest.mark.parametrize("algo", list(ALGO_OPTIONS))
def test_batched_clients_equal_sequential(algo):
    seq_eng = make_engine(algo, ALGO_OPTIONS[algo])
    start = seq_eng.global_state.clone()
    sampled = sample_clients(BASE["seed"], 0, BASE["num_clients"], BASE["clients_per_round"])
    steps = steps_per_epoch(seq_eng, sampled)
    sizes = [int(seq_eng.data.client(c).num_train) for c in sampled]
    assert len(set(steps)) > 1, "the check needs clients with different numbers of steps"
    assert any(n % BASE["batch_size"] for n in sizes), "the check needs short last batches"
    seq = sequential_clients(seq_eng, 0)
    bat = batched_clients(make_engine(algo, ALGO_OPTIONS[algo]), 0, 4)
    assert_same_clients(seq, bat, start)


@pytest.mark.parametrize("algo,options", [("fedmix", {"lam": 0.2, "select": "sample"}),
                                          ("naivemix", {"lam": 0.2, "select": "sample", "mean_batch": 20}),
                                          ("localmix", {"lam": 0.3}),
                                          ("naivemix", {"lam": 0.0, "prox_mu": 0.1})])
def test_batched_mixing_variants_equal_sequential(algo, options):
    """One mean entry per sample (padded rows draw nothing), mean batches, LocalMix's fixed lambda,
    NaiveMix with lambda 0 (plain CE + the proximal term)."""
    start = make_engine(algo, options).global_state.clone()
    seq = sequential_clients(make_engine(algo, options), 0)
    bat = batched_clients(make_engine(algo, options), 0, 3)
    assert_same_clients(seq, bat, start)


class _NoMeans:
    """A client that received no mean entry (nothing external to mix with)."""

    def __len__(self):
        return 0

    def take(self, index):
        raise AssertionError("a client without means must not draw")


def _without_means_for(eng, cid):
    download = eng.algo.download

    def patched(ctx):
        download(ctx)
        if ctx.cid == cid:
            ctx.extra["means"] = _NoMeans()
    eng.algo.download = patched
    return eng


def test_a_client_without_means_trains_on_plain_ce_in_its_group():
    """NaiveMix's fallback (no external entry: plain CE), for one client of a batched group."""
    cid = sample_clients(BASE["seed"], 0, BASE["num_clients"], BASE["clients_per_round"])[1]
    opts = {"lam": 0.2}
    start = make_engine("naivemix", opts).global_state.clone()
    seq = sequential_clients(_without_means_for(make_engine("naivemix", opts), cid), 0)
    bat = batched_clients(_without_means_for(make_engine("naivemix", opts), cid), 0, 4)
    assert_same_clients(seq, bat, start)


@pytest.mark.parametrize("k", [1, 5, 10])
def test_group_sizes_and_grad_clip(k):
    """Groups that do not divide the clients (6 in 5 + 1), one client per group, one group larger
    than the rank's clients; gradient clipping active (norm 0.5 clips most steps)."""
    kw = dict(grad_clip=0.5)
    start = make_engine("fedprox", {"mu": 0.1}, **kw).global_state.clone()
    seq = sequential_clients(make_engine("fedprox", {"mu": 0.1}, **kw), 0)
    bat = batched_clients(make_engine("fedprox", {"mu": 0.1}, **kw), 0, k)
    assert_same_clients(seq, bat, start)


class _MLPWithSpareHead(torch.nn.Module):
    """An MLP with a second head its forward never calls (an auxiliary head some losses would use):
    its parameters get no gradient."""

    def __init__(self, input_shape, num_classes, hidden=32):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), hidden),
                                        torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))
        self.spare_head = torch.nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_parameter_without_gradient_is_not_stepped(optimizer, monkeypatch):
    """torch's optimisers skip a parameter whose gradient is None: no weight decay, no momentum, no
    Adam moments, so it keeps its value. The stacked optimisers must do the same, not step it on a
    zero gradient (weight decay alone would shrink it)."""
    from fedhpc.models import MODELS, load_model_modules

    load_model_modules()
    monkeypatch.setitem(MODELS._entries, "mlp_spare_head",
                        lambda input_shape, num_classes, hidden=32: _MLPWithSpareHead(input_shape, num_classes, hidden))
    kw = dict(model="mlp_spare_head", model_options={}, optimizer=optimizer, weight_decay=0.05)
    if optimizer == "adam":
        kw.update(lr=0.01, momentum=0.0)
    eng = make_engine("fedavg", **kw)
    start = eng.global_state.clone()
    spare = [e for e in eng.flat.entries if e.name.startswith("spare_head.")]
    assert spare and all(e.is_param for e in spare)
    seq = sequential_clients(eng, 0)
    bat = batched_clients(make_engine("fedavg", **kw), 0, 4)
    assert_same_clients(seq, bat, start)
    for state, _, _ in bat.values():  # the spare head as it started, in every client
        for e in spare:
            assert torch.equal(state[e.offset:e.offset + e.numel], start[e.offset:e.offset + e.numel]), e.name


@pytest.mark.skipif("nesterov" not in RunConfig.__dataclass_fields__, reason="no --nesterov in this RunConfig")
def test_nesterov_equals_sequential():
    kw = dict(nesterov=True)
    start = make_engine("fedavg", **kw).global_state.clone()
    seq = sequential_clients(make_engine("fedavg", **kw), 0)
    bat = batched_clients(make_engine("fedavg", **kw), 0, 4)
    assert_same_clients(seq, bat, start)


def test_round_through_the_engine_equals_batched_uploads():
    """A whole round: Engine.run_round (sequential) against the same round's uploads from the
    batched path, weighted and aggregated as run_round does (FedAvg with server momentum)."""
    opts = {"server_momentum": 0.5}
    eng = make_engine("fedavg", opts)
    eng.run_round(0)
    other = make_engine("fedavg", opts)
    rnd = round_info(other, 0)
    algo = other.algo
    total = torch.zeros(other.flat.numel, dtype=torch.float64, device=other.world.device)
    weight = 0.0
    for cid, ctx, _, _ in train_in_groups(other, rnd, rnd.my_clients, 4):
        w = algo.client_weight(ctx)
        total.add_(algo.upload(other.model, ctx)["params"], alpha=w)
        weight += w
    new = algo.aggregate(other.global_state, {"params": total}, weight, rnd)
    diff = float((new.float() - eng.global_state).abs().max())
    assert diff <= TOL, diff
    assert float((eng.global_state - other.global_state).abs().max()) > 1e-2


# ----------------------------------------------------------------------------- the pieces

@pytest.mark.parametrize("nesterov", [False, True])
def test_stacked_sgd_equals_torch_sgd_row_by_row(nesterov):
    """K rows stepped at once == torch.optim.SGD (+ clip_grad_norm_) on each row alone, with
    masked-out steps leaving a row and its momentum exactly as they were."""
    torch.manual_seed(0)
    k, p, steps = 3, 7, 5
    theta0 = torch.randn(k, p)
    grads = torch.randn(steps, k, p) * 3
    active = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    lr, mom, wd, clip = 0.1, 0.9, 0.01, 2.0
    theta = theta0.clone()
    opt = StackedSGD(theta, p, lr, mom, wd, clip, nesterov)
    for s in range(steps):
        opt.step(theta, grads[s], None if bool(active[s].all()) else active[s])
    for i in range(k):
        w = torch.nn.Parameter(theta0[i].clone())
        ref = torch.optim.SGD([w], lr=lr, momentum=mom, weight_decay=wd, nesterov=nesterov)
        for s in range(steps):
            if not active[s, i]:
                continue
            w.grad = grads[s, i].clone()
            torch.nn.utils.clip_grad_norm_([w], clip)
            ref.step()
        assert torch.allclose(theta[i], w.detach(), atol=1e-6), i


@pytest.mark.parametrize("frozen", [False, True])
def test_stacked_adam_equals_torch_adam_row_by_row(frozen):
    """K rows stepped at once == torch.optim.Adam (+ clip_grad_norm_, L2 weight decay) on each row
    alone: a masked-out step leaves a row, its moments and its step count as they were (its bias
    corrections follow its own steps); frozen columns are a parameter left out of Adam's list."""
    torch.manual_seed(2)
    k, p, steps = 3, 7, 6
    theta0 = torch.randn(k, p)
    grads = torch.randn(steps, k, p) * 3
    active = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    lr, wd, clip = 0.01, 0.01, 2.0
    columns = torch.tensor([True, True, False, True, True, False, True]) if frozen else None
    theta = theta0.clone()
    opt = StackedAdam(theta, p, lr, wd, clip, columns)
    for s in range(steps):
        opt.step(theta, grads[s] * (1.0 if columns is None else columns), None if bool(active[s].all()) else active[s])
    for i in range(k):
        trained = torch.nn.Parameter(theta0[i][columns].clone() if frozen else theta0[i].clone())
        ref = torch.optim.Adam([trained], lr=lr, weight_decay=wd)
        for s in range(steps):
            if not active[s, i]:
                continue
            trained.grad = (grads[s, i][columns] if frozen else grads[s, i]).clone()
            torch.nn.utils.clip_grad_norm_([trained], clip)
            ref.step()
        want = theta0[i].clone()
        want[columns if frozen else slice(None)] = trained.detach()
        assert torch.allclose(theta[i], want, atol=1e-6), i
        if frozen:
            assert torch.equal(theta[i][~columns], theta0[i][~columns])


@pytest.mark.parametrize("algo,options", [("fedavg", {}), ("fedprox", {"mu": 0.5}), ("pmixfed", {})])
def test_adam_clients_equal_sequential(algo, options):
    """--optimizer adam (pMixFed's papers' settings): each client's weights and loss within rounding
    of the sequential path, clients of unequal sizes (masked-out steps), 2 epochs, weight decay."""
    kw = dict(optimizer="adam", momentum=0.0, lr=0.003)
    start = make_engine(algo, options, **kw).global_state.clone()
    seq = sequential_clients(make_engine(algo, options, **kw), 0)
    bat = batched_clients(make_engine(algo, options, **kw), 0, 4)
    assert_same_clients(seq, bat, start)


def test_masked_out_step_changes_nothing():
    torch.manual_seed(1)
    theta = torch.randn(2, 5)
    opt = StackedSGD(theta, 5, 0.1, 0.9, 0.1, 0.0)
    opt.step(theta, torch.randn(2, 5), None)  # both move, both have momentum
    row1, buf1 = theta[1].clone(), opt.buf[1].clone()
    opt.step(theta, torch.randn(2, 5), torch.tensor([True, False]))
    assert torch.equal(theta[1], row1) and torch.equal(opt.buf[1], buf1)
    assert not torch.equal(opt.buf[0], buf1)


def test_padding_is_the_mean_over_real_samples_only():
    """weighted_task_loss on a padded batch == F.cross_entropy on the real rows, and whatever the
    padded rows hold changes neither the loss nor its gradient."""
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 3, requires_grad=True)
    y = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]])
    weight = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0], [0.25] * 4])
    loss = weighted_task_loss(logits, y, weight)
    assert torch.allclose(loss[0], F.cross_entropy(logits[0, :3], y[0, :3]))
    assert torch.allclose(loss[1], F.cross_entropy(logits[1], y[1]))
    (g,) = torch.autograd.grad(loss.sum(), logits)
    garbage = logits.detach().clone()
    garbage[0, 3] = 1e4
    garbage.requires_grad_(True)
    loss2 = weighted_task_loss(garbage, y, weight)
    (g2,) = torch.autograd.grad(loss2.sum(), garbage)
    assert torch.equal(loss, loss2) and torch.equal(g[:, :3], g2[:, :3]) and float(g2[0, 3].abs().max()) == 0


@pytest.mark.parametrize("augments", [False, True])
def test_epoch_batches_are_each_clients_own_batches(augments, monkeypatch):
    """Batch by batch as ClientContext.batches yields them, padding 0: without augmentation from one
    gather of each client's epoch in permutation order, with it (random crops and flips drawn batch
    by batch) from the batches themselves."""
    eng = make_engine()
    if augments:
        from fedhpc.data.augment import ImageTransform
        monkeypatch.setattr(eng.data, "transform", ImageTransform(crop_padding=2, flip=True), raising=False)
        assert eng.algo.data.augments
    rnd = round_info(eng, 0)
    ctxs = [ClientContext(eng.algo, c, eng.data.client(c).training_on(eng.world.device), rnd) for c in rnd.my_clients[:3]]
    eb = epoch_batches(ctxs, 1, eng.cfg.batch_size)
    for i, ctx in enumerate(ctxs):
        own = list(ctx.batches(1))
        assert eb.real[i] == [len(b[1]) for b in own] + [0] * (eb.steps - len(own))
        for s in range(eb.steps):
            bx, by = own[s] if s < len(own) else (eb.x[i, s, :0], eb.y[i, s, :0])
            n = len(by)
            assert torch.equal(eb.x[i, s, :n], bx) and torch.equal(eb.y[i, s, :n], by)
            assert not eb.x[i, s, n:].any() and not eb.y[i, s, n:].any()  # padding rows hold 0
            if n:
                assert torch.allclose(eb.weight[i, s].sum(), torch.tensor(1.0))
            assert float(eb.weight[i, s, n:].sum()) == 0


def test_a_groups_rows_are_joined_without_a_copy_when_they_lie_in_one_tensor():
    """epoch_batches' _joined: the views ClientData.all_training_on leaves (one tensor split by client,
    an empty client among them) are read in place; separate tensors are concatenated."""
    from fedhpc.batched.epochs import _joined

    whole = torch.arange(24.0).view(12, 2)
    parts = list(whole.split([5, 0, 4, 3]))
    joined = _joined(parts)
    assert torch.equal(joined, whole) and joined.data_ptr() == whole.data_ptr()
    apart = [p.clone() for p in parts]
    copied = _joined(apart)
    assert torch.equal(copied, whole) and copied.data_ptr() != apart[0].data_ptr()
    shuffled = [parts[2], parts[0]]  # one storage, not in order: a copy, in the order given
    assert torch.equal(_joined(shuffled), torch.cat(shuffled))


def test_batched_fedmix_loss_equals_fedmix_loss_per_client():
    """Eq. 5 for K clients at once == fedmix_loss on each client's unpadded batch, value and
    weight gradient (the second-order l3 term included), clients of 5 and 3 real rows."""
    torch.manual_seed(3)
    k, b, d, c, lam = 2, 5, 6, 4, 0.3
    w1, w2 = torch.randn(k, d, 8, requires_grad=True), torch.randn(k, 8, c, requires_grad=True)

    def f_one(i, x):
        return torch.tanh(x @ w1[i]) @ w2[i]

    def forward(x):
        return torch.tanh(torch.bmm(x, w1)) @ w2

    x = torch.randn(k, b, d)
    y = one_hot(torch.randint(c, (k, b)), c)
    xbar, ybar = torch.randn(k, 1, d), torch.softmax(torch.randn(k, 1, c), -1)
    real = [5, 3]
    weight = torch.zeros(k, b)
    for i, n in enumerate(real):
        weight[i, :n] = 1.0 / n
    batched = batched_fedmix_loss(forward, x, y, xbar, ybar, lam, weight)
    gb = torch.autograd.grad(batched.sum(), (w1, w2))
    for i, n in enumerate(real):
        one = fedmix_loss(lambda z: f_one(i, z), x[i, :n], y[i, :n], xbar[i], ybar[i], lam)
        assert torch.allclose(batched[i], one, atol=1e-6)
        g1 = torch.autograd.grad(one, (w1, w2))
        assert torch.allclose(gb[0][i], g1[0][i], atol=1e-6) and torch.allclose(gb[1][i], g1[1][i], atol=1e-6)


# ----------------------------------------------------------------------------- who is refused

def _with_layer_norm(model, *layers):
    """The run's model followed by a LayerNorm (a layer the grouped kernels do not compute) and ``layers``."""
    return torch.nn.Sequential(model, torch.nn.LayerNorm(10), *layers)


@pytest.mark.parametrize("wrap,match", [
    (lambda m: _with_layer_norm(m, torch.nn.Dropout(0.3)), "dropout masks .* only in models whose layers"),
    (lambda m: _with_layer_norm(m, torch.nn.BatchNorm1d(10)), "BatchNorm statistics .* only in models"),
    (lambda m: torch.nn.Sequential(m, torch.nn.AlphaDropout(0.3)), "not AlphaDropout"),
])
def test_dropout_and_batchnorm_outside_the_grouped_kernels_are_refused(wrap, match):
    eng = make_engine()
    with pytest.raises(ConfigError, match=match):
        check_batchable(eng.algo, wrap(eng.model), eng.cfg)


@pytest.mark.parametrize("algo", ["standalone", "xormixfl", "mixfl"])
def test_refused_with_a_config_error(algo):
    """The one-shot methods: their devices do not train (the batched path has nothing to batch)."""
    from fedhpc.batched import method_refusal

    load_algorithm_modules()
    refusal = method_refusal(ALGORITHMS.get(algo), algo)
    assert refusal and "not declared batchable: one-shot" in refusal and "--clients-at-once 1" in refusal


def test_every_batchable_method_has_an_equality_test():
    """A method that opts in to the batched path carries a test of its clients against the sequential
    path (the issue's equality test): a test of tests/test_batched*.py whose name says it equals the
    sequential path ("equal(s)_sequential") and whose name or parameters name the method. A new
    method that declares ``batchable`` without one fails here, naming where to add it."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from fedhpc.batched import method_refusal

    load_algorithm_modules()
    batchable = {name for name in ALGORITHMS.names() if method_refusal(ALGORITHMS.get(name), name) is None}
    assert {"fedavg", "fedmix", "mix2fld"} <= batchable  # the check needs the registry it guards
    here = Path(__file__).parent
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *sorted(str(f) for f in here.glob("test_batched*.py"))],
                             capture_output=True, text=True, cwd=here.parent, timeout=300)
    assert listing.returncode == 0, listing.stdout[-2000:] + listing.stderr[-2000:]
    equality_ids = [line.split("::", 1)[1] for line in listing.stdout.splitlines()
                    if "::" in line and re.search(r"equals?_sequential", line)]
    assert len(equality_ids) > 20, listing.stdout[-2000:]

    def names(node_id: str) -> set:
        # longest names first, each taken out once found, so "lg_fedavg" is not also "fedavg"
        found, rest = set(), node_id
        for name in sorted(ALGORITHMS.names(), key=len, reverse=True):
            pattern = rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])"
            if re.search(pattern, rest):
                found.add(name)
                rest = re.sub(pattern, " ", rest)
        return found

    covered = set().union(*map(names, equality_ids))
    missing = sorted(batchable - covered)
    assert not missing, (f"batchable methods without a batched equality test: {missing}; add one to "
                         "tests/test_batched*.py (e.g. to MORE in test_batched_more.py)")


def test_the_advice_names_a_model_option_only_where_the_model_has_it():
    """A BatchNorm the grouped kernels cannot take (here: beside a LayerNorm): norm=none removes it
    from resnet_digits, but mobilenet has no such option, and advising it there would be refused next
    ('has no option norm'). Following the advice builds."""
    eng = make_engine("fedavg", None, model="resnet_digits", model_options={"width": 4})
    with pytest.raises(ConfigError, match=r"use --model-opt norm=none \(the model without BatchNorm\)"):
        check_batchable(eng.algo, _with_layer_norm(eng.model), eng.cfg)
    eng = make_engine("fedavg", None, model="resnet_digits", model_options={"width": 4, "norm": "none"})
    check_batchable(eng.algo, _with_layer_norm(eng.model), eng.cfg)
    eng = make_engine("fedavg", None, model="mobilenet", model_options={"width_multiplier": 0.25}, batch_size=18)
    with pytest.raises(ConfigError, match=r"use a model without BatchNorm \(the run's model 'mobilenet' always has "
                                          r"it; e.g. --model cnn\)"):
        check_batchable(eng.algo, _with_layer_norm(eng.model), eng.cfg)
    check_batchable(eng.algo, eng.model, eng.cfg)  # its own layers are all grouped: batched as it is


def test_next_character_prediction_is_refused():
    eng = make_engine()
    eng.algo.data.task = "next_char"  # per-position labels: what a text dataset declares
    with pytest.raises(ConfigError, match="classification tasks only"):
        check_batchable(eng.algo, eng.model, eng.cfg)


def test_a_subclass_changing_the_loss_is_not_batched_by_inheritance():
    eng = make_engine()

    class Reweighted(FedAvg):  # overrides loss, does not re-declare batchable
        def loss(self, model, x, y, ctx):
            return 2 * super().loss(model, x, y, ctx)

    eng.algo.__class__ = Reweighted
    with pytest.raises(ConfigError, match="Reweighted.loss"):
        check_batchable(eng.algo, eng.model, eng.cfg)


def test_cnn_without_dropout_or_batchnorm_is_batched_exactly():
    """(Dropout and BatchNorm: tests/test_batched_more.py.)"""
    kw = dict(model="cnn", model_options={"width": 4, "hidden": 16})
    start = make_engine("fedavg", **kw).global_state.clone()
    seq = sequential_clients(make_engine("fedavg", **kw), 0)
    bat = batched_clients(make_engine("fedavg", **kw), 0, 4)
    assert_same_clients(seq, bat, start)


# ----------------------------------------------------------------------------- through the engine
# These run once RunConfig has ``clients_at_once`` and Engine.run_round dispatches on it.

needs_engine_dispatch = pytest.mark.skipif("clients_at_once" not in RunConfig.__dataclass_fields__,
                                           reason="RunConfig has no clients_at_once yet (engine dispatch not applied)")


def run_rounds(k, algo, options, rounds=3, perturb=None, **kw):
    eng = make_engine(algo, options, clients_at_once=k, perturb=perturb, **kw)
    metrics = [eng.run_round(t) for t in range(rounds)]
    eng.round_metrics = metrics  # for SequentialEnvelope's measures
    return eng, metrics


@needs_engine_dispatch
@pytest.mark.parametrize("algo", ["fedavg", "fedmix"])
def test_engine_rounds_with_clients_at_once_equal_sequential(algo):
    seq, m_seq = run_rounds(1, algo, ALGO_OPTIONS[algo])
    bat, m_bat = run_rounds(4, algo, ALGO_OPTIONS[algo])
    diff = float((seq.global_state - bat.global_state).abs().max())
    assert diff <= 3 * TOL, diff  # three rounds: the rounding of each compounds a little
    for a, b in zip(m_seq, m_bat):
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]


@needs_engine_dispatch
def test_engine_with_a_channel_books_each_clients_own_payload():
    """With the channel model, each device's payload (its own download and upload) and the
    seeded outages are the sequential run's: the batched downloads all happen before the first
    upload, so the traffic a client is charged must not include the others' downloads. Devices
    that missed a downlink start the next round from the model they kept, in both paths."""
    kw = dict(channel="symmetric", channel_options={"distance_m": 1800, "t_max_s": 0.008, "num_channels": 12})
    seq, m_seq = run_rounds(1, "fedavg", {}, rounds=4, **kw)
    bat, m_bat = run_rounds(4, "fedavg", {}, rounds=4, **kw)
    for a, b in zip(m_seq, m_bat):
        for key in ("uplink_outages", "downlink_outages", "comm_seconds", "bytes_up", "bytes_down"):
            assert a[key] == b[key], key
    # the check means something only if both kinds of outage happened
    assert sum(m["uplink_outages"] for m in m_seq) > 0 and sum(m["downlink_outages"] for m in m_seq[:-1]) > 0
    assert float((seq.global_state - bat.global_state).abs().max()) <= 3 * TOL


@needs_engine_dispatch
def test_engine_refuses_a_run_it_cannot_batch_before_training():
    from fedhpc.config import parse_args

    cfg, algo_options, data_options = parse_args(["--algo", "xormixfl", "--clients-at-once", "4", "--quiet",
                                                  "--no-tensorboard", "--no-out"])
    with pytest.raises(ConfigError, match="not declared batchable: one-shot"):
        Engine(cfg, algo_options, data_options, World(threads=1))


# ----------------------------------------------------------------------------- grouped kernels vs vmap

class _BatchMeanNet(torch.nn.Module):
    """A forward that mixes samples (subtracts the batch mean): folding K clients into one batch
    would change it, so the grouped kernels must be refused for it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


def _stack(model, k):
    from fedhpc.batched import stacked_params
    from fedhpc.flat import FlatModel

    flat = FlatModel(model)
    theta = flat.flat.detach().repeat(k, 1) + 0.1 * torch.randn(k, flat.numel)
    return stacked_params(flat, theta)


def test_grouped_kernels_equal_vmap_for_linear_and_conv():
    from fedhpc.batched import grouped_forward, vmap_forward
    from fedhpc.models import build_model

    torch.manual_seed(4)
    for name, opts in (("mlp", {"hidden": 16}), ("cnn", {"width": 4, "hidden": 16})):
        model = build_model(name, (1, 8, 8), 10, opts)
        params = _stack(model, 3)
        x = torch.randn(3, 5, 1, 8, 8)
        grouped = grouped_forward(model, params)
        assert grouped is not None
        assert torch.allclose(grouped(x), vmap_forward(model, params)(x), atol=1e-5)
        # and each client's row is that client's own model, computed alone
        for i in range(3):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n][i])
            assert torch.allclose(grouped(x)[i], model(x[i]), atol=1e-5)


def test_a_forward_that_mixes_samples_falls_back_to_vmap():
    from fedhpc.batched import grouped_forward, stacked_forward, vmap_forward

    torch.manual_seed(5)
    model = _BatchMeanNet()
    params = _stack(model, 3)
    x = torch.randn(3, 4, 6)
    want = vmap_forward(model, params)(x)
    assert not torch.allclose(grouped_forward(model, params)(x), want, atol=1e-3)  # folding is wrong here
    assert torch.allclose(stacked_forward(model, params, x)(x), want, atol=1e-6)
    # a group of one client cannot tell: it must not leave a verdict for later groups
    model2 = _BatchMeanNet()
    params2 = _stack(model2, 3)
    stacked_forward(model2, {n: p[:1] for n, p in params2.items()}, x[:1])
    assert torch.allclose(stacked_forward(model2, params2, x)(x), vmap_forward(model2, params2)(x), atol=1e-6)


def test_vmap_path_equals_sequential(monkeypatch):
    """The general path (models the grouped kernels do not cover) against the sequential one."""
    import fedhpc.batched.kernels as kernels

    monkeypatch.setattr(kernels, "GROUPED_MODULES", ())  # where grouped_forward reads it
    start = make_engine("fedmix", ALGO_OPTIONS["fedmix"]).global_state.clone()
    seq = sequential_clients(make_engine("fedmix", ALGO_OPTIONS["fedmix"]), 0)
    bat = batched_clients(make_engine("fedmix", ALGO_OPTIONS["fedmix"]), 0, 4)
    assert_same_clients(seq, bat, start)


@needs_engine_dispatch
def test_two_ranks_batched_equal_one_rank_sequential(tmp_path):
    """--clients-at-once 4 under mpiexec -n 2 (each rank batches its own clients) == 1 rank,
    one client after another: FedMix on clients of unequal sizes, momentum + weight decay."""
    import os
    import subprocess
    import sys

    from conftest import REPO, clean_env, mpiexec

    args = ["--algo", "fedmix", "--lam", "0.2", "--dataset", "digits", "--model", "mlp", "--partition",
            "dirichlet:0.5", "--num-clients", "12", "--clients-per-round", "8", "--rounds", "3",
            "--batch-size", "16", "--momentum", "0.9", "--weight-decay", "0.001", "--quiet",
            "--no-tensorboard", "--threads", "1", "--checkpoint-every", "0"]
    runs = {"seq": ([], 1), "two_ranks_batched": ([mpiexec(), "-n", "2"], 4)}
    models = {}
    for name, (prefix, k) in runs.items():
        out = str(tmp_path / name)
        p = subprocess.run(prefix + [sys.executable, "-m", "fedhpc.launch", *args, "--clients-at-once", str(k),
                                     "--out", out], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        models[name] = torch.load(os.path.join(out, "final_model.pt"))
    diff = max(float((models["seq"][n] - models["two_ranks_batched"][n]).abs().max()) for n in models["seq"])
    assert diff <= 3 * TOL, diff


@needs_engine_dispatch
def test_batched_runs_give_the_same_model_and_losses_on_one_and_two_ranks(tmp_path):
    """--clients-at-once 3 on 1 rank and on 2, bit for bit: a group's float rounding depends on
    which clients it holds (grouped convolutions), so groups are fixed before the ranks are
    chosen. Grouping each rank's own clients, 10 clients gave groups of 3+3+3+1 on one rank and
    3+2 per rank on two, and models 1.5e-8 apart."""
    import json
    import os

    from conftest import launch

    args = ["--algo", "fedprox", "--model", "cnn", "--model-opt", "width=4", "--partition", "classes:2",
            "--num-clients", "10", "--clients-per-round", "10", "--batch-size", "10", "--rounds", "2",
            "--seed", "3", "--clients-at-once", "3", "--threads", "1", "--quiet", "--no-tensorboard"]
    got = {}
    for ranks in (1, 2):
        out = str(tmp_path / f"r{ranks}")
        p = launch(args + ["--out", out], ranks=ranks, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(os.path.join(out, "metrics.jsonl")) as f:
            losses = [(r["train_loss"], r["test_loss"]) for r in map(json.loads, f)]
        got[ranks] = (torch.load(os.path.join(out, "final_model.pt")), losses)
    (one, one_losses), (two, two_losses) = got[1], got[2]
    assert all(torch.equal(one[n], two[n]) for n in one)
    assert one_losses == two_losses


@pytest.mark.parametrize("world,k", [(2, 3), (3, 4), (4, 1)])
def test_assignment_keeps_each_group_of_sampled_clients_on_one_rank(world, k):
    from fedhpc.engine import assign_clients, sample_clients

    sizes = np.random.default_rng(1).integers(5, 500, size=100)
    sampled = sample_clients(0, 0, 100, 23)
    a = assign_clients(sampled, sizes, world, group=k)
    groups = [sampled[i:i + k] for i in range(0, len(sampled), k)]
    assert sorted(a) == sampled
    assert all(len({a[c] for c in g}) == 1 for g in groups)
    for r in range(world):  # a rank's clients in sampled order, cut every k, are the global groups
        mine = [c for c in sampled if a[c] == r]
        assert all(mine[i:i + k] in groups for i in range(0, len(mine), k))
    if k == 1:
        assert a == assign_clients(sampled, sizes, world)
