"""The shipped experiment files say which augmentation their paper used and set it.

Issue 7, section 6: a config that silently inherits a dataset's augmentation default
(CIFAR: random crop + flip on) does not reproduce a paper that used none.
"""

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
