"""The shipped experiment files (launch/): each says which augmentation its paper used and sets
it, carries its table's identity, and builds its run on tiny files in the published formats.

Issue 7, section 6: a config that silently inherits a dataset's augmentation default
(CIFAR: random crop + flip on) does not reproduce a paper that used none.
"""

import json
import os
from dataclasses import fields

import pytest
import yaml

from fedhpc.config import parse_args

LAUNCH_DIR = os.path.join(os.path.dirname(__file__), "..", "launch")
FILES = sorted(f for f in os.listdir(LAUNCH_DIR) if f.endswith(".yaml"))
AUGMENTATION = ("crop_padding", "flip")


def load(name):
    path = os.path.join(LAUNCH_DIR, name)
    text = open(path).read()
    cfg, _, data_opts = parse_args(["--config", path])
    return text, yaml.safe_load(text), cfg, data_opts


@pytest.mark.parametrize("name", FILES)
def test_every_config_states_and_sets_its_augmentation(name):
    text, raw, _, data_opts = load(name)
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert any("Augmentation:" in line for line in comments), f"{name}: no '# Augmentation:' comment"
    has = {f.name for f in fields(data_opts)} & set(AUGMENTATION)
    # Where the dataset has augmentation options, the file sets every one explicitly.
    assert has <= set(raw.get("data_options") or {}), f"{name} leaves {sorted(has)} to the defaults"


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("fedmix_")])
def test_fedmix_configs_train_on_all_data_without_augmentation(name):
    """FedMix Sec. 4: "No validation data was split and we used all training data for
    local training"; the paper mentions no augmentation."""
    _, _, cfg, data_opts = load(name)
    assert cfg.client_test_fraction == 0.0
    assert getattr(data_opts, "crop_padding", 0) == 0
    assert getattr(data_opts, "flip", False) is False


def test_cifar_defaults_would_augment_so_the_check_means_something():
    """The CIFAR option defaults are crop + flip: without the explicit settings above the
    FedMix CIFAR files would train with augmentation."""
    from fedhpc.data.readers import Cifar10Options, Cifar100Options

    for cls in (Cifar10Options, Cifar100Options):
        assert cls().crop_padding > 0 and cls().flip is True


@pytest.mark.parametrize("name", [f for f in FILES if not f.startswith("digits_") and "_digits" not in f])
def test_paper_configs_carry_their_tables_identity(name):
    """A report puts the paper's number beside each row: every paper config names its table row."""
    _, _, cfg, _ = load(name)
    ref = cfg.reference
    assert {"paper", "table", "row", "metric"} <= set(ref), f"{name}: reference {ref}"
    if ref["table"].startswith("Table"):  # figures (Mix2FLD Fig. 2) have no printed number
        assert isinstance(ref.get("value"), (int, float)), f"{name}: the paper's number is missing"


# ---------------------------------------------------------------- every file builds its run

@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """Tiny files in the published formats, large enough for every shipped partition (pMixFed's
    classes:50 over 100 clients, XorMixFL's server set of 200 per label, 110 FEMNIST writers, 70
    Shakespeare roles); ImageNet-200 prepared at 256 px, as the files' center_crop 224 needs."""
    import string

    import numpy as np

    from fedhpc.data.prepare import main as prepare
    from test_formats import (make_mnist, write_cifar10, write_cifar100, write_image_tree, write_tff_femnist,
                              write_tff_shakespeare)

    root = tmp_path_factory.mktemp("datasets")
    make_mnist(str(root), n_train=10000, n_test=200)
    write_cifar10(str(root), per_batch=600, n_test=200)
    write_cifar100(str(root), n_train=6000, n_test=200, test_start=50000)
    write_tff_femnist(str(root / "femnist"), sizes={f"f{i:04d}_{i % 50:02d}": 20 + i % 7 for i in range(110)})
    rng = np.random.default_rng(0)
    alphabet = list(string.ascii_letters + " .,;!?'\n")
    write_tff_shakespeare(str(root / "shakespeare"),
                          roles={f"ROLE_{r}": ["".join(rng.choice(alphabet, size=200)) for _ in range(3)] for r in range(70)})
    write_image_tree(str(root / "imagenet"), classes=tuple(f"n{i:05d}" for i in range(210)), n_train=3, n_val=1)
    assert prepare(["imagenet200", "--src", str(root / "imagenet"), "--out", str(root / "imagenet200.h5"),
                    "--size", "256", "--num-classes", "200", "--seed", "0"]) == 0
    return str(root)


@pytest.mark.parametrize("name", FILES)
def test_every_config_builds_its_run(name, data_dirs):
    """Parsing a file checks its settings one by one; building the engine checks them together, as
    the job would after its queue wait: the dataset read from its files and partitioned, the model
    built for its input, the algorithm set up on that model (FedAlign's residual last block,
    pMixFed's layers, XorMixFL's server set). No round is trained."""
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, algo_opts, data_opts = parse_args(["--config", os.path.join(LAUNCH_DIR, name), "--data-dir", data_dirs,
                                            "--quiet", "--no-tensorboard", "--threads", "1"])
    eng = Engine(cfg, algo_opts, data_opts, World(threads=1))
    assert eng.global_state.numel() > 0 and eng.data.num_clients == cfg.num_clients


# ---------------------------------------------------------------- one run, one paper number

def run_settings(name):
    """What a file's run computes: its resolved settings (every option at its value, defaults
    included) without the reference, the settings that only say how or where it runs (RUN_LOCAL,
    the seed kept), and the algorithm options that cannot change its numbers given the others
    (``inert_options``: XorMixFL's alpha at M = 1, where a blend of one sample is that sample)."""
    import dataclasses

    from fedhpc.report.runs import RUN_LOCAL
    from fedhpc.registry import ALGORITHMS

    cfg, algo_opts, data_opts = parse_args(["--config", os.path.join(LAUNCH_DIR, name)])
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_LOCAL or k == "seed"}
    settings.pop("algo_options", None), settings.pop("data_options", None)
    settings["algo"] = ALGORITHMS.canonical(cfg.algo)
    inert = set(getattr(algo_opts, "inert_options", lambda: ())()) if algo_opts is not None else set()
    if algo_opts is not None:
        settings["algo_options"] = {k: v for k, v in dataclasses.asdict(algo_opts).items() if k not in inert}
    if data_opts is not None:
        settings["data_options"] = dataclasses.asdict(data_opts)
    return json.dumps(settings, sort_keys=True, default=str), cfg.reference


def test_launch_files_that_run_the_same_carry_the_same_reference_number():
    """A launch file whose run cannot differ from another's must not carry a different paper number:
    a report would set two numbers beside one experiment. (Table 4 of the XorMixFL paper varies
    alpha at M = 1, where XorMixFL blends nothing: its three M = 1 cells per number of dummy labels
    are one run.)"""
    groups = {}
    for name in FILES:
        key, ref = run_settings(name)
        groups.setdefault(key, []).append((name, ref))
    clashes = []
    for members in groups.values():
        numbers = {(ref.get("metric"), ref.get("stat"), ref.get("value")) for _, ref in members
                   if ref.get("value") is not None}
        if len({(m, s) for m, s, _ in numbers}) < len(numbers):
            clashes.append(sorted(f"{name} ({ref.get('value')})" for name, ref in members))
    assert not clashes, f"launch files that run the same experiment carry different reference numbers: {clashes}"


def test_xormixfl_alpha_blends_nothing_at_m1_and_mixfl_alpha_is_its_mixup_ratio():
    """The inertness run_settings relies on, checked on the codec: at M = 1 XorMixFL's uploads
    and decodings are the same bits for every alpha and blend rule; MixFL's are not (alpha is its
    ratio on the target, Table 4), nor XorMixFL's at M = 5 unless the blend is a saturating sum."""
    import torch

    from fedhpc.algorithms.oneshot.mixfl import MixFLOptions
    from fedhpc.algorithms.oneshot.base import EncodingOptions
    from fedhpc.algorithms.oneshot.sample_codecs import encode_device, xor_decode

    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (60, 1, 6, 6), generator=g, dtype=torch.uint8)
    labels = torch.arange(60) % 4

    def run(kind, alpha, m, rule="average"):
        lam = MixFLOptions(blend_alpha=alpha, max_blend=m).ratio()
        enc = encode_device(pixels, labels, {0: 8}, [0], 2, m, alpha, torch.Generator().manual_seed(1), 0,
                            kind=kind, lam=lam, num_classes=4, rule=rule)
        if kind == "mix":
            return enc.x, enc.soft
        return enc.x, xor_decode(enc, pixels, labels, m, alpha, torch.Generator().manual_seed(2), rule)[0]

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a, b))

    assert same(run("xor", 0.25, 1), run("xor", 0.95, 1))
    assert EncodingOptions(blend_alpha=0.25, max_blend=1).inert_options() == ("blend_alpha", "blend_rule")
    assert same(run("xor", 0.25, 1), run("xor", 0.25, 1, "saturating_sum"))
    assert not same(run("xor", 0.25, 5), run("xor", 0.95, 5))
    assert EncodingOptions(blend_alpha=0.25, max_blend=5).inert_options() == ()
    # a saturating sum takes no ratio: XorMixFL's alpha is inert, MixFL's still mixes target and dummies
    assert same(run("xor", 0.25, 5, "saturating_sum"), run("xor", 0.95, 5, "saturating_sum"))
    assert not same(run("xor", 0.25, 5, "saturating_sum"), run("xor", 0.25, 5))
    assert EncodingOptions(blend_alpha=0.25, max_blend=5, blend_rule="saturating_sum").inert_options() == ("blend_alpha",)
    assert not same(run("mix", 0.25, 5, "saturating_sum"), run("mix", 0.95, 5, "saturating_sum"))
    assert MixFLOptions(blend_alpha=0.25, max_blend=5, blend_rule="saturating_sum").inert_options() == ()
    assert not same(run("mix", 0.25, 1), run("mix", 0.95, 1))
    assert MixFLOptions(blend_alpha=0.25, max_blend=1).inert_options() == ("blend_rule",)
    assert MixFLOptions(blend_alpha=0.25, max_blend=1, mix_lam=0.5).inert_options() == ("blend_alpha", "blend_rule")
