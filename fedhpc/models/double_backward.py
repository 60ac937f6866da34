"""Forward passes whose graph is differentiated twice: keep cuDNN's RNN kernels out of them.

FedMix's l3 term (:func:`fedhpc.algorithms.mafl.mixing.fedmix_loss`) and the Hessian-vector
products of :mod:`fedhpc.analysis.hessian_estimators` differentiate a backward pass again. cuDNN's
RNN kernels have no double backward: on CUDA, a graph recorded through ``nn.LSTM`` /
``nn.GRU`` / ``nn.RNN`` with cuDNN on raises "Double backwards is not supported for CuDNN
RNNs" at the second differentiation (and cuDNN's RNN backward also refuses a model in eval
mode, which the Hessian analysis uses). PyTorch's advice in that error is to run the RNN's
forward with cuDNN disabled: the native kernels recorded then have a differentiable backward.

:func:`double_backward_safe` does that around a forward, only where it is needed: a model
holding an ``nn.RNNBase`` module, run on CUDA. Everywhere else it changes nothing, so
convolutions keep cuDNN, and CPU runs are untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn


def _module_of(model: Any) -> Optional[nn.Module]:
    """The module behind ``model``: itself, or the owner of a bound method (the mixing losses
    receive a text model as ``model.forward_embedded``). None for any other callable."""
    if isinstance(model, nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _on_cuda(device: Any) -> bool:
    """Whether a forward on ``device`` (a torch.device, its name, or a tensor on it) runs on CUDA."""
    if isinstance(device, torch.Tensor):
        device = device.device
    return torch.device(device).type == "cuda"


def has_rnn(model: Any) -> bool:
    """Whether ``model`` (a module or a bound method of one) holds a recurrent layer."""
    module = _module_of(model)
    return module is not None and any(isinstance(m, nn.RNNBase) for m in module.modules())


@contextlib.contextmanager
def double_backward_safe(model: Any, device: Any) -> Iterator[None]:
    """Run the forward of ``model`` on ``device`` inside this block so that its graph can be
    differentiated twice: cuDNN is disabled while the block runs when the model holds an RNN
    and runs on CUDA; otherwise this is a no-op. Only the forward needs it: the backward of
    the kernels recorded without cuDNN is differentiable wherever it later runs.

    Only ``torch.backends.cudnn.enabled`` is touched (``cudnn.flags`` would also reset the
    benchmark, determinism and TF32 flags that :mod:`fedhpc.world` sets), and its previous
    value comes back on exit, exceptions included.
    """
    if not (_on_cuda(device) and has_rnn(model)):
        yield
        return
    previous = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = previous
