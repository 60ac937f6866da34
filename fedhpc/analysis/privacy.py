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

XorMixFL's Table 3 (paper 003) measures instead "the minimum MDS value between the
augmented sample and any raw sample contributing to it", citing classical
multidimensional scaling (Cox & Cox 2008). :func:`classical_mds` embeds a point set
from its Euclidean distances (double-centred squared distances B = -J D^2 J / 2, the
top ``dims`` eigenpairs of B, coordinates V sqrt(Lambda)); :func:`mds_min_distances`
embeds the augmented samples together with all their contributing raw samples (one
joint embedding, duplicates merged) and takes, per augmented sample, the smallest
embedded distance to its own contributors, reported as mean and population std (no
log: Table 3 prints distances of ~2,000 in uint8 pixel units). With ``dims`` at least
the points' rank the embedding is isometric and the MDS distance equals the raw-pixel
distance of :func:`pixel_min_distances`, which is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Sequence, Union

import torch

from ..errors import DataError
from ..exchanges.ownership import invert_owners

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


def _by_device(owners: torch.Tensor):
    """(device, ascending row positions of ``owners`` that list it) for each device listed, in
    device order: one sort (:func:`~fedhpc.exchanges.ownership.invert_owners`), where a mask
    per device costs devices x samples (20,000 devices' seeds: minutes)."""
    ptr, positions = invert_owners(owners)
    for cid in range(len(ptr) - 1):
        if ptr[cid + 1] > ptr[cid]:
            yield cid, positions[ptr[cid]:ptr[cid + 1]]


def raw_sources(seeds, raw: RawLookup) -> torch.Tensor:
    """The raw samples behind each seed, (n, S, *shape), from its provenance (device, index).

    ``raw(cid)`` (or ``raw[cid]``) is device cid's training inputs in the seeds' space.
    """
    get = _getter(raw)
    cids, index = seeds.source_cid.cpu(), seeds.source_index.cpu()
    n, s = cids.shape
    out = torch.empty((n, s) + tuple(seeds.x.shape[1:]), dtype=torch.float64)
    for cid, at in _by_device(cids.reshape(-1, 1)):  # positions in the flattened (n * S) table
        row, col = at // s, at % s
        out[row, col] = get(cid).cpu()[index[row, col]].double()
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
    for cid, rows in _by_device(cids):  # a row mixing two samples of one device is compared once
        pool = get(cid).detach().cpu().reshape(-1, x.shape[1]).double()
        # Exact differences, not the |a|^2 + |b|^2 - 2ab shortcut that leaves ~1e-7 on identical rows.
        d = torch.cdist(x[rows], pool, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
        nearest[rows] = torch.minimum(nearest[rows], d)
    leaked = (nearest <= atol + rtol * x.norm(dim=1)).nonzero().flatten().tolist()
    return LeakAudit(len(seeds), leaked, float(nearest.min()) if len(seeds) else float("inf"))


# --------------------------------------------------------------------------- classical MDS (XorMixFL Table 3)


def _exact_cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Exact differences, not the |a|^2 + |b|^2 - 2ab shortcut that leaves ~1e-7 on identical rows.
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def classical_mds(points: torch.Tensor, dims: int) -> torch.Tensor:
    """Classical (Torgerson) MDS coordinates (n, dims), float64, of points (n, *shape).

    Eigenvalues below zero (numerical noise) are clipped to 0; with fewer than ``dims``
    points the missing dimensions are zero. Distances between rows do not depend on the
    eigenvectors' signs, nor on the choice of basis inside a repeated eigenvalue as long as
    the whole eigenspace is kept.
    """
    x = points.reshape(points.shape[0], -1).double()
    n = x.shape[0]
    d2 = _exact_cdist(x, x).square()
    j = torch.eye(n, dtype=torch.float64) - 1.0 / n
    b = -0.5 * j @ d2 @ j
    b = 0.5 * (b + b.T)
    evals, evecs = torch.linalg.eigh(b)
    order = torch.argsort(evals, descending=True)[:dims]
    coords = evecs[:, order] * evals[order].clamp_min(0).sqrt()
    if coords.shape[1] < dims:
        coords = torch.cat([coords, coords.new_zeros(n, dims - coords.shape[1])], 1)
    return coords


def _joint_points(samples: torch.Tensor, sources: Sequence[torch.Tensor]):
    """Unique rows of samples + all sources, and for each sample its row and its sources' rows."""
    if len(sources) != samples.shape[0]:
        raise DataError(f"{samples.shape[0]} samples but {len(sources)} source sets; give one set per sample")
    flat = [samples.reshape(samples.shape[0], -1).double()] + [s.reshape(s.shape[0], -1).double() for s in sources]
    if any(f.shape[0] == 0 for f in flat[1:]):
        raise DataError("every augmented sample needs at least one contributing raw sample")
    allpts = torch.cat(flat)
    uniq, inverse = torch.unique(allpts, dim=0, return_inverse=True)
    n = samples.shape[0]
    own, at = inverse[:n], n
    src = []
    for s in flat[1:]:
        src.append(inverse[at: at + s.shape[0]])
        at += s.shape[0]
    return uniq, own, src


def mds_min_distances(samples: torch.Tensor, sources: Sequence[torch.Tensor], dims: int = 2) -> SamplePrivacy:
    """Table 3 (XorMixFL): per sample, the smallest distance in one joint classical-MDS embedding
    (``dims`` dimensions) of all samples and sources to its own ``sources[i]`` (S_i, *shape);
    mean and population std over samples."""
    if samples.shape[0] == 0:
        raise DataError("MDS privacy of an empty set of samples is undefined")
    uniq, own, src = _joint_points(samples, sources)
    y = classical_mds(uniq, dims)
    v = torch.stack([_exact_cdist(y[own[i]][None], y[src[i]]).min() for i in range(samples.shape[0])])
    return SamplePrivacy(float(v.mean()), float(v.std(correction=0)), len(v))


def pixel_min_distances(samples: torch.Tensor, sources: Sequence[torch.Tensor]) -> SamplePrivacy:
    """The raw-pixel twin of :func:`mds_min_distances`: smallest Euclidean distance to its own sources."""
    if samples.shape[0] == 0:
        raise DataError("pixel-distance privacy of an empty set of samples is undefined")
    flat = samples.reshape(samples.shape[0], -1).double()
    v = torch.stack([_exact_cdist(flat[i][None], s.reshape(s.shape[0], -1).double()).min()
                     for i, s in enumerate(sources)])
    return SamplePrivacy(float(v.mean()), float(v.std(correction=0)), len(v))
