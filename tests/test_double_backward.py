"""fedhpc.models.double_backward: cuDNN is off exactly while an RNN model's forward runs on CUDA.

There is no GPU here: the device test is driven with device arguments (``torch.device("cuda")``
needs no GPU to exist) and, where a forward has to run, by making the helper's device check
answer "CUDA" for CPU tensors (monkeypatch); the CUDA kernels themselves are not exercised.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhpc.models import build_model
from fedhpc.models.double_backward import double_backward_safe, has_rnn


class LSTMClassifier(nn.Module):
    """An RNN nested inside another module (as CharLSTM's ModuleList holds its layers)."""

    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.body = nn.ModuleDict({"rnn": cell(3, 4, batch_first=True)})
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h, _ = self.body["rnn"](x)
        return self.head(h[:, -1])


@pytest.fixture
def cudnn_on():
    before = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = True
    yield
    torch.backends.cudnn.enabled = before


def inside(model, device):
    with double_backward_safe(model, device):
        return torch.backends.cudnn.enabled


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_cudnn_is_disabled_only_for_a_model_with_an_rnn_on_cuda(cudnn_on, cell):
    rnn, mlp = LSTMClassifier(cell), nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    char = build_model("lstm_char", (6,), 7, {"hidden": 8, "embed_dim": 4})
    for device in ("cuda", torch.device("cuda:0")):
        assert inside(rnn, device) is False
        assert inside(char.forward_embedded, device) is False  # a bound method: how FedMix gets text models
        assert inside(mlp, device) is True                       # convolutions and the rest keep cuDNN
        assert inside(lambda x: rnn(x), device) is True          # an opaque callable: nothing to see
    for device in ("cpu", torch.device("cpu"), torch.zeros(1)):
        assert inside(rnn, device) is True
    assert torch.backends.cudnn.enabled is True                  # restored on exit
    assert has_rnn(rnn) and has_rnn(char) and has_rnn(char.forward_embedded) and not has_rnn(mlp)


def test_the_previous_setting_comes_back_also_after_an_error(cudnn_on):
    rnn = LSTMClassifier()
    torch.backends.cudnn.enabled = False  # a run that turned cuDNN off itself keeps it off
    assert inside(rnn, "cuda") is False
    assert torch.backends.cudnn.enabled is False
    torch.backends.cudnn.enabled = True
    with pytest.raises(RuntimeError, match="boom"):
        with double_backward_safe(rnn, "cuda"):
            raise RuntimeError("boom")
    assert torch.backends.cudnn.enabled is True
