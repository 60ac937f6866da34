"""The FedAlign family (issue 10): FedAlign, MOON, Mixup, StochDepth, GradAug and their shared pieces.

The standard set (resume, 1 vs 2 ranks, the engine's round against a hand computation)
runs for each of them from tests/test_algorithm_standard.py with the references in
tests/reference_steps_fedalign.py. Here: the pieces' equations against independent
computations, and the behaviour the issue names (BatchNorm statistics averaged, no
optimizer state across clients, MOON's store bounded, client models saved).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhpc.algorithms import ClientContext, RoundInfo
from fedhpc.algorithms.local_reg import draw_scales, draw_widths, resize, top_singular_value, transmitting_matrix
from fedhpc.config import parse_rounds
from fedhpc.algorithms.moon import contrastive_loss
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import ConfigError
from fedhpc.models import build_model
from fedhpc.world import World

#: hand computations compared within tolerances that must hold on any CPU (scripts/test.sh runs them twice)
pytestmark = pytest.mark.cross_cpu

DIGITS = ((1, 8, 8), 10)
TINY = ["--model", "resnet_digits", "--model-opt", "width=4"]
BASE = ["--dataset", "digits", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1",
        "--local-epochs", "1", "--batch-size", "64", "--lr", "0.05", "--partition", "dirichlet:0.5", "--seed", "3",
        "--threads", "1", "--quiet", "--no-tensorboard"]
ALGOS = {"fedalign": [], "moon": ["--model-opt", "projection_dim=8"], "mixup": [], "stochdepth": [], "gradaug": []}


def engine(algo, *extra):
    cfg, ao, do = parse_args(["--algo", algo, *BASE, *TINY, *ALGOS.get(algo, []), *extra])
    return Engine(cfg, ao, do, World(threads=1))


# ----------------------------------------------------------------------------- FedAlign's pieces

def test_transmitting_matrix_is_the_pooled_feature_product():
    g = torch.Generator().manual_seed(0)
    f1, f2 = torch.rand(3, 5, 4, 4, generator=g), torch.rand(3, 6, 2, 2, generator=g)
    got = transmitting_matrix(f1, f2)
    for b in range(3):  # one sample at a time, 2x2 average pooling written out
        pooled = torch.stack([torch.stack([f1[b, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].mean((1, 2))
                                           for j in range(2)], -1) for i in range(2)], -2)
        want = pooled.reshape(5, 4) @ f2[b].reshape(6, 4).T / 4
        assert torch.allclose(got[b], want, atol=1e-6)


def test_power_iteration_gives_the_top_singular_value():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 7, 5, generator=g, dtype=torch.float64)  # non-negative, as after ReLU
    exact = torch.linalg.svdvals(x)[:, 0]
    assert torch.allclose(top_singular_value(x, 200), exact, rtol=1e-10)
    ten = top_singular_value(x, 10)
    assert (ten <= exact * (1 + 1e-12)).all() and torch.allclose(ten, exact, rtol=1e-3)
    # on a real transmitting matrix of the model, full and slimmed
    model = build_model("resnet56", (3, 32, 32), 10).double()
    _, feats = model(torch.randn(2, 3, 32, 32, dtype=torch.float64), return_features=True)
    tm = transmitting_matrix(feats["last_block_in"], feats["last_block_out"]).detach()
    assert torch.allclose(top_singular_value(tm, 300), torch.linalg.svdvals(tm)[:, 0], rtol=1e-8)
    slim = model.run_last_block(feats["last_block_in"].detach(), 0.25)
    tms = transmitting_matrix(feats["last_block_in"], slim).detach()
    assert tms.shape == (2, 128, 64)
    assert torch.allclose(top_singular_value(tms, 300), torch.linalg.svdvals(tms)[:, 0], rtol=1e-8)
    # a zero matrix (all features dead) gives ~0 and a finite gradient, not NaN
    z = torch.zeros(2, 3, 4, requires_grad=True)
    s = top_singular_value(z)
    s.sum().backward()
    assert float(s.detach().max()) < 1e-12 and torch.isfinite(z.grad).all()


@pytest.mark.parametrize("m,n", [(7, 5), (128, 256), (32, 64)])
def test_power_iteration_starts_from_a_unit_vector(m, n):
    """One step gives sqrt(||X X^T 1|| / sqrt(m)) (the unit start 1/sqrt(m) written out),
    a lower bound on sigma_max; an unnormalised start would give m^(1/4) times that,
    above sigma_max (3.4x at ResNet-56's 128 rows). Later steps never decrease and
    never pass sigma_max, and 10 steps reach it."""
    g = torch.Generator().manual_seed(m)
    x = torch.rand(4, m, n, generator=g, dtype=torch.float64)  # non-negative, as after ReLU
    exact = torch.linalg.svdvals(x)[:, 0]
    one = top_singular_value(x, 1)
    closed = torch.stack([(xb @ (xb.T @ torch.ones(m, dtype=torch.float64))).norm().div(math.sqrt(m)).sqrt()
                          for xb in x])
    assert torch.allclose(one, closed, rtol=1e-12)
    assert (one <= exact * (1 + 1e-12)).all()
    assert (closed * m ** 0.25 > exact).all(), "the unnormalised start overestimates, so the check can fail"
    steps = torch.stack([top_singular_value(x, k) for k in range(1, 11)])
    assert (steps[1:] >= steps[:-1] * (1 - 1e-12)).all() and (steps <= exact * (1 + 1e-12)).all()
    assert torch.allclose(steps[-1], exact, rtol=1e-6)


def _fedalign_terms(model, x, y, width, student_input, iters=300):
    logits, feats = model(x, return_features=True)
    f_in, f_out = feats["last_block_in"].detach(), feats["last_block_out"].detach()
    slim_in, slim = model.run_last_block(f_in, width, return_input=True)
    k_f = torch.linalg.svdvals(transmitting_matrix(f_in, f_out))[:, 0]
    k_s = torch.linalg.svdvals(transmitting_matrix(f_in if student_input == "full" else slim_in, slim))[:, 0]
    return F.cross_entropy(logits, y), ((k_s - k_f) ** 2).mean()


@pytest.mark.parametrize("rescale", [False, True])
def test_fedalign_loss_and_where_its_gradient_goes(rescale):
    eng = engine("fedalign", "--mu", "0.7", "--power-iters", "300", "--lip-rescale" if rescale else "--no-lip-rescale")
    model = eng.model.double()
    x, y = torch.rand(16, 1, 8, 8, dtype=torch.float64), torch.arange(16) % 10
    ctx = ClientContext(eng.algo, 0, eng.data.client(0), RoundInfo(0, [0], [0], 0.1))
    ce, lip = _fedalign_terms(model, x, y, 0.25, "full")
    got = eng.algo.loss(model, x, y, ctx)
    want = ce + (0.7 * ce.detach() / lip.detach() * lip if rescale else 0.7 * lip)
    assert abs(got.item() - want.item()) < 1e-8
    if rescale:  # the authors' scaling: the regulariser is worth mu times the CE
        assert abs(got.item() - 1.7 * ce.item()) < 1e-8
    # the regulariser's gradient reaches only Block L's first ceil(w C) channels
    model.zero_grad()
    (got - ce).backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.stem.parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for b in model.blocks[:-1] for p in b.parameters())
    last = model.last_blocks()[0]
    assert last.conv1.weight.grad[:8, :4].abs().sum() > 0
    assert last.conv1.weight.grad[8:].abs().sum() == 0 and last.conv1.weight.grad[:, 4:].abs().sum() == 0


def test_fedalign_trains_the_rescaled_loss_unless_told_to_train_eq5_as_printed(capsys):
    """Issue 39 s.2 item 5: a bare --algo fedalign trained Eq. 5 as printed, whose regulariser
    dominates (35% on the digits twin against 93%); the authors' rescaling is the default now, the
    printed form --no-lip-rescale, and --help says which is which."""
    eng = engine("fedalign", "--mu", "0.7", "--power-iters", "300")
    assert eng.algo.options.lip_rescale
    model = eng.model.double()
    x, y = torch.rand(16, 1, 8, 8, dtype=torch.float64), torch.arange(16) % 10
    ctx = ClientContext(eng.algo, 0, eng.data.client(0), RoundInfo(0, [0], [0], 0.1))
    ce, lip = _fedalign_terms(model, x, y, 0.25, "full")
    assert abs(eng.algo.loss(model, x, y, ctx).item() - 1.7 * ce.item()) < 1e-8
    assert not engine("fedalign", "--no-lip-rescale").algo.options.lip_rescale
    with pytest.raises(SystemExit):
        parse_args(["--algo", "fedalign", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--lip-rescale, --no-lip-rescale L_Lip scaled to mu times the CE's magnitude, the authors' code and the "
            "form the paper's mu = 0.45 trains with; --no-lip-rescale: Eq. 5 as printed, CE + mu L_Lip" in text), text
    assert "(default: True, the authors' rescaling (fedhpc.config.auto);" in text


def test_a_checkpoint_that_ran_eq5_as_printed_resumes_only_under_it(tmp_path):
    """The rescaled form became the default after FedAlign's old-checkpoint fixture (a22cb92) was
    made, which ran Eq. 5 as printed without naming the option. The launcher now writes the option
    into every run's settings, and a setting a checkpoint does not name is read with the field's own
    default, False, what it meant then: a resume without --no-lip-rescale is refused by name, not
    continued under the other loss."""
    import shutil

    from fedhpc.config.identity import canonical_identity
    from fedhpc.errors import CheckpointError
    from standard_runner import run_case

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "old_checkpoints")
    case = json.load(open(os.path.join(fixture, "cases.json")))["fedalign"]
    # the fixture's run settings (digits' own lr and epochs came later too, and the identity names those)
    argv = case + ["--rounds", "2", "--lr", "0.05", "--local-epochs", "1", "--threads", "1", "--no-tensorboard",
                   "--quiet"]
    out = str(tmp_path / "old")
    shutil.copytree(os.path.join(fixture, "fedalign"), out)
    with pytest.raises(CheckpointError, match=r"algo_options.lip_rescale: checkpoint False vs now True"):
        run_case(argv + ["--out", out, "--resume"], World(threads=1))
    assert open(os.path.join(out, "checkpoints", "LATEST")).read().strip() == "round_000002"
    eng, _, _ = run_case(argv + ["--no-lip-rescale", "--out", out, "--resume"], World(threads=1))
    assert eng.start_round == 2 and not eng.algo.options.lip_rescale
    # today's runs name the form they train, so a later default cannot move them either
    for extra, named in (([], True), (["--no-lip-rescale"], False), (["--lip-rescale"], True)):
        cfg, _, _ = parse_args(["--algo", "fedalign", *BASE, *TINY, *extra])
        assert cfg.algo_options["lip_rescale"] is named
        assert canonical_identity(cfg.identity())["algo_options"]["lip_rescale"] is named
    assert canonical_identity({"algo": "fedalign", "algo_options": {}})["algo_options"]["lip_rescale"] is False


def test_fedalign_student_input_option():
    eng = engine("fedalign", "--mu", "1.0", "--power-iters", "300", "--student-input", "sliced", "--no-lip-rescale")
    model = eng.model.double()
    x, y = torch.rand(8, 1, 8, 8, dtype=torch.float64), torch.arange(8)
    ctx = ClientContext(eng.algo, 0, eng.data.client(0), RoundInfo(0, [0], [0], 0.1))
    ce, lip_sliced = _fedalign_terms(model, x, y, 0.25, "sliced")
    _, lip_full = _fedalign_terms(model, x, y, 0.25, "full")
    got = eng.algo.loss(model, x, y, ctx).item()
    assert abs(got - (ce + lip_sliced).item()) < 1e-8 and abs(got - (ce + lip_full).item()) > 1e-6


def test_methods_refuse_models_without_their_hooks():
    with pytest.raises(ConfigError, match="resnet_digits"):
        Engine(*parse_args(["--algo", "fedalign", *BASE, "--model", "cnn"]), World(threads=1))
    with pytest.raises(ConfigError, match="projection_dim"):
        engine("moon", "--model-opt", "projection_dim=0")
    with pytest.raises(ConfigError, match="projection"):
        engine("gradaug", "--model-opt", "projection_dim=8")
    with pytest.raises(ConfigError, match="--out"):
        engine("mixup", "--save-client-models", "last")
    with pytest.raises(ConfigError):
        parse_args(["--algo", "fedalign", *BASE, "--width", "0"])
    with pytest.raises(ConfigError):
        parse_args(["--algo", "gradaug", *BASE, "--scales", "1.0,1.5"])
    assert parse_rounds("25, 5,last", 30) == [5, 25, 30] and parse_rounds("") == []


@pytest.mark.parametrize("algo", ["fedalign", "gradaug", "stochdepth"])
def test_a_refused_model_is_named_as_the_model_flag_names_it(algo):
    """The refusal names the model by the value --model takes (not the class, SmallCNN), says when
    it is the dataset's default because --model was left at auto (on a dataset that names no
    residual network for auto to take: synthetic), and names the models that work."""
    for model, named in ((["--dataset", "synthetic"], "'cnn' (the synthetic default, as --model is auto)"),
                         (["--model", "cnn"], "'cnn'"), (["--model", "mlp"], "'mlp'")):
        with pytest.raises(ConfigError) as refused:
            Engine(*parse_args(["--algo", algo, *BASE, *model]), World(threads=1))
        message = str(refused.value)
        assert f"the run's model {named} has not" in message and "--model resnet56 or resnet18" in message
        assert "resnet_digits for the digits data" in message and "SmallCNN" not in message and "MLP" not in message


def test_moon_refusal_advises_what_gives_a_run():
    """A model without a projection head: the advice is the option where the model takes it, else a
    model that does (the cnn would refuse --model-opt projection_dim next); following it builds."""
    with pytest.raises(ConfigError, match=r"the run's model 'cnn' has none: pass --model resnet56 or resnet18 "
                                          r"\(resnet_digits"):
        Engine(*parse_args(["--algo", "moon", *BASE, "--model", "cnn"]), World(threads=1))
    with pytest.raises(ConfigError, match="the run's model 'resnet_digits' has none: add --model-opt projection_dim"):
        Engine(*parse_args(["--algo", "moon", *BASE, *TINY]), World(threads=1))
    assert engine("moon").algo.model.proj_head is not None  # TINY with --model-opt projection_dim=8


# ----------------------------------------------------------------------------- MOON

def test_moon_contrastive_loss_by_hand():
    g = torch.Generator().manual_seed(2)
    z, zg, zp = (torch.randn(5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    tau = 0.5
    want = 0.0
    for i in range(5):
        cos = lambda a, b: float(a @ b) / math.sqrt(float(a @ a) * float(b @ b))  # noqa: E731
        pos, neg = math.exp(cos(z[i], zg[i]) / tau), math.exp(cos(z[i], zp[i]) / tau)
        want += -math.log(pos / (pos + neg)) / 5
    assert abs(float(contrastive_loss(z, zg, zp, tau)) - want) < 1e-12
    # z equal to the global representation and orthogonal to the previous one: -log(e^2 / (e^2 + 1))
    e1, e2 = torch.eye(2, dtype=torch.float64)[:1], torch.eye(2, dtype=torch.float64)[1:]
    assert abs(float(contrastive_loss(e1, e1, e2, 0.5)) - math.log1p(math.exp(-2))) < 1e-12


def test_moon_uses_the_global_and_the_clients_previous_model():
    eng = engine("moon", "--mu", "1.0", "--rounds", "2", "--clients-per-round", "4")
    eng.run_round(0)
    algo = eng.algo
    assert sorted(eng.client_state.held()) == [0, 1, 2, 3]
    prev = eng.client_state.get_slot(1, "algo")
    x, y = eng.data.client(1).x[:16], eng.data.client(1).y[:16]
    algo.global_state = eng.global_state
    rnd = RoundInfo(1, [1], [1], 0.05)
    algo.round_begin(rnd)
    ctx = ClientContext(algo, 1, eng.data.client(1), rnd)
    eng.flat.load_(eng.global_state)
    algo.download(ctx)
    assert ctx.extra["has_previous"] and torch.equal(algo.frozen["previous"][1].flat, prev)
    model = eng.model.train()
    got = float(algo.loss(model, x, y, ctx).detach())
    # by hand: projections of three separately built networks holding the three states
    nets = {}
    for name, state in (("local", eng.global_state), ("global", eng.global_state), ("previous", prev)):
        net = build_model("resnet_digits", *DIGITS, {"width": 4, "projection_dim": 8})
        sd = eng.flat.state_dict_from(state)
        net.load_state_dict(sd)
        nets[name] = net.train() if name == "local" else net.eval()
    logits, feats = nets["local"](x, return_features=True)
    with torch.no_grad():
        zg = nets["global"](x, return_features=True)[1]["projection"]
        zp = nets["previous"](x, return_features=True)[1]["projection"]
    want = float((F.cross_entropy(logits, y) + contrastive_loss(feats["projection"], zg, zp, 0.5)).detach())
    assert abs(got - want) < 1e-5
    assert abs(want - float(F.cross_entropy(logits, y).detach())) > 1e-3  # the term is there


def test_moon_store_stays_within_its_budget_and_gives_the_same_model(tmp_path):
    argv = ["--num-clients", "40", "--clients-per-round", "20", "--rounds", "3", "--partition", "iid",
            "--batch-size", "32", "--client-test-fraction", "0"]
    runs = {}
    for budget in ("inf", "0.05"):  # 0.05 MiB holds about 3 of these models; inf never spills
        eng = engine("moon", *argv, "--client-state-budget-mb", budget, "--out", str(tmp_path / budget),
                     "--checkpoint-every", "0")
        eng.run()
        runs[budget] = eng
    small = runs["0.05"].client_state
    one = runs["0.05"].flat.numel * 4
    assert small.spills > 0 and small.memory_bytes <= 0.05 * 2**20 + one
    assert runs["inf"].client_state.spills == 0
    assert torch.equal(runs["inf"].global_state, runs["0.05"].global_state)


# ----------------------------------------------------------------------------- StochDepth

def test_stochastic_depth_expectation_is_the_evaluation_output():
    """E over lambda of the block's output in training = its evaluation output (Huang et al. Eq. 5),
    checked where the ReLU is linear (shortcut far above the residual's magnitude)."""
    torch.manual_seed(0)
    model = build_model("resnet_digits", *DIGITS, {"width": 4, "norm": "none"}).double()
    blk = model.blocks[0]  # identity shortcut
    with torch.no_grad():
        for p in blk.parameters():
            p.mul_(0.01)
    blk.keep_prob = 0.3
    blk.generator = torch.Generator().manual_seed(5)
    h = 10 + torch.rand(2, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        r = blk.residual(h)
        assert (h - r.abs() > 0).all()
        blk.train()
        n = 4000
        mean = sum(blk(h) for _ in range(n)) / n
        blk.eval()
        evaluated = blk(h)
    assert torch.allclose(evaluated, h + 0.3 * r, atol=1e-6)
    tol = 5 * math.sqrt(0.3 * 0.7 / n) * float(r.abs().max())  # 5 sigma of the Bernoulli mean
    assert float((mean - evaluated).abs().max()) < tol


def test_stochastic_depth_rates_follow_the_linear_decay_and_the_seeded_stream():
    eng = engine("stochdepth", "--final-keep-prob", "0.5", "--model-opt", "blocks=2")
    eng.algo.round_begin(RoundInfo(0, [0], [0], 0.1))
    model = eng.model
    keep = [b.keep_prob for b in model.blocks]
    assert keep == pytest.approx([1 - l / 6 * 0.5 for l in range(1, 7)])
    # count which blocks ran: a forward hook on each residual
    ran = np.zeros(6)
    for i, b in enumerate(model.blocks):
        b.conv1.register_forward_hook(lambda m, a, o, i=i: ran.__setitem__(i, ran[i] + 1))
    model.train()
    model.set_depth_generator(torch.Generator().manual_seed(9))
    x = torch.rand(2, 1, 8, 8)
    n = 3000
    with torch.no_grad():
        for _ in range(n):
            model(x)
    freq = ran / n
    assert np.all(np.abs(freq - np.array(keep)) < 5 * np.sqrt(np.array(keep) * (1 - np.array(keep)) / n) + 1e-9)
    # the same seed gives the same drops; the engine's own draws are the "stochdepth" stream
    model.set_depth_generator(torch.Generator().manual_seed(9))
    a = model(x)
    model.set_depth_generator(torch.Generator().manual_seed(9))
    assert torch.equal(a, model(x))


def test_stochastic_depth_schedule_is_the_papers_not_the_authors_code():
    """The docstring's numbers: on ResNet-56 (18 blocks) ``--final-keep-prob 0.5`` puts block 1 at
    1 - 0.5/18 and keeps L - (1 - rho_L)(L + 1)/2 = 13.25 blocks in expectation; the authors'
    schedule (block 1 at 1.0, steps of (1 - rho_L)/(L - 1)) keeps L - (1 - rho_L) L/2 = 13.5."""
    model = build_model("resnet56", (3, 32, 32), 100)
    model.set_stochastic_depth(0.5)
    keep = [b.keep_prob for b in model.blocks]
    n = len(keep)
    assert n == 18
    assert keep[0] == pytest.approx(1 - 0.5 / 18) and keep[-1] == pytest.approx(0.5)
    assert sum(keep) == pytest.approx(18 - 0.5 * 19 / 2) == pytest.approx(13.25)
    authors = [1.0 - l * 0.5 / (n - 1) for l in range(n)]
    assert authors[0] == 1.0 and authors[-1] == pytest.approx(0.5)
    assert sum(authors) == pytest.approx(13.5) and keep != pytest.approx(authors)


# ----------------------------------------------------------------------------- GradAug

def test_gradaug_width_and_resolution_draws():
    g = torch.Generator().manual_seed(3)
    widths = [draw_widths(g, 2, 0.8) for _ in range(4000)]
    flat = np.array(widths)
    assert flat.min() >= 0.8 and flat.max() < 1.0 and np.all(flat[:, 0] >= flat[:, 1])
    # n independent U(0.8, 1): the larger of two has mean 0.8 + 0.2 * 2/3, the smaller 0.8 + 0.2/3
    assert abs(flat[:, 0].mean() - (0.8 + 0.2 * 2 / 3)) < 0.005 and abs(flat[:, 1].mean() - (0.8 + 0.2 / 3)) < 0.005
    sw = draw_widths(torch.Generator().manual_seed(4), 3, 0.25, sandwich=True)
    assert sw[-1] == 0.25 and len(sw) == 3
    counts = np.bincount([int(s * 8) for _ in range(2000) for s in draw_scales(g, 2, [1.0, 0.875, 0.75, 0.625])])
    assert set(np.flatnonzero(counts)) == {5, 6, 7, 8} and counts[5:].min() > 800
    assert [resize(torch.zeros(1, 3, 32, 32), s).shape[-1] for s in (1.0, 0.875, 0.75, 0.625)] == [32, 28, 24, 20]


def test_forward_width_is_a_small_network_with_the_weight_slices():
    torch.manual_seed(4)
    model = build_model("resnet_digits", *DIGITS, {"width": 8})
    for m in model.modules():  # non-trivial BN statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5); m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5); m.bias.data.uniform_(-0.2, 0.2)
    model.eval()
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model.forward_width(x, 1.0), model(x))
        w = 0.5  # 8 -> 4, 16 -> 8, 32 -> 16 channels

        def conv(src, h, cout, stride=1, pad=1):
            return F.conv2d(h, src.weight[:cout, :h.shape[1]], None, stride, pad)

        def bn(src, h):
            c = h.shape[1]
            return (h - src.running_mean[:c, None, None]) / torch.sqrt(src.running_var[:c, None, None] + src.eps) \
                * src.weight[:c, None, None] + src.bias[:c, None, None]

        h = F.relu(bn(model.stem[1], conv(model.stem[0], x, 4)))
        for b, c, s in zip(model.blocks, (4, 8, 16), (1, 2, 2)):
            r = bn(b.bn2, conv(b.conv2, F.relu(bn(b.bn1, conv(b.conv1, h, c, s))), c))
            sc = h if b.projection is None else bn(b.projection[1], conv(b.projection[0], h, c, s, 0))
            h = F.relu(r + sc)
        want = h.mean((2, 3)) @ model.head.weight[:, :16].T + model.head.bias
        assert torch.allclose(model.forward_width(x, w), want, atol=1e-5)


def test_gradaug_runs_its_sub_networks_at_the_drawn_widths_and_resolutions():
    eng = engine("gradaug", "--min-width", "0.5", "--num-subnets", "3", "--mu", "1.0")
    algo, model = eng.algo, eng.model
    seen = []
    original = model.forward_width
    model.forward_width = lambda x, w: seen.append((x.shape[-1], w)) or original(x, w)
    ctx = ClientContext(algo, 2, eng.data.client(2), RoundInfo(0, [2], [2], 0.1))
    x, y = torch.rand(8, 1, 8, 8), torch.arange(8)
    for _ in range(3):
        algo.loss(model, x, y, ctx)
    g = ctx.generator("gradaug")
    want = []
    for _ in range(3):
        ws = draw_widths(g, 3, 0.5)
        ss = draw_scales(g, 3, [1.0, 0.875, 0.75, 0.625])
        want += [(round(8 * s), w) for w, s in zip(ws, ss)]
    assert seen == want and len({s for s, _ in seen}) > 1


# ----------------------------------------------------------------------------- Mixup

def test_mixup_gamma_zero_is_plain_training_and_gamma_mixes():
    states = {}
    for gamma in ("0", "0.1"):
        eng = engine("mixup", "--gamma", gamma)
        eng.run_round(0)
        states[gamma] = eng.global_state
    eng = engine("stochdepth", "--final-keep-prob", "1.0")  # FedAvg on the same model
    eng.run_round(0)
    assert torch.equal(states["0"], eng.global_state)
    assert float((states["0.1"] - states["0"]).abs().max()) > 1e-4


# ----------------------------------------------------------------------------- engine behaviour

def test_batchnorm_running_statistics_are_averaged_with_the_weights():
    for algo in ("fedavg", "fedalign"):
        eng = engine(algo, "--model-opt", "norm=batch")
        uploads = {}
        upload = eng.algo.upload

        def capture(model, ctx, upload=upload):
            uploads[ctx.cid] = (eng.flat.flat.clone(), ctx.num_train)
            return upload(model, ctx)
        eng.algo.upload = capture
        before = eng.global_state.clone()
        eng.run_round(0)
        assert len(uploads) == 2
        want = sum(f * n for f, n in uploads.values()) / sum(n for _, n in uploads.values())
        views, before_views = eng.flat.views(eng.global_state), eng.flat.views(before)
        wviews = eng.flat.views(want)
        names = [e.name for e in eng.flat.entries if "running_" in e.name]
        assert len(names) == 2 * sum(isinstance(m, nn.BatchNorm2d) for m in eng.model.modules())
        for name in names:
            assert torch.allclose(views[name], wviews[name], atol=1e-6), name
            assert not torch.allclose(views[name], before_views[name])  # they were trained
        clients = [eng.flat.views(f)["blocks.2.bn2.running_mean"] for f, _ in uploads.values()]
        assert not torch.allclose(clients[0], clients[1])  # so the average is not trivially one of them


@pytest.mark.parametrize("algo", list(ALGOS))
def test_no_optimizer_state_crosses_clients(algo):
    """With momentum, client 1 trained right after client 0 on the same rank ends where it
    ends when trained alone by a fresh engine."""
    def train(eng, cids):
        rnd = RoundInfo(0, cids, cids, 0.05)
        eng.algo.global_state = eng.global_state
        eng.algo.round_begin(rnd)
        for cid in cids:
            eng.flat.load_(eng.global_state)
            ctx = ClientContext(eng.algo, cid, eng.data.client(cid), rnd)
            torch.manual_seed(cid)
            eng.algo.download(ctx)
            eng.algo.local_update(eng.model, ctx)
        return eng.flat.flat.clone()

    opts = ["--momentum", "0.9", "--weight-decay", "1e-4", "--local-epochs", "2"]
    after_other = train(engine(algo, *opts), [0, 1])
    alone = train(engine(algo, *opts), [1])
    assert torch.equal(after_other, alone)


@pytest.mark.parametrize("algo", ["gradaug", "fedavg"])  # an engine option: FedAvg's row of Table 1 needs it too
def test_client_models_are_saved_at_the_chosen_rounds(tmp_path, algo):
    from fedhpc.analysis.hessian import client_models_dir, saved_clients, saved_rounds

    out = str(tmp_path / "run")
    eng = engine(algo, "--rounds", "3", "--save-client-models", "1,last", "--out", out)
    uploads = {}
    upload = eng.algo.upload

    def capture(model, ctx):
        uploads[(ctx.round.index + 1, ctx.cid)] = eng.flat.state_dict_from(eng.flat.flat)
        return upload(model, ctx)
    eng.algo.upload = capture
    eng.run()
    assert saved_rounds(out) == [1, 3]
    for r in (1, 3):
        cids = saved_clients(out, r)
        assert cids == sorted(c for rr, c in uploads if rr == r) and len(cids) == 2
        for cid in cids:
            sd = torch.load(os.path.join(client_models_dir(out, r), f"client_{cid:06d}.pt"))
            assert sd.keys() == uploads[(r, cid)].keys()
            assert all(torch.equal(sd[k], uploads[(r, cid)][k]) for k in sd)


def test_launch_configs_hold_the_papers_settings():
    here = os.path.join(os.path.dirname(__file__), "..", "launch")
    main = parse_args(["--config", os.path.join(here, "fedalign_cifar100.yaml")])[0]
    assert (main.algo, main.dataset, main.model, main.partition) == ("fedalign", "cifar100", "resnet56",
                                                                      "dirichlet_capped:0.5")
    assert (main.num_clients, main.clients_per_round, main.rounds, main.local_epochs, main.batch_size) == (16, 16, 25, 20, 64)
    assert (main.lr, main.momentum, main.weight_decay, main.optimizer, main.nesterov) == (0.01, 0.9, 1e-4, "sgd", True)
    assert main.algo_options["mu"] == 0.45 and main.algo_options["width"] == 0.25
    c10 = parse_args(["--config", os.path.join(here, "fedalign_cifar10.yaml")])[0]
    inet = parse_args(["--config", os.path.join(here, "fedalign_imagenet200.yaml")])[0]
    assert (c10.dataset, c10.model) == ("cifar10", "resnet56") and (inet.dataset, inet.model) == ("imagenet200", "resnet18")
    for name in ("fedalign_digits.yaml", "fedalign_digits_fedavg.yaml"):
        cfg = parse_args(["--config", os.path.join(here, name)])[0]
        assert cfg.dataset == "digits" and cfg.model == "resnet_digits"
    # every row of the study partitions by the rule of the authors' code (FedML's capped Dir(0.5))
    study = sorted(f for f in os.listdir(here) if f.startswith("fedalign_") and "digits" not in f)
    assert len(study) == 21
    for name in study:
        assert parse_args(["--config", os.path.join(here, name)])[0].partition == "dirichlet_capped:0.5", name
