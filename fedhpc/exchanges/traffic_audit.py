"""The traffic audit: what every row a client puts into a collective was computed from (for tests).

Exchanges report each row they send with :func:`record_sent`; inside
``with audit_traffic() as audit`` the rows and the indices of the raw samples behind
them are kept in ``audit.records``, so a privacy test can check that no raw sample
leaves a client where the method says none does. Outside an audit this costs one test.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List

import numpy as np
import torch


@dataclass
class SentRecord:
    """One row a client put into a collective: what it is, and the raw samples behind it."""

    cid: int
    kind: str                # ledger kind: "mean_data" or "raw_samples"
    row: torch.Tensor        # the exact row handed to the collective (CPU copy)
    x: torch.Tensor          # the input part of the row, unpacked (CPU)
    sources: np.ndarray      # indices into the client's training data that the row is computed from


class TrafficAudit:
    def __init__(self):
        self.records: List[SentRecord] = []


_AUDITS: List[TrafficAudit] = []


@contextlib.contextmanager
def audit_traffic() -> Iterator[TrafficAudit]:
    """Record every row clients send through the mean-data / raw-sample collectives (tests)."""
    audit = TrafficAudit()
    _AUDITS.append(audit)
    try:
        yield audit
    finally:
        _AUDITS.remove(audit)


def auditing() -> bool:
    return bool(_AUDITS)


def record_sent(cid: int, kind: str, row: torch.Tensor, x: torch.Tensor, sources) -> None:
    if _AUDITS:
        rec = SentRecord(int(cid), kind, row.detach().cpu().clone(), x.detach().cpu().clone(),
                         np.asarray(sources, dtype=np.int64).copy())
        for a in _AUDITS:
            a.records.append(rec)
