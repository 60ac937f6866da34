"""The data-parallel server trainer (fedhpc/server/trainer.py).

1 vs 2 vs 3 ranks (real mpiexec launches of tests/server_trainer_probe.py), and on
one rank: equality with plain PyTorch loops written here (same batches, mean loss,
torch's optimizers), soft targets, a custom loss with per-sample extras, the
transform, BatchNorm running statistics against their closed form, and errors.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO, clean_env, mpiexec
from fedhpc.algorithms.base import derive_seed
from fedhpc.errors import ConfigError, DataError, NonFiniteLossError
from fedhpc.flat import FlatModel
from fedhpc.models import build_model
from fedhpc.server.trainer import ServerTrainConfig, ServerTrainer, micro_batch_bounds
from fedhpc.world import World


@pytest.fixture(scope="module")
def world():
    return World("cpu", threads=1)


# ------------------------------------------------------------------ independent reference
def ref_batches(n, batch_size, seed, steps=0, epochs=0, drop_last=False):
    """The documented batch rule, written again: one seeded permutation per pass, cut in order."""
    out, epoch = [], 0
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, "server_batches", epoch)))
        for start in range(0, n, batch_size):
            idx = perm[start: start + batch_size]
            if drop_last and len(idx) < batch_size:
                continue
            out.append(idx)
            if steps and len(out) == steps:
                return out
        epoch += 1
        if epochs and epoch == epochs:
            return out


def plain_fit(model, x, targets, batches, opt, batch_loss, clip=0.0):
    """Textbook loop: one forward on the whole batch, batch-mean loss, backward, optional clip, step."""
    model.train()
    for idx in batches:
        opt.zero_grad()
        loss = batch_loss(model(x[idx]), targets[idx], idx)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def params_of(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def pair(model):
    """(model wired to a FlatModel, an untouched copy with the same initial weights)."""
    ref = copy.deepcopy(model)
    return model, FlatModel(model), ref


def digits_like(n, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g), g


# ------------------------------------------------------------------ 1 vs 2 vs 3 ranks
def test_ranks_1_2_3_agree(tmp_path):
    """Same final flat state (weights and BatchNorm buffers), step counter and loss on 1, 2, 3 ranks."""
    procs = {}
    for n in (1, 2, 3):  # launched together: each mostly waits on its own start-up
        cmd = [sys.executable, os.path.join(REPO, "tests", "server_trainer_probe.py"), str(tmp_path / f"n{n}")]
        if n > 1:
            cmd = [mpiexec(), "-n", str(n)] + cmd
        procs[n] = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    for n, p in procs.items():
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, f"{n} ranks:\n{out[-3000:]}"
    dumps = {n: [torch.load(tmp_path / f"n{n}" / f"rank{r}.pt") for r in range(n)] for n in procs}
    ref = dumps[1][0]
    assert set(ref) == {"mlp", "dropout", "bn", "mix2fld_cnn"}
    for case, r in ref.items():
        assert (r["flat"] - r["init"]).abs().max() > 1e-3, f"{case}: training did not move the weights"
    assert [int(b) for b in ref["bn"]["ints"]] == [5, 5]  # num_batches_tracked counts steps
    assert ref["dropout"]["steps"] == 6 and ref["dropout"]["samples"] == 90  # 2 epochs of 45
    for n in (1, 2, 3):
        for rank, dump in enumerate(dumps[n]):
            for case, r in dump.items():
                # every rank of a run holds exactly the weights of its rank 0
                assert torch.equal(r["flat"], dumps[n][0][case]["flat"]), (n, rank, case)
                diff = float((r["flat"].double() - ref[case]["flat"].double()).abs().max())
                assert diff <= 1e-6, f"{case}: {n} ranks differ from 1 rank by {diff}"
                assert abs(r["loss"] - ref[case]["loss"]) <= 1e-6 * max(1.0, abs(ref[case]["loss"]))
                assert [int(b) for b in r["ints"]] == [int(b) for b in ref[case]["ints"]]
                assert (r["samples"], r["steps"]) == (ref[case]["samples"], ref[case]["steps"])


# ------------------------------------------------------------------ one rank against plain loops
OPTIMS = {
    "sgd": (dict(), lambda p: torch.optim.SGD(p, lr=0.1)),
    # clip 1.1: the batch gradient norms are about 1.0 to 3.1, so some steps clip and some do not
    "sgd_momentum_nesterov_wd_clip": (dict(momentum=0.9, nesterov=True, weight_decay=1e-3, grad_clip=1.1),
                                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                                weight_decay=1e-3)),
    "adam_wd": (dict(optimizer="adam", weight_decay=1e-4, lr=0.01),
                lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-4)),
}


@pytest.mark.parametrize("name", list(OPTIMS))
def test_matches_plain_loop(world, name):
    """Steps crossing a pass boundary with a smaller last batch, micro-batches that do not divide B."""
    opts, make_opt = OPTIMS[name]
    x, y, _ = digits_like(50)
    torch.manual_seed(0)
    model, flat, ref = pair(build_model("mlp", (1, 8, 8), 10))
    cfg = ServerTrainConfig(steps=6, batch_size=16, micro_batch=5, **{"lr": 0.1, **opts})
    init = flat.flat.clone()
    res = ServerTrainer(world, model, flat).fit(x, y, cfg, seed=3)
    batches = ref_batches(50, 16, seed=3, steps=6)
    assert [len(b) for b in batches] == [16, 16, 16, 2, 16, 16]
    losses = []

    def mean_ce(logits, t, idx):
        loss = F.cross_entropy(logits, t)
        losses.append(float(loss.detach()) * len(idx))
        return loss

    plain_fit(ref, x, y, batches, make_opt(ref.parameters()), mean_ce, clip=opts.get("grad_clip", 0))
    assert torch.allclose(flat.flat, params_of(ref), atol=1e-6, rtol=0)
    assert (flat.flat - init).abs().max() > 1e-2  # the comparison is not between two untrained models
    assert res["steps"] == 6 and res["samples"] == 82
    assert res["loss"] == pytest.approx(sum(losses) / 82, rel=1e-6)


def test_epochs_and_drop_last(world):
    x, y, _ = digits_like(37)
    torch.manual_seed(1)
    model, flat, ref = pair(build_model("mlp", (1, 8, 8), 10))
    cfg = ServerTrainConfig(epochs=3, batch_size=10, micro_batch=4, lr=0.2, drop_last=True)
    res = ServerTrainer(world, model, flat).fit(x, y, cfg, seed=11)
    batches = ref_batches(37, 10, seed=11, epochs=3, drop_last=True)
    plain_fit(ref, x, y, batches, torch.optim.SGD(ref.parameters(), lr=0.2), lambda o, t, i: F.cross_entropy(o, t))
    assert (res["steps"], res["samples"]) == (9, 90)
    assert torch.allclose(flat.flat, params_of(ref), atol=1e-6, rtol=0)


def test_soft_targets_and_uint8_inputs(world):
    """Float targets take the soft cross-entropy; uint8 inputs the default [0, 1] scaling."""
    x, _, g = digits_like(30)
    x8 = (x.sigmoid() * 255).to(torch.uint8)
    soft = torch.rand(30, 10, generator=g).softmax(1)
    torch.manual_seed(2)
    model, flat, ref = pair(build_model("cnn", (1, 8, 8), 10))
    cfg = ServerTrainConfig(steps=4, batch_size=12, micro_batch=4, lr=0.1)
    ServerTrainer(world, model, flat).fit(x8, soft, cfg, seed=5)
    plain_fit(ref, x8.float() / 255, soft, ref_batches(30, 12, 5, steps=4),
              torch.optim.SGD(ref.parameters(), lr=0.1),
              lambda o, t, i: -(t * torch.log_softmax(o, 1)).sum(1).mean())
    assert torch.allclose(flat.flat, params_of(ref), atol=1e-6, rtol=0)


def test_custom_loss_with_extras(world):
    """Mix2FLD Eq. 5's shape: CE + beta * psi(output, teacher output of the label), extras per sample."""
    x, y, g = digits_like(40, classes=4)
    per_label = torch.rand(4, 4, generator=g).softmax(1)
    weight = torch.rand(40, generator=g) + 0.5
    beta = 0.7

    def loss_fn(logits, t, extra):
        teacher, w = extra
        return w * F.cross_entropy(logits, t, reduction="none") + beta * ((logits.softmax(1) - teacher) ** 2).sum(1)

    torch.manual_seed(3)
    model, flat, ref = pair(build_model("mlp", (1, 8, 8), 4))
    cfg = ServerTrainConfig(steps=5, batch_size=16, micro_batch=3, lr=0.3)
    ServerTrainer(world, model, flat).fit(x, y, cfg, seed=9, loss_fn=loss_fn, extra=(per_label[y], weight))

    def ref_loss(o, t, idx):  # written batch-wise, per-sample terms then the batch mean
        ce = -torch.log_softmax(o, 1).gather(1, t[:, None])[:, 0]
        return (weight[idx] * ce + beta * ((o.softmax(1) - per_label[t]) ** 2).sum(1)).mean()

    plain_fit(ref, x, y, ref_batches(40, 16, 9, steps=5), torch.optim.SGD(ref.parameters(), lr=0.3), ref_loss)
    assert torch.allclose(flat.flat, params_of(ref), atol=1e-6, rtol=0)


def test_transform_gets_seeded_generator(world):
    """The transform runs per micro-batch with train=True and a generator seeded per (step, micro-batch)."""
    x, y, _ = digits_like(24)
    calls = []

    def noisy(xb, train, generator):
        calls.append((train, xb.shape[0]))
        return xb + 0.5 * torch.randn(xb.shape, generator=generator)

    def run(seed):
        torch.manual_seed(4)
        model = build_model("mlp", (1, 8, 8), 10)
        flat = FlatModel(model)
        ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(steps=2, batch_size=12, micro_batch=5),
                                              seed=seed, transform=noisy)
        return flat.flat.clone()

    a, b, c = run(1), run(1), run(2)
    assert calls[:3] == [(True, 5), (True, 5), (True, 2)]
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_dropout_seeded_and_side_effects_restored(world):
    x, y, _ = digits_like(32)

    def run(seed):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
        flat = FlatModel(model)
        model.eval()
        before = torch.get_rng_state()
        ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(steps=3, batch_size=16, micro_batch=4), seed)
        assert torch.equal(torch.get_rng_state(), before), "the caller's RNG state was not restored"
        assert not model.training and all(p.grad is None for p in model.parameters())
        return flat.flat.clone()

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b) and not torch.allclose(a, c)


# ------------------------------------------------------------------ BatchNorm
@pytest.mark.parametrize("momentum", [0.3, None])
def test_bn_running_stats_closed_form(world, momentum):
    """Running stats = pre-step stats moved by the mean of the micro-batches' updates; one count per step."""
    x, y, g = digits_like(23)
    x = x.flatten(1)[:, :6] * 2 + 3
    torch.manual_seed(6)
    model = nn.Sequential(nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 10))
    flat = FlatModel(model)
    ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(steps=4, batch_size=10, micro_batch=4), seed=2)
    mean, var = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    for t, idx in enumerate(ref_batches(23, 10, 2, steps=4)):
        m = 1.0 / (t + 1) if momentum is None else momentum  # None: cumulative average over steps
        xs = x.double()[idx]
        micro = [xs[k: k + 4] for k in range(0, len(idx), 4)]
        mean = (1 - m) * mean + m * torch.stack([mb.mean(0) for mb in micro]).mean(0)
        var = (1 - m) * var + m * torch.stack([mb.var(0, unbiased=True) for mb in micro]).mean(0)
    assert torch.allclose(model[0].running_mean.double(), mean, atol=1e-5)
    assert torch.allclose(model[0].running_var.double(), var, atol=1e-5)
    assert int(model[0].num_batches_tracked) == 4


def test_bn_one_micro_batch_is_plain_batchnorm(world):
    """micro_batch >= batch_size: ordinary BatchNorm training (weights and running stats)."""
    x, y, _ = digits_like(30)
    torch.manual_seed(7)
    model, flat, ref = pair(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                          nn.Linear(4 * 36, 10)))
    ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(steps=4, batch_size=12, micro_batch=12,
                                                                  lr=0.1, momentum=0.9), seed=1)
    plain_fit(ref, x, y, ref_batches(30, 12, 1, steps=4), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
              lambda o, t, i: F.cross_entropy(o, t))
    assert torch.allclose(flat.flat[:flat.num_params], params_of(ref), atol=1e-6, rtol=0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(model[1], name).double(), getattr(ref[1], name).double(), atol=1e-6), name


def ref_micro_batches(B, micro_batch):
    """The documented cut, written again: chunks of micro_batch, a last single sample joined to the one before."""
    cuts = list(range(0, B, micro_batch)) + [B]
    if micro_batch > 1 and len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
        del cuts[-2]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def test_micro_batches_never_leave_a_single_sample():
    for B, mb in [(13, 4), (16, 5), (12, 5), (5, 4), (1, 4), (2, 4), (9, 4), (8, 4), (7, 3), (3, 1)]:
        assert micro_batch_bounds(B, mb) == ref_micro_batches(B, mb), (B, mb)
    assert micro_batch_bounds(13, 4) == [(0, 4), (4, 8), (8, 13)]
    assert micro_batch_bounds(5, 4) == [(0, 5)] and micro_batch_bounds(1, 4) == [(0, 1)]
    assert micro_batch_bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]  # micro_batch=1 asks for single samples


def test_bn_batch_leaving_a_one_sample_micro_batch_trains(world):
    """45 samples, batch 16, micro-batch 4: the last batch of 13 would leave a micro-batch of 1, which
    BatchNorm cannot normalise in training mode ("Expected more than 1 value per channel"), though the
    batch trains whole. It is joined to the one before (4 + 4 + 5); the weights equal a plain loop over
    the same ghost batches, the running statistics their closed form, and without BatchNorm the result
    equals training on each whole batch at once."""
    x, y, _ = digits_like(45)
    batches = ref_batches(45, 16, seed=4, epochs=2)
    assert [len(b) for b in batches] == [16, 16, 13] * 2
    torch.manual_seed(9)
    model, flat, ref = pair(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64), nn.Linear(64, 16), nn.ReLU(),
                                          nn.BatchNorm1d(16), nn.Linear(16, 10)))
    init = flat.flat.clone()
    res = ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(epochs=2, batch_size=16, micro_batch=4,
                                                                        lr=0.1), seed=4)
    assert (res["steps"], res["samples"]) == (6, 90)

    def ghost_ce(o, t, idx):  # the batch's mean CE, BatchNorm over each ghost batch alone (not o: the whole batch)
        return sum(F.cross_entropy(ref(x[idx[a:b]]), t[a:b], reduction="sum")
                   for a, b in ref_micro_batches(len(idx), 4)) / len(idx)

    plain_fit(ref, x, y, batches, torch.optim.SGD(ref.parameters(), lr=0.1), ghost_ce)
    assert torch.allclose(flat.flat[:flat.num_params], params_of(ref), atol=1e-6, rtol=0)
    assert (flat.flat[:flat.num_params] - init[:flat.num_params]).abs().max() > 1e-2
    mean, var = torch.zeros(64, dtype=torch.float64), torch.ones(64, dtype=torch.float64)
    for idx in batches:  # the first BatchNorm sees the data itself: its statistics in closed form
        xs = x.flatten(1).double()[idx]
        micro = [xs[a:b] for a, b in ref_micro_batches(len(idx), 4)]
        mean = 0.9 * mean + 0.1 * torch.stack([mb.mean(0) for mb in micro]).mean(0)
        var = 0.9 * var + 0.1 * torch.stack([mb.var(0, unbiased=True) for mb in micro]).mean(0)
    assert torch.allclose(model[1].running_mean.double(), mean, atol=1e-5)
    assert torch.allclose(model[1].running_var.double(), var, atol=1e-5)
    assert int(model[1].num_batches_tracked) == 6

    torch.manual_seed(10)  # no BatchNorm: micro-batches of 4, 4, 5 are the whole batch of 13
    model, flat, ref = pair(build_model("mlp", (1, 8, 8), 10))
    ServerTrainer(world, model, flat).fit(x, y, ServerTrainConfig(epochs=2, batch_size=16, micro_batch=4, lr=0.1),
                                          seed=4)
    plain_fit(ref, x, y, batches, torch.optim.SGD(ref.parameters(), lr=0.1), lambda o, t, i: F.cross_entropy(o, t))
    assert torch.allclose(flat.flat, params_of(ref), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ errors
def test_errors(world):
    x, y, _ = digits_like(8)
    model = build_model("mlp", (1, 8, 8), 10)
    tr = ServerTrainer(world, model, FlatModel(model))
    bad_cfgs = [ServerTrainConfig(), ServerTrainConfig(steps=1, epochs=1),
                ServerTrainConfig(steps=1, optimizer="rmsprop"), ServerTrainConfig(steps=1, micro_batch=0),
                ServerTrainConfig(steps=1, nesterov=True), ServerTrainConfig(epochs=1, batch_size=9, drop_last=True)]
    for cfg in bad_cfgs:
        with pytest.raises(ConfigError):
            tr.fit(x, y, cfg, seed=0)
    ok = ServerTrainConfig(steps=1, batch_size=4)
    with pytest.raises(ConfigError, match="per-sample"):
        tr.fit(x, y, ok, seed=0, loss_fn=lambda o, t, e: F.cross_entropy(o, t))
    with pytest.raises(DataError, match="rows"):
        tr.fit(x, y[:5], ok, seed=0)
    with pytest.raises(DataError, match="rows"):
        tr.fit(x, y, ok, seed=0, extra=torch.zeros(3))
    with pytest.raises(DataError, match="empty"):
        tr.fit(x[:0], y[:0], ok, seed=0)
    with pytest.raises(NonFiniteLossError):
        tr.fit(x, y, ok, seed=0, loss_fn=lambda o, t, e: F.cross_entropy(o, t, reduction="none") * float("nan"))
