"""Mixup losses of the FedMix paper, as pure functions of a model callable ``f``.

Every function takes inputs already in the *mixing space* (model input for
images, embeddings for text; see :class:`MixSpace`) and labels as probability
vectors (one-hot for local samples, mean one-hot for averaged data), shape
(B, C) or, for next-character prediction, (B, T, V). Cross-entropy is linear in
its target, so ``L(f(x), (1-l) y1 + l y2) = (1-l) L(f(x), y1) + l L(f(x), y2)``.

* :func:`mixup_loss`        two-point mixup, x = (1-l) x1 + l x2 (LocalMix, GlobalMix).
* :func:`naivemix_loss`     Eq. 1: mixup of local samples with received means.
* :func:`fedmix_loss`       Alg. 2 / Eq. 5: the first-order approximation of global mixup.
* :func:`global_mixup_loss` Eq. 3 averaged over a set J of other samples (what FedMix approximates).

All losses are means over the batch (and over sequence positions for text), as
:func:`fedhpc.algorithms.base.task_loss` is.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...data.base import host_to_device
from ...errors import ConfigError
from ...models.double_backward import double_backward_safe
from ..base import soft_loss

Model = Callable[[torch.Tensor], torch.Tensor]


def one_hot(y: torch.Tensor, num_classes: int, dtype=torch.float32) -> torch.Tensor:
    return F.one_hot(y.long(), num_classes).to(dtype)


def mixup_loss(f: Model, x1, y1, x2, y2, lam: float) -> torch.Tensor:
    """(1-l) L(f(x~), y1) + l L(f(x~), y2) with x~ = (1-l) x1 + l x2 (x2, y2 broadcast)."""
    logits = f((1 - lam) * x1 + lam * x2)
    return (1 - lam) * soft_loss(logits, y1) + lam * soft_loss(logits, y2)


def naivemix_loss(f: Model, x, y, xbar, ybar, lam: float) -> torch.Tensor:
    """Eq. 1: mixup of local (x, y) with a received mean (xbar, ybar), one per batch or per sample."""
    return mixup_loss(f, x, y, xbar, ybar, lam)


def fedmix_loss(f: Model, x, y, xbar, ybar, lam: float,
                return_terms: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Eq. 5 / Alg. 2, with x' = (1-l) x:

        l1 = (1-l) L(f(x'), y)
        l2 = l L(f(x'), ybar)
        l3 = l <dL/dx at (x', y), xbar>

    ``dL/dx`` is the derivative of the *loss* with respect to the model input, taken
    with ``create_graph=True``: l3 depends on the weights only through that
    derivative, so its weight-gradient is second order (a Hessian-vector product
    computed by double backward). Without ``create_graph`` l3 would be a constant
    and would not train anything.

    ``L`` here is the batch-mean loss, so dL/dx_i = (1/B) dL_i/dx_i and
    ``sum_i <dL/dx_i, xbar_i>`` is the batch mean of the per-sample l3 terms.

    Computed as l1 + l2 = L(f(x'), (1-l) y + l ybar) (soft cross-entropy is linear in its
    target) with one log-softmax, x' and the mixed label from one fused op, and l3 from the
    fused per-sample reduction (:mod:`fedhpc.ops`: native kernels when built, the pure-PyTorch
    reference otherwise; both differentiable to any order). ``return_terms`` adds l1, l2 and
    l3 separately (l2 evaluated on its own, so l1 + l2 matches the total up to rounding).

    The forward runs under :func:`fedhpc.models.double_backward.double_backward_safe`: on CUDA,
    a model with an RNN (``f`` a module or a bound method of one, e.g. ``forward_embedded``)
    runs it without cuDNN, whose RNN kernels have no double backward.
    """
    from ... import ops  # here, not at the top, so that only this function of the file changes

    xp, ymix = ops.mix_inputs_labels(x, y, ybar, lam)
    if not xp.requires_grad:  # raw images: make the scaled input a leaf we can differentiate at
        xp = xp.detach().requires_grad_(True)
    with double_backward_safe(f, xp):  # l3's backward is differentiated again: no cuDNN RNN (LSTM on CUDA)
        logp = F.log_softmax(f(xp), dim=-1)
    ce = -(y * logp).sum(-1).mean()             # L at (x', y): the loss l3 differentiates
    l12 = -(ymix * logp).sum(-1).mean()         # l1 + l2 against the mixed soft label
    (dx,) = torch.autograd.grad(ce, xp, create_graph=True)
    l3 = ops.fedmix_l3(dx, xbar, lam).sum()
    total = l12 + l3
    if return_terms:
        l1 = (1 - lam) * ce
        l2 = lam * -(ybar * logp).sum(-1).mean()
        return total, {"l1": l1, "l2": l2, "l3": l3}
    return total


def global_mixup_loss(f: Model, x, y, xs, ys, lam: float) -> torch.Tensor:
    """Eq. 3 averaged over J: mean_i mean_j L(f((1-l) x_i + l x_j), (1-l) y_i + l y_j).

    ``xs``/``ys`` hold the |J| raw samples of the other client(s); builds B*|J| inputs.
    """
    b, m = x.shape[0], xs.shape[0]
    xm = (1 - lam) * x.unsqueeze(1) + lam * xs.unsqueeze(0)          # (B, M, ...)
    ym = (1 - lam) * y.unsqueeze(1) + lam * ys.unsqueeze(0)
    return soft_loss(f(xm.reshape((b * m,) + tuple(x.shape[1:]))), ym.reshape((b * m,) + tuple(y.shape[1:])))


# --------------------------------------------------------------------------- K clients at once
# The same losses for fedhpc.batched: inputs (K, B, ...), soft labels (K, B, C), ``forward``
# maps (K, B, ...) to (K, B, C) through each client's own weights, ``weight`` (K, B) holds
# 1/n_real on a client's real rows and 0 on padding, and each returns the K per-client losses.
# ``lam`` is a float or a (K,) tensor (LocalMix's Beta draws, one per client).

def _per_client(lam, like: torch.Tensor):
    """``lam`` broadcastable against ``like`` (K, B, ...): a float stays a float."""
    if not isinstance(lam, torch.Tensor):
        return lam
    return lam.to(like.dtype).view((-1,) + (1,) * (like.dim() - 1))


def _weighted_soft_ce(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i weight_i * CE(logp_i, target_i) per client (K,): the batch mean over real rows."""
    return (-(target * logp).sum(-1) * weight).sum(1)


def permuted_rows(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each client's rows and soft labels in its own order: the batched ``x[perm], y[perm]`` of
    LocalMix and Mixup. ``perm`` (K, B) is built on the host (client k's draw over its real rows,
    padded rows mapped to themselves) and sent to the device in one copy."""
    k, b = perm.shape
    perm = host_to_device(perm, x.device)
    x2 = torch.gather(x, 1, perm.view((k, b) + (1,) * (x.dim() - 2)).expand_as(x))
    y2 = torch.gather(y, 1, perm.unsqueeze(-1).expand_as(y))
    return x2, y2


def batched_mixup_loss(forward, x1, y1, x2, y2, lam, weight) -> torch.Tensor:
    """:func:`mixup_loss` for K clients (x2, y2 with 1 or B rows per client)."""
    lx = _per_client(lam, x1)
    logp = F.log_softmax(forward((1 - lx) * x1 + lx * x2), dim=-1)
    lk = lam if not isinstance(lam, torch.Tensor) else lam.to(logp.dtype)
    return (1 - lk) * _weighted_soft_ce(logp, y1, weight) + lk * _weighted_soft_ce(logp, y2, weight)


def batched_fedmix_loss(forward, x, y, xbar, ybar, lam: float, weight) -> torch.Tensor:
    """:func:`fedmix_loss` for K clients: l1 + l2 against the mixed label, and l3 from the
    input gradient of each client's own weighted CE. Summing the K CEs before differentiating
    changes nothing: client k's CE depends on x'_k only. Padded rows have weight 0, so their
    input gradient, hence their l3 share, is 0: l3 is the sum over the real rows as in Eq. 5."""
    xp = ((1 - lam) * x).detach().requires_grad_(True)
    ymix = (1 - lam) * y + lam * ybar
    logp = F.log_softmax(forward(xp), dim=-1)
    ce = _weighted_soft_ce(logp, y, weight)
    l12 = _weighted_soft_ce(logp, ymix, weight)
    (dx,) = torch.autograd.grad(ce.sum(), xp, create_graph=True)
    l3 = lam * (dx * xbar).flatten(2).sum(2).sum(1)
    return l12 + l3


# --------------------------------------------------------------------------- where mixing happens

class MixSpace:
    """Where the mixing happens for a dataset's task.

    Images (task 'classification'): the model input itself; ``f`` is the model.
    Text ('next_char', inputs are character ids): embedding space. The model must
    expose ``embed(ids) -> (B, T, D)`` (a token-wise lookup, no positional terms)
    and ``forward_embedded(emb) -> logits``. Mean data for text are mean one-hot
    characters (T, V) (see :mod:`fedhpc.exchanges.mean_data`); ``lift_means`` turns them into
    mean embeddings ``P @ E`` with the current embedding table E, which is exactly
    the mean embedding of the averaged sequences.
    """

    def __init__(self, task: str, num_classes: int):
        self.text = task == "next_char"
        self.num_classes = num_classes

    def check(self, model: nn.Module, named: str) -> None:
        """Refuse a text model that cannot be mixed in embedding space; ``named``: the model as the
        message names it (:attr:`Algorithm.model_named`)."""
        if self.text and not (hasattr(model, "embed") and hasattr(model, "forward_embedded")):
            raise ConfigError(f"mixup on text needs a model with embed() and forward_embedded(); the run's model "
                              f"{named} has not: pass --model lstm_char")

    def f(self, model: nn.Module) -> Model:
        return model.forward_embedded if self.text else model

    def lift(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Local inputs (transformed batch / character ids) in mixing space."""
        return model.embed(x) if self.text else x

    def lift_means(self, model: nn.Module, xbar: torch.Tensor) -> torch.Tensor:
        """Received means in mixing space: images as they are, text P (.., T, V) -> P @ E."""
        if not self.text:
            return xbar
        ids = torch.arange(self.num_classes, device=xbar.device).unsqueeze(0)
        table = model.embed(ids)[0]                                       # (V, D)
        return xbar.to(table.dtype) @ table

    def labels(self, y: torch.Tensor, dtype) -> torch.Tensor:
        return one_hot(y, self.num_classes, dtype)
