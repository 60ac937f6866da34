"""Hessian estimators behind FedAlign's second-order analysis (Sec. 3.4): exact HVPs, summed over ranks.

:class:`Objective` gives exact Hessian-vector products of the mean loss over a fixed
sample spread over ranks; on it, power iteration for lambda_max (:func:`top_eigenvalue`),
Hutchinson's trace (:func:`hutchinson_trace`) and diagonal (:func:`hessian_diagonal`),
and the matching scores H_N and H_D of Eqs. 3-4 (:func:`hessian_matching`). The
command that runs them on a finished run is :mod:`fedhpc.analysis.hessian`; the tests
check each against Hessians computed exactly.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ConfigError, DataError
from ..losses import task_loss
from ..models.double_backward import double_backward_safe
from ..reproducible_sum import MAX_TERMS, ReproducibleSum
from ..seeding import derive_seed


class Objective:
    """L(w) = (1/N) sum_i loss_i(w) over a fixed sample of N = ``total`` samples; this rank holds
    ``batches`` of it. loss_i is sample i's cross-entropy, for next-character data (targets (B, T))
    the mean over its T positions (:meth:`batch_sum`), so L is the loss training minimises.

    ``world``: the ranks that share the sample, batch b on rank b mod size (None: this
    rank holds all of it). Hessian-vector products are exact (double backward); the
    batches' float64 terms are added by :class:`fedhpc.reproducible_sum.ReproducibleSum`,
    so a result has the same bits however the batches are spread over ranks.
    """

    def __init__(self, model: nn.Module, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]], total: int,
                 world=None):
        self.model, self.batches, self.total, self.world = model, list(batches), int(total), world
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.hvps = 0

    def _split(self, v: torch.Tensor) -> List[torch.Tensor]:
        return [t.view_as(p).to(p.dtype) for t, p in zip(torch.split(v.to(self.params[0].device), self.sizes),
                                                            self.params)]

    def _summed(self, terms, width: int) -> torch.Tensor:
        """The sum over every rank of float64 vectors of ``width`` (this rank's ``terms``), on the CPU."""
        device = self.world.device if self.world is not None else "cpu"
        acc = ReproducibleSum(width, MAX_TERMS, device=device)  # a term per batch: far fewer
        for t in terms:
            acc.add_(t.to(device))
        if self.world is not None:  # a rank without batches still joins the collectives
            acc.align_(self.world)
            self.world.all_reduce_sum_(acc.data)
        return acc.sum().cpu()

    def batch_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """sum_i loss_i over one batch. Training minimises ``task_loss``'s mean over every target of a
        batch, for (B, T, V) outputs over B * T positions; ``reduction="sum"`` alone would sum those B * T
        terms and, divided by N sequences, give T times that loss (T times lambda_max and trace, T^2
        times H_N). Each sequence's sum is divided by its T positions instead: as every sequence has the
        same length, (1/N) sum of per-sequence means is the mean over all N * T target positions of the
        sample, what training minimises over the whole data set. Classification ((B, C) outputs) has
        one target per sample and is left exactly as it was."""
        loss = task_loss(logits, y, reduction="sum")
        if logits.dim() > 2:  # task_loss's own test for sequence outputs
            loss = loss / (logits[0].numel() // logits.shape[-1])
        return loss

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        """H v for a flat float64 vector ``v`` (CPU), summed over the batches of every rank."""
        vs = self._split(v)

        def per_batch():
            for x, y in self.batches:
                with double_backward_safe(self.model, x):  # differentiated twice: no cuDNN RNN on CUDA
                    loss = self.batch_sum(self.model(x), y) / self.total
                grads = torch.autograd.grad(loss, self.params, create_graph=True)
                hv = torch.autograd.grad(grads, self.params, grad_outputs=vs)
                yield torch.cat([h.reshape(-1) for h in hv]).double()

        self.hvps += 1
        return self._summed(per_batch(), self.numel)

    def loss(self) -> float:
        with torch.no_grad():
            terms = (torch.tensor([float(self.batch_sum(self.model(x), y)) / self.total],
                                  dtype=torch.float64) for x, y in self.batches)
            return float(self._summed(terms, 1))


def rademacher(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen).double().mul_(2).sub_(1)


def top_eigenvalue(obj: Objective, iters: int = 100, tol: float = 1e-3, seed: int = 0) -> Tuple[float, torch.Tensor, int]:
    """(lambda, eigenvector, steps): power iteration v <- Hv / ||Hv||, lambda = v^T H v."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "hessian_power"))
    v = torch.randn(obj.numel, generator=gen, dtype=torch.float64)
    v /= v.norm()
    eig: Optional[float] = None
    for step in range(1, iters + 1):
        hv = obj.hvp(v)
        new = float(hv @ v)
        norm = hv.norm()
        if norm == 0:
            return 0.0, v, step
        v = hv / norm
        if eig is not None and abs(new - eig) / (abs(eig) + 1e-6) < tol:
            return new, v, step
        eig = new
    return float(eig), v, iters


def hutchinson_trace(obj: Objective, iters: int = 100, tol: float = 1e-3, seed: int = 0) -> Tuple[float, int]:
    """(trace estimate, samples): the running mean of z^T H z, stopped like PyHessian (tol 0: all iters)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "hutchinson"))
    total, previous = 0.0, None
    for i in range(1, iters + 1):
        z = rademacher(obj.numel, gen)
        total += float(obj.hvp(z) @ z)
        mean = total / i
        if previous is not None and tol > 0 and abs(mean - previous) / (abs(previous) + 1e-6) < tol:
            return mean, i
        previous = mean
    return total / iters, iters


def hessian_diagonal(obj: Objective, samples: int = 100, seed: int = 0, method: str = "hutchinson",
                     key: int = 0) -> torch.Tensor:
    """Diag(H) as a flat float64 vector: Hutchinson's E[z * Hz] over ``samples`` Rademacher z
    (stream seeded by (seed, "hessian_diag", key)), or ``method="exact"``: e_i^T H e_i for every i."""
    if method == "exact":
        out = torch.empty(obj.numel, dtype=torch.float64)
        e = torch.zeros(obj.numel, dtype=torch.float64)
        for i in range(obj.numel):
            e[i] = 1.0
            out[i] = obj.hvp(e)[i]
            e[i] = 0.0
        return out
    if method != "hutchinson":
        raise ConfigError(f"--diag-method must be hutchinson or exact, got {method!r}")
    gen = torch.Generator().manual_seed(derive_seed(seed, "hessian_diag", key))
    acc = torch.zeros(obj.numel, dtype=torch.float64)
    for _ in range(samples):
        z = rademacher(obj.numel, gen)
        acc += z * obj.hvp(z)
    return acc / samples


def layerwise(diag: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The authors' per-tensor reading: the sum of the diagonal over each parameter tensor.

    With the Hutchinson estimate this is exactly their z_l^T (H z)_l averaged over samples."""
    return torch.stack([part.sum() for part in torch.split(diag, list(sizes))])


def hessian_matching(diags: Sequence[torch.Tensor], pairs: str = "distinct") -> Tuple[float, float]:
    """(H_N, H_D) of Eqs. 3-4 over the clients' diagonals, averaged over pairs.

    ``distinct``: the K(K-1)/2 pairs k < j. ``all``: the K^2 ordered pairs, k = j included.
    """
    d = torch.stack([t.double() for t in diags])
    norms = d.norm(dim=1)
    hn = (norms[:, None] - norms[None, :]) ** 2
    hd = (d @ d.T) / (norms[:, None] * norms[None, :]).clamp_min(1e-300)
    k = d.shape[0]
    if pairs == "all":
        return float(hn.mean()), float(hd.mean())
    if pairs != "distinct":
        raise ConfigError(f"--pairs must be distinct or all, got {pairs!r}")
    if k < 2:
        raise DataError("H_N and H_D over distinct pairs need at least two clients; save more client models "
                        "or pass --pairs all")
    iu = torch.triu_indices(k, k, 1)
    return float(hn[iu[0], iu[1]].mean()), float(hd[iu[0], iu[1]].mean())
