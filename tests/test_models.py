"""Tests of the papers' models (fedhpc/models/vision.py, fedhpc/models/text.py).

Expected parameter counts are worked out here by hand from the layer sizes the
papers (or the documented readings) give, not by calling the model code.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhpc.errors import ConfigError
from fedhpc.models import MODELS, build_model, load_model_modules, model_layers

# dataset shapes: FEMNIST, CIFAR-10/100, MNIST, ImageNet-200, Shakespeare
FEMNIST = ((1, 28, 28), 62)
CIFAR10 = ((3, 32, 32), 10)
CIFAR100 = ((3, 32, 32), 100)
MNIST = ((1, 28, 28), 10)
IMAGENET200 = ((3, 64, 64), 200)
SHAKESPEARE = ((80,), 80)

CASES = [
    ("lenet5", *FEMNIST),
    ("vgg_fedmix", *CIFAR10),
    ("vgg_fedmix", *CIFAR100),
    ("resnet56", *CIFAR10),
    ("resnet56", *CIFAR100),
    ("resnet18", *IMAGENET200),
    ("pmixfed_cnn", *CIFAR10),
    ("pmixfed_cnn", *CIFAR100),
    ("pmixfed_cnn_mnist", *MNIST),
    ("mobilenet", *CIFAR10),
    ("mobilenet", *CIFAR100),
    ("mix2fld_cnn", *MNIST),
    ("lstm_char", *SHAKESPEARE),
]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sample_input(shape, num_classes, batch=2):
    if len(shape) == 1:  # character ids
        return torch.randint(0, num_classes, (batch, shape[0]))
    return torch.randn(batch, *shape)


# hand counting helpers: weights (+ bias) of the basic layers
def conv(cin, cout, k, bias=True, groups=1):
    return cin // groups * cout * k * k + (cout if bias else 0)


def fc(fin, fout, bias=True):
    return fin * fout + (fout if bias else 0)


def bn(c):
    return 2 * c


def lstm(fin, hidden):  # PyTorch LSTM: 4 gates, input and recurrent weights, two bias vectors
    return 4 * hidden * (fin + hidden) + 2 * 4 * hidden


# --------------------------------------------------------------------------- registry / shapes
def test_all_models_registered():
    load_model_modules()
    for name in {c[0] for c in CASES}:
        assert name in MODELS


@pytest.mark.parametrize("name,shape,num_classes", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_output_shape_on_dataset(name, shape, num_classes):
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    x = sample_input(shape, num_classes)
    y = model(x)
    if name == "lstm_char":
        assert y.shape == (2, shape[0], num_classes)
    else:
        assert y.shape == (2, num_classes)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(
    "name,shape,num_classes",
    [
        ("lenet5", (3, 32, 32), 10),
        ("vgg_fedmix", (1, 48, 40), 7),
        ("pmixfed_cnn", (1, 64, 48), 5),
        ("pmixfed_cnn_mnist", (3, 32, 32), 4),
        ("mobilenet", (1, 64, 64), 3),
        ("mix2fld_cnn", (3, 32, 32), 2),
        ("resnet56", (1, 20, 24), 3),
        ("lstm_char", (17,), 30),
    ],
)
def test_other_input_shapes(name, shape, num_classes):
    """Flatten sizes follow input_shape (nothing is hard-coded to the paper's dataset)."""
    model = build_model(name, shape, num_classes)
    y = model(sample_input(shape, num_classes))
    assert y.shape[0] == 2 and y.shape[-1] == num_classes


def test_resnet_mnist_is_resnet_digits_behind_the_imagenet_stem():
    """mnist5k's residual network: 28x28 -> 7x7 in the stem, then the digits stages (4x4, 2x2), with
    exactly resnet_digits' weights but the stem's 7x7 kernel."""
    torch.manual_seed(0)
    m = build_model("resnet_mnist", (1, 28, 28), 10).eval()
    d = build_model("resnet_digits", (1, 28, 28), 10)
    with torch.no_grad():
        logits, feats = m(torch.randn(2, 1, 28, 28), return_features=True)
    assert logits.shape == (2, 10) and feats["last_block_out"].shape == (2, 32, 2, 2)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes.pop("stem.0.weight") == (8, 1, 7, 7)
    assert shapes == {k: tuple(v.shape) for k, v in d.state_dict().items() if k != "stem.0.weight"}


def test_resnet18_at_224():
    model = build_model("resnet18", (3, 224, 224), 200).eval()
    with torch.no_grad():
        logits, feats = model(torch.randn(1, 3, 224, 224), return_features=True)
    assert logits.shape == (1, 200)
    assert feats["last_block_in"].shape == (1, 256, 14, 14)
    assert feats["last_block_out"].shape == (1, 512, 7, 7)


def test_unknown_option_is_rejected():
    with pytest.raises(ConfigError):
        build_model("lenet5", (1, 28, 28), 62, {"width": 2})


def test_a_model_larger_than_memory_is_a_config_error_naming_its_options():
    """cnn width=10^7 asks torch's allocator for 7.2 PB, more than any machine has: a
    RuntimeError from inside torch before, now the model, its options and the fix."""
    with pytest.raises(ConfigError, match=r"model 'cnn' with width=10000000 does not fit in memory \(it tried "
                                          r"to allocate \d+ bytes\); lower its size options"):
        build_model("cnn", (1, 8, 8), 10, {"width": 10**7})


def _image_models():
    load_model_modules()  # at collection: the registry fills as the model modules load
    # lstm_char is the text model; mlp flattens anything (the engine's forward probe refuses it, below)
    return sorted(n for n in MODELS.names() if n not in ("lstm_char", "mlp"))


@pytest.mark.parametrize("name", _image_models())
def test_an_image_model_refuses_character_ids_when_built(name):
    """Every image model given a text dataset's input shape (a sequence of ids) names the problem
    and the fix when built, not a ValueError from unpacking the shape."""
    with pytest.raises(ConfigError, match=r"image models need input_shape \(C, H, W\); got \(80,\), which is no "
                                          r"image .* use a model made for this data \(--model auto"):
        build_model(name, (80,), 86)


def test_a_model_that_cannot_take_the_data_is_refused_before_any_round(tmp_path):
    """A text model on images, an image model (mlp) on character ids: one forward on a training
    input before the first round names the model, the data's inputs and the dataset's default
    model; before, the first batch raised torch's RuntimeError about embedding indices or dtypes."""
    from test_formats import write_tff_shakespeare

    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World

    write_tff_shakespeare(str(tmp_path / "shakespeare"))
    common = ["--clients-per-round", "1", "--quiet", "--no-tensorboard", "--threads", "1"]
    cases = [(["--dataset", "digits", "--num-clients", "4", "--model", "lstm_char"],
              r"model 'lstm_char' cannot take the digits inputs \(float32 values of shape 1x8x8\): RuntimeError: "
              r".*Use a model made for them: the digits default is 'cnn' \(--model auto\)"),
             (["--dataset", "shakespeare", "--data-dir", str(tmp_path), "--num-clients", "1", "--model", "mlp"],
              r"model 'mlp' cannot take the shakespeare inputs \(integer ids of shape 80\): RuntimeError: "
              r".*the shakespeare default is 'lstm_char'")]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            Engine(*parse_args([*argv, *common]), World(threads=1))
    # what the advice names builds
    Engine(*parse_args(["--dataset", "shakespeare", "--data-dir", str(tmp_path), "--num-clients", "1", *common]),
           World(threads=1))


def test_other_runtime_errors_of_a_builder_pass_through(monkeypatch):
    def broken(input_shape, num_classes):
        raise RuntimeError("a bug in the builder")
    monkeypatch.setitem(MODELS._entries, "broken_for_test", broken)
    with pytest.raises(RuntimeError, match="a bug in the builder"):
        build_model("broken_for_test", (1, 8, 8), 10)


# --------------------------------------------------------------------------- parameter counts
def test_mix2fld_cnn_has_12544_weights_and_no_bias():
    """Mix2FLD Sec. IV: 2 conv + 1 fc, N_mod = 12,544 ("# of model weights").

    Chosen configuration: conv 7x7 1->16 (28->22, pool 11), conv 5x5 16->24
    (11->7, pool 3), fc 24*3*3 -> 10, no biases, so weights == parameters.
    """
    model = build_model("mix2fld_cnn", *MNIST)
    weights = 7 * 7 * 1 * 16 + 5 * 5 * 16 * 24 + (24 * 3 * 3) * 10
    assert weights == 12_544
    assert n_params(model) == 12_544
    assert all(p.dim() > 1 for p in model.parameters())  # weight matrices / kernels only
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) == 2 and len(linears) == 1


def test_lenet5_femnist_count():
    # conv 5x5 1->6 (padding 2: 28 -> 28 -> 14), conv 5x5 6->16 (14 -> 10 -> 5), fc 400-120-84-62
    expected = conv(1, 6, 5) + conv(6, 16, 5) + fc(16 * 5 * 5, 120) + fc(120, 84) + fc(84, 62)
    assert expected == 66_126
    assert n_params(build_model("lenet5", *FEMNIST)) == expected


def test_vgg_fedmix_count_and_head_reading():
    chans = [3, 32, 64, 128, 128, 256, 256]
    convs = sum(conv(a, b, 3) for a, b in zip(chans[:-1], chans[1:]))
    # three fc layers in all: 4096 -> 512 -> 512 -> classes
    expected = convs + fc(256 * 4 * 4, 512) + fc(512, 512) + fc(512, 10)
    model = build_model("vgg_fedmix", *CIFAR10)
    assert n_params(model) == expected
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 3
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 6
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 0
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 3 and all(d.p == 0.1 for d in drops)
    # the other reading: three 512-wide fc layers plus a classifier
    other = build_model("vgg_fedmix", *CIFAR10, {"fc_hidden_layers": 3})
    assert n_params(other) == expected + fc(512, 512)
    assert sum(isinstance(m, nn.Linear) for m in other.modules()) == 4


def _bottleneck(cin, planes, project):
    out = 4 * planes
    n = conv(cin, planes, 1, False) + bn(planes) + conv(planes, planes, 3, False) + bn(planes)
    n += conv(planes, out, 1, False) + bn(out)
    if project:
        n += conv(cin, out, 1, False) + bn(out)
    return n


def _basic(cin, cout, project):
    n = conv(cin, cout, 3, False) + bn(cout) + conv(cout, cout, 3, False) + bn(cout)
    if project:
        n += conv(cin, cout, 1, False) + bn(cout)
    return n


def test_resnet56_count_matches_fedalign():
    """FedAlign Table 5 (CIFAR-100, ResNet-56 as in FedML): 0.61 M parameters."""
    stem = conv(3, 16, 3, False) + bn(16)
    body = 0
    cin = 16
    for planes in (16, 32, 64):
        for i in range(6):
            body += _bottleneck(cin, planes, project=(i == 0))  # first block of each stage changes shape
            cin = 4 * planes
    expected = stem + body + fc(256, 100)
    model = build_model("resnet56", *CIFAR100)
    assert n_params(model) == expected == 614_452
    assert round(expected / 1e6, 2) == 0.61
    # depth: 3 stages * 6 blocks * 3 convs + stem + fc = 56 weighted layers (projections not counted)
    n_convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert n_convs - 3 + 1 == 56


def test_resnet56_basic_variant_count():
    stem = conv(3, 16, 3, False) + bn(16)
    body, cin = 0, 16
    for s, c in enumerate((16, 32, 64)):
        for i in range(9):
            body += _basic(cin, c, project=(s > 0 and i == 0))
            cin = c
    expected = stem + body + fc(64, 10)
    assert n_params(build_model("resnet56", *CIFAR10, {"block": "basic"})) == expected


def test_resnet18_imagenet200_count():
    stem = conv(3, 64, 7, False) + bn(64)
    body, cin = 0, 64
    for s, c in enumerate((64, 128, 256, 512)):
        for i in range(2):
            body += _basic(cin, c, project=(s > 0 and i == 0))
            cin = c
    expected = stem + body + fc(512, 200)
    assert n_params(build_model("resnet18", *IMAGENET200)) == expected
    # the 1000-class network is the well-known 11,689,512
    assert stem + body + fc(512, 1000) == 11_689_512


def test_pmixfed_cnn_counts():
    # 4 x (3x3 conv 64 + BN), 32 -> 2x2 after four pools, fc 256 -> classes
    expected = conv(3, 64, 3) + bn(64) + 3 * (conv(64, 64, 3) + bn(64)) + fc(64 * 2 * 2, 10)
    assert n_params(build_model("pmixfed_cnn", *CIFAR10)) == expected
    # MNIST: 5x5 conv 1->10, 5x5 conv 10->20 (28 -> 24 -> 12 -> 8 -> 4), fc 320-50-10
    expected = conv(1, 10, 5) + conv(10, 20, 5) + fc(320, 50) + fc(50, 10)
    assert expected == 21_840
    assert n_params(build_model("pmixfed_cnn_mnist", *MNIST)) == expected


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_mobilenet_count(alpha):
    cfg = [64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024]
    cin = int(32 * alpha)
    expected = conv(3, cin, 3, False) + bn(cin)
    for c in cfg:
        cout = int(c * alpha)
        expected += conv(cin, cin, 3, False, groups=cin) + bn(cin) + conv(cin, cout, 1, False) + bn(cout)
        cin = cout
    expected += fc(cin, 100)
    model = build_model("mobilenet", *CIFAR100, {"width_multiplier": alpha})
    assert n_params(model) == expected
    # "14 convolutional layers ... and 1 fully connected layer"
    assert len(model_layers(model)) == 15


def test_lstm_char_count():
    v, e, h = 80, 8, 256
    expected = v * e + lstm(e, h) + lstm(h, h) + fc(h, v)
    model = build_model("lstm_char", *SHAKESPEARE)
    assert n_params(model) == expected
    assert [type(m) for _, m in model_layers(model)] == [nn.Embedding, nn.LSTM, nn.LSTM, nn.Linear]


# --------------------------------------------------------------------------- layers()
@pytest.mark.parametrize("name,shape,num_classes", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_layers_cover_every_parameter_once(name, shape, num_classes):
    model = build_model(name, shape, num_classes)
    assert hasattr(model, "layers")
    layers = model_layers(model)
    assert len(layers) >= 2
    seen = {}
    for lname, module in layers:
        params = list(module.parameters())
        assert params, f"layer {lname} owns no parameters"
        for p in params:
            assert id(p) not in seen, f"parameter in both {seen[id(p)]} and {lname}"
            seen[id(p)] = lname
    assert set(seen) == {id(p) for p in model.parameters()}
    assert len({n for n, _ in layers}) == len(layers)


# --------------------------------------------------------------------------- FedAlign hooks
RESNETS = [("resnet56", *CIFAR100), ("resnet18", *IMAGENET200)]


@pytest.mark.parametrize("name,shape,num_classes", RESNETS)
def test_resnet_features_and_full_width_block_is_exact(name, shape, num_classes):
    torch.manual_seed(1)
    model = build_model(name, shape, num_classes)
    x = torch.randn(2, *shape)
    c_in, c_out, hw_in, hw_out = (128, 256, 16, 8) if name == "resnet56" else (256, 512, 4, 2)
    for mode in ("train", "eval"):
        getattr(model, mode)()
        logits, feats = model(x, return_features=True)
        assert logits.shape == (2, num_classes)
        assert feats["last_block_in"].shape == (2, c_in, hw_in, hw_in)
        assert feats["last_block_out"].shape == (2, c_out, hw_out, hw_out)
        # the logits come from the returned last feature map
        ref = model.head(feats["last_block_out"].mean(dim=(2, 3)))
        assert torch.allclose(logits, ref, atol=1e-5)
        with torch.no_grad():
            same = model.run_last_block(feats["last_block_in"], width=1.0)
        assert torch.equal(same, feats["last_block_out"])
        slim_in, slim = model.run_last_block(feats["last_block_in"].detach(), width=0.25, return_input=True)
        assert slim_in.shape == (2, math.ceil(0.25 * c_in), hw_in, hw_in)
        assert slim.shape == (2, math.ceil(0.25 * c_out), hw_out, hw_out)


def test_slim_block_shares_weights_and_keeps_running_stats():
    torch.manual_seed(2)
    model = build_model("resnet56", *CIFAR10).train()
    n_before = n_params(model)
    _, feats = model(torch.randn(4, 3, 32, 32), return_features=True)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    model.zero_grad()
    out = model.run_last_block(feats["last_block_in"].detach(), width=0.25)
    out.square().mean().backward()
    assert n_params(model) == n_before
    for k, v in model.state_dict().items():
        if k in stats:
            assert torch.equal(v, stats[k]), f"{k} changed by the slimmed block"
    last = model.last_blocks()[-1]  # a bottleneck: 256 -> 64 -> 64 -> 256
    g = last.conv1.weight.grad
    assert g is not None and g[:16, :64].abs().sum() > 0
    assert g[16:].abs().sum() == 0 and g[:, 64:].abs().sum() == 0
    assert last.bn3.weight.grad[64:].abs().sum() == 0 and last.bn3.weight.grad[:64].abs().sum() > 0
    # blocks before Block L receive nothing (the input was detached)
    assert all(p.grad is None for p in model.stem.parameters())


def test_slim_block_equals_a_small_network_with_copied_weights():
    """width=0.25 on the last bottleneck == a plain 64->16->16->64 bottleneck holding the weight slices."""
    torch.manual_seed(3)
    model = build_model("resnet56", *CIFAR10, {"last_block": "block"})
    for m in model.modules():  # non-trivial BN statistics and affine parameters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    model.eval()
    blk = model.last_blocks()[0]
    assert len(model.last_blocks()) == 1 and model.last_block_channels == (256, 256)

    def small_bn(src, c):
        b = nn.BatchNorm2d(c).eval()
        b.weight.data.copy_(src.weight[:c]); b.bias.data.copy_(src.bias[:c])
        b.running_mean.copy_(src.running_mean[:c]); b.running_var.copy_(src.running_var[:c])
        return b

    def small_conv(src, cin, cout, k, pad):
        c = nn.Conv2d(cin, cout, k, padding=pad, bias=False)
        c.weight.data.copy_(src.weight[:cout, :cin])
        return c

    c1, b1 = small_conv(blk.conv1, 64, 16, 1, 0), small_bn(blk.bn1, 16)
    c2, b2 = small_conv(blk.conv2, 16, 16, 3, 1), small_bn(blk.bn2, 16)
    c3, b3 = small_conv(blk.conv3, 16, 64, 1, 0), small_bn(blk.bn3, 64)
    x = torch.randn(2, 256, 8, 8)
    with torch.no_grad():
        xs = x[:, :64]
        ref = F.relu(b3(c3(F.relu(b2(c2(F.relu(b1(c1(xs)))))))) + xs)
        got = model.run_last_block(x, width=0.25)
    assert torch.allclose(got, ref, atol=1e-5)


def test_fedalign_block_is_the_last_stage_by_compute():
    """FedAlign Table 5: FedAvg 87.3 MFLOPs, FedAlign 89.1 on ResNet-56.

    Multiply-accumulates of one 32x32 forward, and of the slimmed Block L at
    width 0.25: the ~1.8 M difference is the last stage, not the last block.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model("resnet56", *CIFAR100).eval()
    with torch.no_grad():
        counter = FlopCounterMode(display=False)
        with counter:
            _, feats = model(torch.randn(1, 3, 32, 32), return_features=True)
        full = counter.get_total_flops() / 2
        counter = FlopCounterMode(display=False)
        with counter:
            model.run_last_block(feats["last_block_in"], width=0.25)
        slim = counter.get_total_flops() / 2
    assert abs(full / 1e6 - 87.3) < 0.2
    assert abs(slim / 1e6 - (89.1 - 87.3)) < 0.15


def test_width_rounding_and_validation():
    model = build_model("resnet18", *IMAGENET200)
    f = torch.randn(1, 256, 4, 4)
    assert model.run_last_block(f, width=0.3).shape[1] == math.ceil(0.3 * 512)
    with pytest.raises(ValueError):
        model.run_last_block(f, width=0.0)
    with pytest.raises(ValueError):
        model.run_last_block(torch.randn(1, 100, 4, 4), width=0.25)


def test_stochastic_depth_keep_probs_and_behaviour():
    torch.manual_seed(4)
    model = build_model("resnet56", *CIFAR10, {"block": "basic"})
    blocks = [m for _, m in model_layers(model)][1:-1]
    assert len(blocks) == 27 and isinstance(model.blocks, nn.ModuleList)
    model.set_stochastic_depth(0.9)
    probs = [b.keep_prob for b in blocks]
    assert probs[-1] == pytest.approx(0.9)
    assert probs[0] == pytest.approx(1 - 1 / 27 * 0.1)
    assert all(a > b for a, b in zip(probs, probs[1:]))
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        y_sd = model(x)
        model.set_stochastic_depth(1.0)
        y_plain = model(x)
    assert not torch.allclose(y_sd, y_plain)
    # in training a dropped block is its shortcut alone
    blk = blocks[3]  # identity shortcut inside stage 1
    blk.train()
    blk.keep_prob = 1e-12
    h = torch.randn(2, 16, 32, 32)
    assert torch.equal(blk(h), F.relu(h))


# --------------------------------------------------------------------------- LSTM
def test_lstm_embed_split_and_next_char_causality():
    torch.manual_seed(5)
    model = build_model("lstm_char", *SHAKESPEARE).eval()
    ids = torch.randint(0, 80, (2, 80), dtype=torch.int64)
    emb = model.embed(ids)
    assert emb.shape == (2, 80, 8)
    out = model(ids)
    assert torch.equal(out, model.forward_embedded(emb))
    assert out.shape == (2, 80, 80)
    # position t sees only characters <= t
    ids2 = ids.clone()
    ids2[:, 50] = (ids2[:, 50] + 1) % 80
    out2 = model(ids2)
    assert torch.equal(out[:, :50], out2[:, :50])
    assert not torch.allclose(out[:, 50:], out2[:, 50:])


def test_lstm_mixed_embeddings_are_differentiable():
    model = build_model("lstm_char", (12,), 86)
    a, b = torch.randint(0, 86, (2, 3, 12))
    lam = 0.3
    mixed = (1 - lam) * model.embed(a) + lam * model.embed(b)
    logits = model.forward_embedded(mixed)
    loss = F.cross_entropy(logits.reshape(-1, 86), a.reshape(-1))
    loss.backward()
    assert model.embedding.weight.grad is not None
    assert model.embedding.weight.grad.abs().sum() > 0
