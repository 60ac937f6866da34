"""What a ``batched_loss`` hook sees of its K clients (:class:`ClientGroup`), and the per-client
pieces hooks share: one client's weights or random stream for a pass of its own, the weighted task
loss and FedProx's proximal terms, batched."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..round import ClientContext
from .kernels import _generator_at, stacked_params

if TYPE_CHECKING:  # pragma: no cover
    from ..algorithms.base import Algorithm
    from ..flat import FlatModel


@dataclass
class ClientGroup:
    """The K clients of one batched step, as ``Algorithm.batched_loss`` sees them.

    ``forward(x)`` maps inputs (K, B, ...) to logits (K, B, C), row k through client k's
    weights (``forward(x, real=[n_1, ..., n_K])`` for a batch other than the step's, so that
    dropout and BatchNorm know each client's real rows). ``params`` are name -> (K, *shape) views of the stacked flat states (the
    differentiable leaves, in ``flat.entries`` order). ``active[k]`` says whether client k
    takes this step (False: all its rows are padding; the hook must not draw from its random
    streams then). ``real[k]`` is how many of the B rows of client k are real samples.
    ``buffers``: name -> (K, *shape) views of the clients' running statistics (BatchNorm), which a
    training forward updates. ``skip(clients, columns)``: those clients' parameters at ``columns`` took
    no part in this step's loss (a residual block they dropped), so they take no step (see :meth:`skip`).
    ``rng``: each client's generator state (its dropout stream; None when the model draws nothing),
    for a pass a hook runs for one client on its own (:func:`client_stream`).
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: Dict[str, torch.Tensor]
    ctxs: List[ClientContext]
    active: List[bool]
    real: List[int]
    flat: "FlatModel"
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    #: (K, num_params) bool, True where client k's parameter took no part in the step (set by skip)
    skipped: Optional[torch.Tensor] = None
    rng: Optional[List[torch.Tensor]] = None

    def skip(self, clients: List[int], columns: torch.Tensor) -> None:
        """The parameters at ``columns`` ((num_params,) bool on the states' device, e.g.
        ``flat.mask(names)[:flat.num_params]``) of the clients at positions ``clients`` took no part in
        this step's loss: their sequential steps would see these gradients None, which torch's
        optimisers skip (no step, no momentum, no weight decay, no Adam moments or step count); the
        stacked step keeps them so for those clients alone (their gradient rows, zero, add nothing to
        a clipped gradient's norm, as a None gradient does)."""
        if self.skipped is None:
            self.skipped = torch.zeros(len(self.ctxs), self.flat.num_params, dtype=torch.bool, device=columns.device)
        for k in clients:
            self.skipped[k] |= columns


@contextmanager
def client_weights(model: nn.Module, stacked: Dict[str, torch.Tensor], k: int) -> Iterator[nn.Module]:
    """``model`` holding client k's weights, row k of the batched path's (K, *shape) parameter views
    (``ClientGroup.params``), for a pass the grouped kernels do not compute (FedAlign's slimmed last
    block, GradAug's sub-networks); gradients flow back to the views. Buffers stay the model's own."""
    saved = []
    try:
        for mod_name, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    saved.append((module._parameters, pname, p))
                    module._parameters[pname] = stacked[f"{mod_name}.{pname}" if mod_name else pname][k]
        yield model
    finally:
        for slot, pname, p in saved:
            slot[pname] = p


@contextmanager
def client_stream(group: ClientGroup, k: int, device: torch.device) -> Iterator[None]:
    """torch's generator of ``device`` at client ``k``'s state (``group.rng[k]``), for a pass of client
    k's own (a sub-network under :func:`client_weights`): its dropout masks continue client k's stream
    as its sequential step's next forward does. Nothing to swap when the model draws nothing
    (``group.rng`` None)."""
    if group.rng is None:
        yield
        return
    with _generator_at(group.rng, k, device):
        yield


def weighted_task_loss(logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-client cross-entropy (K,): sum_i weight_i * CE_i over each client's B rows.

    With weight 1/n_real on the real rows and 0 on padding this is each client's batch-mean
    loss, as :func:`fedhpc.algorithms.base.task_loss` computes it on the unpadded batch.
    """
    k, b = y.shape[0], y.shape[1]
    per_row = F.cross_entropy(logits.reshape(k * b, logits.shape[-1]), y.reshape(-1), reduction="none")
    return (per_row.view(k, b) * weight).sum(1)


def proximal_terms(group: ClientGroup, algo: "Algorithm", mu: float) -> torch.Tensor:
    """(mu/2) ||w_k - a_k||^2 for every client k (K,): FedProx's term, batched.

    a_k = ``algo.anchor_state(ctx_k)``, as the sequential ``add_proximal_term`` uses: the global
    model, or the model a device kept after a lost broadcast (channel model), per client.
    """
    states = [algo.anchor_state(ctx) for ctx in group.ctxs]
    if all(s is algo.global_state for s in states):
        # one anchor for all: broadcast the global model's views (no (K, P) copy per step)
        anchors = group.flat.param_views(algo.global_state)  # aligned with params (flat.entries order)
    else:
        # (K, P): row k client k's own anchor, read as (K, *shape) views (never differentiated)
        anchors = list(stacked_params(group.flat, torch.stack(states), trainable=set()).values())
    sq = [(p - a).pow(2).flatten(1).sum(1) for p, a in zip(group.params.values(), anchors)]
    return 0.5 * mu * torch.stack(sq, 1).sum(1)


def add_proximal_terms(losses: torch.Tensor, group: ClientGroup, algo: "Algorithm", mu: float) -> torch.Tensor:
    """``losses`` (K,) plus :func:`proximal_terms`; ``losses`` when mu is 0 (the batched twin of
    :func:`fedhpc.algorithms.fedprox.add_proximal_term`: "+ FedProx" options of the mixing methods)."""
    return losses if mu == 0 else losses + proximal_terms(group, algo, mu)
