"""Per-label average outputs: the exchange of federated distillation (Mix2FLD paper, Eqs. 2-3).

Device side (Eq. 2): while it trains, a device averages its softmax output vectors
separately for each ground-truth label, F_bar_{d,n} = mean of F_d over its iterations
whose sample has label n. It uploads the N_L x N_L table of those averages (32-bit
each: ``N_L**2 * 4`` bytes on the wire, as the paper counts b_out N_L^2 bits).

Server side (Eq. 3): G_out,n = the mean of F_bar_{d,n} over the devices whose upload
arrived *and that saw label n* (the paper writes |D^p| in the denominator, i.e.
every device has every label; with label skew a device without label n has no
F_bar_{d,n} to send, and counting it as a zero vector would shrink G_out,n, so it
is left out, as public FD implementations do). Labels no device saw have no global
output; a distillation loss skips them.

In the engine the exchange rides on the round's one all-reduce: every device adds
its table (rows of absent labels zero) and a presence vector to two *unweighted*
upload slots, so the server's division gives Eq. 3. Entries are probabilities, so the
slots declare ``bound=1``: the engine rounds each table to a grid (2**-48 for 10
devices) on which the sum is exact, and G_out has the same bits for any number of ranks.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..round import Upload


class LabelOutputs:
    """One device's running per-label output sums during local training (Eq. 2)."""

    def __init__(self, num_classes: int, device, dtype=torch.float64):
        self.num_classes = num_classes
        self.sums = torch.zeros(num_classes, num_classes, dtype=dtype, device=device)
        self.counts = torch.zeros(num_classes, dtype=dtype, device=device)

    @torch.no_grad()
    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        """Add this iteration's softmax outputs of a batch, by ground-truth label; for next-character
        prediction ((B, T, C) logits, (B, T) labels) every position is an output of its label."""
        probs = F.softmax(logits.detach(), dim=-1).to(self.sums.dtype)
        if probs.dim() > 2:  # (B, T, C): no reshape for classification, a step's host cost counts
            probs, y = probs.reshape(-1, self.num_classes), y.reshape(-1)
        self.sums.index_add_(0, y, probs)
        self.counts.index_add_(0, y, torch.ones_like(y, dtype=self.sums.dtype))

    def table(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(F_bar: N_L x N_L per-label averages, zero rows for unseen labels; presence 0/1)."""
        present = (self.counts > 0).to(self.sums.dtype)
        return self.sums / self.counts.clamp_min(1).unsqueeze(1), present


class GroupLabelOutputs:
    """The running sums of K devices trained at once (``--clients-at-once``, fedhpc.batched).

    Each device keeps its own :class:`LabelOutputs` (its upload reads it as the sequential path's
    does), but their sums become views of one (K, N_L, N_L) tensor, so that a batched step adds
    all K devices' outputs with one ``index_add_`` instead of K small ones (a host round trip
    each on a GPU). Padding rows are added as zeros (a probability times 0: exactly +0), so each
    device's sums take the same values in the same order as its sequential steps add them.
    """

    def __init__(self, outputs: Sequence[LabelOutputs]):
        self.num_classes = outputs[0].num_classes
        self.sums = torch.stack([o.sums for o in outputs])
        self.counts = torch.stack([o.counts for o in outputs])
        for o, sums, counts in zip(outputs, self.sums, self.counts):
            o.sums, o.counts = sums, counts
        k, c = len(outputs), self.num_classes
        self.row_base = (torch.arange(k, device=self.sums.device) * c)[:, None]  # device k's rows start at k * N_L

    @torch.no_grad()
    def add(self, logits: torch.Tensor, y: torch.Tensor, real: torch.Tensor) -> None:
        """Eq. 2 for every device of a step: logits (K, B, N_L), labels (K, B), ``real`` (K, B)
        True on each device's real rows, False on padding."""
        c = self.num_classes
        keep = real.to(self.sums.dtype)
        probs = F.softmax(logits.detach(), dim=-1).to(self.sums.dtype) * keep[..., None]
        index = (y + self.row_base).reshape(-1)
        self.sums.view(-1, c).index_add_(0, index, probs.reshape(-1, c))
        self.counts.view(-1).index_add_(0, index, keep.reshape(-1))


def group_distillation_loss(logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                            teachers: Sequence[Optional[Tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    """:func:`distillation_loss` of K devices at once (K,): device k's outputs (B, N_L) against
    its own teacher ``teachers[k]`` (a (G_out, mask) pair, or None: no term), each the mean over
    its real rows (``weight`` 1/n_real on them, 0 on padding; the sequential batch mean)."""
    k = logits.shape[0]
    first = next((t for t in teachers if t is not None), None)
    if first is None:
        return logits.new_zeros(k)
    if all(t is first for t in teachers):  # one broadcast table for the whole group: no (K, N_L, N_L) copy
        rows, mask = first[0][y], first[1][y]
    else:
        tables = torch.stack([t[0] if t is not None else torch.zeros_like(first[0]) for t in teachers])
        masks = torch.stack([t[1] if t is not None else torch.zeros_like(first[1]) for t in teachers])
        device = torch.arange(k, device=y.device)[:, None]
        rows, mask = tables[device, y], masks[device, y]
    return (_psi(logits, rows) * mask.to(logits.dtype) * weight).sum(1)


def upload_spec(num_classes: int, kind: str = "outputs") -> Dict[str, Upload]:
    """The two round-buffer slots of the exchange: summed over devices, not weighted."""
    return {
        "label_outputs": Upload(num_classes * num_classes, kind, weighted=False,
                                wire_bytes=num_classes * num_classes * 4, bound=1.0),
        # which labels a device's table covers: implied by its rows, nothing extra is sent
        "label_presence": Upload(num_classes, kind, weighted=False, wire_bytes=0, bound=1.0),
    }


def upload(outputs: LabelOutputs) -> Dict[str, torch.Tensor]:
    table, present = outputs.table()
    return {"label_outputs": table, "label_presence": present}


def global_outputs(totals: Dict[str, torch.Tensor], num_classes: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Eq. 3 from the round's sums: (G_out N_L x N_L, 0/1 mask of labels with a global output),
    or None when no device's outputs arrived this round."""
    present = totals["label_presence"].double()
    if float(present.sum()) == 0:
        return None
    sums = totals["label_outputs"].double().view(num_classes, num_classes)
    return sums / present.clamp_min(1).unsqueeze(1), (present > 0).double()


def distillation_loss(logits: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The batch mean of psi of Eq. 3: cross-entropy -sum_m G_m log F_m of each sample's output
    against its teacher row, 0 for a sample whose label has no global output (``mask`` 0).

    Divided by the batch size, not by the samples that have a teacher: Eq. 3 adds beta psi to
    each sample's loss and the batch loss is their mean (as FLD's Eq. 5 on the server), so a
    batch where few labels have a global output is not distilled harder (dividing by the 4 of
    32 that had one made beta effectively 8 times larger). For next-character prediction every
    position is a sample: the mean is over positions, as the task loss's is."""
    per_sample = _psi(logits, teacher)
    if mask.dtype != logits.dtype:  # a no-op .to() is still a dispatch a step
        mask = mask.to(logits.dtype)
    return (per_sample * mask).sum() / max(per_sample.numel(), 1)


def _psi(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """psi of Eq. 3 per sample: -sum_m G_m log F_m of each output against its teacher row."""
    if teacher.dtype != logits.dtype:
        teacher = teacher.to(logits.dtype)
    return -(teacher * F.log_softmax(logits, -1)).sum(-1)
