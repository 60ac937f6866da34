"""Sample privacy of uploaded and server-made seed samples (Mix2FLD paper, Sec. IV, Tables II-III).

Sample privacy of a mixed sample s_hat made from raw samples s_i and s_j is
``log(min(||s_hat - s_i||, ||s_hat - s_j||))`` (Euclidean norm), the paper
following its refs. [11], [12]; higher means the upload resembles its raw
samples less. Reading chosen where the text is terse:

* the log is natural: in Table II consecutive columns differ by the log of the
  ratio of their lambdas (0.1 -> 0.2: 5.158 - 4.465 = 0.693 = ln 2), as
  ``min = lam * ||s_i - s_j||`` predicts for Eq. 6 with lam < 0.5. (The columns
  headed 0.001 and 0.499 fit lam = 0.01 and lam ~ 0.49 on that line instead.)
* for an inversely mixed sample the "raw samples that went into it" are all N*N
  raw samples behind its N parent seeds (Table III); the minimum is over them;
* the tables' single number per setting is the mean over samples of the per-sample
  log distance; the standard deviation reported with it is the population one (ddof 0);
* distances are taken in whatever space the samples are given (the simulator's
  model-input space), so absolute values depend on pixel scaling; only
  comparisons within one space mean anything.

A raw seed (FLD) has distance 0 to itself: its sample privacy is -inf, and
:func:`audit_raw_leaves` flags it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Union

import torch

from ..errors import DataError

RawLookup = Union[Mapping[int, torch.Tensor], Callable[[int], torch.Tensor]]


@dataclass
class SamplePrivacy:
    """Mean and population std over samples of log(min distance to their raw samples)."""

    mean: float
    std: float
    count: int


def log_min_distances(samples: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """Per sample, ln of the smallest Euclidean distance to its own raw samples (float64, shape (n,)).

    ``samples``: (n, *shape); ``sources``: (n, S, *shape), the S raw samples behind each.
    """
    n = samples.shape[0]
    if sources.shape[0] != n or tuple(sources.shape[2:]) != tuple(samples.shape[1:]):
        raise DataError(f"sources must have shape (n, S, *sample_shape) = ({n}, S, "
                        f"{', '.join(map(str, samples.shape[1:]))}), got {tuple(sources.shape)}")
    diff = sources.reshape(n, sources.shape[1], -1).double() - samples.reshape(n, 1, -1).double()
    return diff.norm(dim=-1).min(dim=1).values.log()


def log_min_distance(samples: torch.Tensor, sources: torch.Tensor) -> SamplePrivacy:
    """The sample privacy of Tables II-III: mean (and std) over samples of :func:`log_min_distances`."""
    v = log_min_distances(samples, sources)
    if len(v) == 0:
        raise DataError("sample privacy of an empty set of samples is undefined")
    return SamplePrivacy(float(v.mean()), float(v.std(correction=0)), len(v))


def _getter(raw: RawLookup) -> Callable[[int], torch.Tensor]:
    return raw.__getitem__ if isinstance(raw, Mapping) else raw


def raw_sources(seeds, raw: RawLookup) -> torch.Tensor:
    """The raw samples behind each seed, (n, S, *shape), from its provenance (device, index).

    ``raw(cid)`` (or ``raw[cid]``) is device cid's training inputs in the seeds' space.
    """
    get = _getter(raw)
    cids, index = seeds.source_cid.cpu(), seeds.source_index.cpu()
    n, s = cids.shape
    out = torch.empty((n, s) + tuple(seeds.x.shape[1:]), dtype=torch.float64)
    for cid in torch.unique(cids).tolist():
        at = (cids == cid).nonzero()
        out[at[:, 0], at[:, 1]] = get(cid).cpu()[index[at[:, 0], at[:, 1]]].double()
    return out


def sample_privacy(seeds, raw: RawLookup) -> SamplePrivacy:
    """Sample privacy of a :class:`~fedhpc.exchanges.seed_samples.SeedSet` against its own raw samples."""
    return log_min_distance(seeds.x.detach().cpu(), raw_sources(seeds, raw))


@dataclass
class LeakAudit:
    """Whether any sample equals a raw training sample of a device behind it."""

    checked: int
    leaked_rows: List[int] = field(default_factory=list)
    min_distance: float = float("inf")

    @property
    def passed(self) -> bool:
        return not self.leaked_rows

    def as_dict(self) -> Dict[str, object]:
        return {"checked": self.checked, "leaked": len(self.leaked_rows), "passed": self.passed,
                "min_distance_to_raw": self.min_distance}


def audit_raw_leaves(seeds, raw: RawLookup, atol: float = 1e-6, rtol: float = 1e-6) -> LeakAudit:
    """Flag every sample within ``atol + rtol * ||sample||`` of *any* raw sample of a device behind it.

    Compares against all the training samples of the devices in the sample's
    provenance, not only the ones mixed into it: an upload that happens to equal
    another raw sample of its device leaks it just the same. FLD's raw seeds are
    flagged; MixFLD's mixed and Mix2FLD's inversely mixed samples pass unless two
    mixed raw samples are identical images.
    """
    get = _getter(raw)
    x = seeds.x.detach().cpu().reshape(len(seeds), -1).double()
    nearest = torch.full((len(seeds),), float("inf"), dtype=torch.float64)
    cids = seeds.source_cid.cpu()
    for cid in torch.unique(cids).tolist():
        rows = (cids == cid).any(dim=1).nonzero().flatten()
        pool = get(cid).detach().cpu().reshape(-1, x.shape[1]).double()
        # Exact differences, not the |a|^2 + |b|^2 - 2ab shortcut that leaves ~1e-7 on identical rows.
        d = torch.cdist(x[rows], pool, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
        nearest[rows] = torch.minimum(nearest[rows], d)
    leaked = (nearest <= atol + rtol * x.norm(dim=1)).nonzero().flatten().tolist()
    return LeakAudit(len(seeds), leaked, float(nearest.min()) if len(seeds) else float("inf"))
