"""``torch.optim.SGD`` and ``Adam`` on K clients' stacked (K, P) states, row k as torch steps
client k (masked-out clients and skipped parameters keep everything)."""

from __future__ import annotations

from typing import Optional

import torch


class _StackedOptimizer:
    """What ``torch.optim.SGD`` and ``Adam`` share on a stacked (K, P) state: only the first
    ``num_params`` columns (the parameters; FlatModel puts buffers after them) are stepped, after a
    per-client ``clip_grad_norm_`` and the L2 weight decay added to the gradient; a client whose
    ``active`` flag is False keeps its row and its optimiser state bit for bit. ``columns``
    (num_params,) bool: the parameters the optimiser was given (default all); the others are
    frozen, kept bit for bit like a masked-out client (no state, no weight decay), as a parameter
    left out of torch's optimiser's list is. A step's own ``columns`` narrows them for that step (the
    parameters whose gradient is None then: torch's optimisers skip those): (num_params,) for every
    client, or (K, num_params), a row per client (a block one client dropped)."""

    def __init__(self, num_params: int, lr: float, weight_decay: float, grad_clip: float,
                 columns: Optional[torch.Tensor] = None):
        self.p = num_params
        self.lr, self.weight_decay, self.grad_clip = lr, weight_decay, grad_clip
        self.columns = None if columns is None else columns[None, :]

    def gradient(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
                 columns: Optional[torch.Tensor] = None):
        """(weights view, the gradient the update uses, which entries move: None for all)."""
        w = theta[:, :self.p]
        g = grad[:, :self.p]
        # which entries move: the active clients' rows, the step's or the optimiser's columns (None: all)
        moves = None if active is None else active[:, None]
        columns = self.columns if columns is None else (columns if columns.dim() == 2 else columns[None, :])
        if columns is not None:
            moves = columns if moves is None else moves & columns
        if self.grad_clip > 0:
            # clip_grad_norm_ per client: the 2-norm over all of its parameters' gradients
            norm = torch.linalg.vector_norm(g, 2, dim=1, keepdim=True)
            g = g * (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        if self.weight_decay != 0:
            g = g.add(w, alpha=self.weight_decay)
        return w, g, moves

    @staticmethod
    def keep(moves: Optional[torch.Tensor], new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return new if moves is None else torch.where(moves, new, old)


class StackedSGD(_StackedOptimizer):
    """``torch.optim.SGD`` (momentum, weight decay, Nesterov) on every row of a (K, P) state at
    once, with per-client masking (see :class:`_StackedOptimizer`)."""

    def __init__(self, theta: torch.Tensor, num_params: int, lr: float, momentum: float,
                 weight_decay: float, grad_clip: float, nesterov: bool = False,
                 columns: Optional[torch.Tensor] = None):
        super().__init__(num_params, lr, weight_decay, grad_clip, columns)
        self.momentum, self.nesterov = momentum, nesterov
        # Zeros, not "unset": momentum * 0 + g == g exactly, torch's first-step buffer.
        self.buf = torch.zeros_like(theta[:, :num_params]) if momentum > 0 else None

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
             columns: Optional[torch.Tensor] = None) -> None:
        """``active``: (K,) bool, or None when every client takes this step; ``columns``: see the base."""
        w, g, moves = self.gradient(theta, grad, active, columns)
        if self.buf is not None:
            new_buf = self.buf.mul(self.momentum).add_(g)
            self.buf = self.keep(moves, new_buf, self.buf)
            g = g.add(new_buf, alpha=self.momentum) if self.nesterov else new_buf
        w.copy_(self.keep(moves, w.add(g, alpha=-self.lr), w))


class StackedAdam(_StackedOptimizer):
    """``torch.optim.Adam`` as the sequential path builds it (``--optimizer adam``: betas (0.9,
    0.999), eps 1e-8, no AMSGrad, weight decay added to the gradient) on every row of a (K, P)
    state at once, with per-client masking (see :class:`_StackedOptimizer`).

    Each client counts its own steps: one masked out of a step (fewer batches than the group's
    largest client) takes no step, so its bias corrections 1 - beta^t are those of its own t, as
    in its sequential training. They are computed in float64, as torch computes them from its
    Python step count, and applied per row. torch counts per parameter: one without a gradient at
    a step is skipped and its count stays. From the first step that leaves some parameters out
    (a step's own ``columns``: no gradient, or a block a client dropped) the counts are kept per
    entry, (K, num_params), so each parameter's bias corrections are those of its own steps."""

    betas = (0.9, 0.999)
    eps = 1e-8

    def __init__(self, theta: torch.Tensor, num_params: int, lr: float, weight_decay: float,
                 grad_clip: float, columns: Optional[torch.Tensor] = None):
        super().__init__(num_params, lr, weight_decay, grad_clip, columns)
        self.exp_avg = torch.zeros_like(theta[:, :num_params])
        self.exp_avg_sq = torch.zeros_like(theta[:, :num_params])
        self.steps = torch.zeros(theta.shape[0], 1, dtype=torch.float64, device=theta.device)

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
             columns: Optional[torch.Tensor] = None) -> None:
        """``active``: (K,) bool, or None when every client takes this step; ``columns``: see the base."""
        beta1, beta2 = self.betas
        w, g, moves = self.gradient(theta, grad, active, columns)
        exp_avg = self.exp_avg.lerp(g, 1 - beta1)
        exp_avg_sq = self.exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
        if columns is not None and self.steps.shape[1] == 1:
            self.steps = self.steps.expand(-1, self.p).clone()  # counts per entry from now on
        if self.steps.shape[1] == 1:
            self.steps += 1 if active is None else active[:, None].to(self.steps.dtype)
        else:
            self.steps += 1 if moves is None else moves.to(self.steps.dtype)
        t = self.steps.clamp(min=1)  # a client not stepped yet: any value, its row is kept below
        step_size = (self.lr / (1 - beta1 ** t)).to(w.dtype)
        bias_correction2_sqrt = (1 - beta2 ** t).sqrt().to(w.dtype)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        self.exp_avg = self.keep(moves, exp_avg, self.exp_avg)
        self.exp_avg_sq = self.keep(moves, exp_avg_sq, self.exp_avg_sq)
        w.copy_(self.keep(moves, w - step_size * (exp_avg / denom), w))
