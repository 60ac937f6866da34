"""Which rank owns a client's rows, and the one order gathered rows are put in: for every exchange.

A client's rows are computed (and, in the ledger, sent) by one rank fixed by its id,
and rows gathered from all ranks are sorted by (client, position) on every rank, so
an exchange's result is the same for any rank count.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch


def canonical_order(major: torch.Tensor, minor: torch.Tensor) -> torch.Tensor:
    """Permutation sorting gathered rows by (major, minor): the same order for any rank count."""
    span = int(minor.max()) + 1 if len(minor) else 1
    return torch.argsort(major * span + minor)


def owner_rank(cid, world_size: int):
    """The rank that computes (and, in the ledger, sends) client ``cid``'s rows (ids: an int or an array)."""
    return cid % world_size


def invert_owners(owners: torch.Tensor) -> Tuple[np.ndarray, torch.Tensor]:
    """CSR index client -> ascending positions of the entries listing it, in one sort of the table.

    A key ``owner * E + position`` sorts by client, then position; ``unique`` also
    drops a client listed twice in one entry, so each position appears once per client.
    Negative owners (padding) are left out. Also the privacy audit's grouping of samples by
    the devices behind them (fedhpc.analysis.privacy).
    """
    e, m = owners.shape
    own = owners.detach().to("cpu").reshape(-1)
    pos = torch.arange(e).repeat_interleave(m)
    keep = own >= 0
    key = torch.unique(own[keep] * max(e, 1) + pos[keep])  # sorted
    owner_sorted = key // max(e, 1)
    n = int(owner_sorted[-1]) + 1 if len(key) else 0
    ptr = torch.searchsorted(owner_sorted, torch.arange(n + 1)).numpy()
    return ptr, (key - owner_sorted * max(e, 1)).to(owners.device)
