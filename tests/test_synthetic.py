"""The synthetic dataset (benchmarks at real input shapes) and ResNet-18 without BatchNorm."""

import numpy as np
import pytest
import torch

from conftest import cfg_for, opts
from fedhpc.data import build_dataset
from fedhpc.errors import ConfigError
from fedhpc.models import build_model


def build(tmp_path, seed=0, num_clients=4, **kw):
    return build_dataset(cfg_for(tmp_path, "synthetic", "iid", num_clients, seed=seed, client_test_fraction=0.0),
                         opts("synthetic", **kw))


def arrays(data):
    parts = [data.client(c) for c in range(data.num_clients)]
    return torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts])


def test_shape_classes_and_every_client_holds_data(tmp_path):
    data = build(tmp_path, shape="3x16x12", classes=7, train_samples=70, test_samples=14, num_clients=5)
    assert data.num_classes == 7 and tuple(data.input_shape) == (3, 16, 12)
    x, y = arrays(data)
    assert x.dtype == torch.float32 and x.shape == (70, 3, 16, 12)
    assert sorted(torch.bincount(y).tolist()) == [10] * 7  # balanced labels
    assert all(data.client(c).num_train > 0 for c in range(5))
    flat = build(tmp_path, shape="64", train_samples=20, test_samples=5)
    assert tuple(flat.input_shape) == (64,)


def test_the_seed_fixes_the_data(tmp_path):
    a, b, c = (build(tmp_path, seed=s, shape="1x8x8", train_samples=40) for s in (1, 1, 2))
    assert all(torch.equal(u, v) for u, v in zip(arrays(a), arrays(b)))
    # the global test set does not depend on the partition: the images themselves must change
    assert torch.equal(a.test_slice(0, 10)[0], b.test_slice(0, 10)[0])
    assert not torch.equal(a.test_slice(0, 10)[0], c.test_slice(0, 10)[0])


@pytest.mark.parametrize("kw,needle", [({"shape": "28x28"}, "CxHxW"), ({"shape": "1xax8"}, "CxHxW"),
                                       ({"shape": "0x8x8"}, "positive"), ({"classes": 1}, "at least 2"),
                                       ({"train_samples": 5, "classes": 10}, "train_samples"),
                                       ({"noise": -1.0}, "noise")])
def test_bad_options_name_the_fix(tmp_path, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        build(tmp_path, **kw)


def test_a_linear_classifier_learns_it(tmp_path):
    """Learnable: least squares on one-hot targets beats chance (10%) by far on the test set."""
    data = build(tmp_path, shape="1x8x8", classes=10, train_samples=2000, test_samples=500, noise=1.0)
    x, y = arrays(data)
    xt, yt = data.test_slice(0, data.num_test())
    xa = np.c_[x.reshape(len(x), -1).numpy(), np.ones(len(x))]
    w, *_ = np.linalg.lstsq(xa, np.eye(10)[y.numpy()], rcond=None)
    xt_a = np.c_[np.asarray(xt).reshape(len(xt), -1), np.ones(len(xt))]
    acc = float((np.argmax(xt_a @ w, 1) == np.asarray(yt)).mean())
    assert acc > 0.3, acc


def test_resnet18_without_batchnorm():
    none = build_model("resnet18", (3, 64, 64), 20, {"norm": "none"})
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in none.modules())
    assert none(torch.randn(2, 3, 64, 64)).shape == (2, 20)
    batch = build_model("resnet18", (3, 64, 64), 20)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in batch.modules())
    with pytest.raises(ConfigError, match="norm"):
        build_model("resnet18", (3, 64, 64), 20, {"norm": "group"})
