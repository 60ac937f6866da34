"""Mix2FLD's inverse mixup (Mix2FLD paper, Sec. III, Eqs. 7-8): the server's side of the seed samples.

The server combines N mixed seeds (:func:`fedhpc.exchanges.seed_samples.mixed_seeds`)
whose label tuples are rotations of one another, from N different devices, with the
inverse of the circulant mixing matrix (:func:`inverse_ratios`), so that each
combination gives N samples with hard labels and no device's raw sample is restored.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError, DataError
from .seed_samples import SeedSet

#: more candidate combinations than this in one label tuple are not enumerated (see inverse_mixup)
ENUMERATE_LIMIT = 1 << 20


def circulant(ratios: Sequence[float]) -> torch.Tensor:
    """Eq. 8's mixing matrix: row r = (lam_{1+r}, ..., lam_N, lam_1, ..., lam_r), float64.

    Entry [r, l] is the weight a device in rotation r gives to base label l.
    """
    lam = torch.tensor(list(ratios), dtype=torch.float64)
    n = len(lam)
    idx = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % n
    return lam[idx]


def inverse_ratios(ratios: Sequence[float]) -> torch.Tensor:
    """Eq. 8: the inverse mixing ratios, W[n, r] = lambda_hat of the rotation-r seed for label n.

    W = M^{-1} with M = :func:`circulant` (M is symmetric, so the paper's
    row/column layout of the hatted matrix is the same either way). For N = 2:
    W[0] = (lam / (2 lam - 1), 1 - lam / (2 lam - 1)) (Eqs. 9-10), negative entries expected.
    """
    m = circulant(ratios)
    cond = torch.linalg.cond(m)
    if not torch.isfinite(cond) or cond > 1e8:
        raise ConfigError(f"mixing ratios {tuple(ratios)} give a singular circulant (Eq. 8): inverse "
                          f"mixup is impossible; for N = 2 use lambda != 0.5, for N > 2 ratios whose "
                          f"circulant is invertible (e.g. lambda != 1/N)")
    return torch.linalg.inv(m)


def _rotation_groups(labels: np.ndarray) -> Dict[Tuple[int, ...], List[List[int]]]:
    """Seeds grouped by label cycle (tuple rotated to start at its smallest label), then by rotation."""
    n = labels.shape[1]
    groups: Dict[Tuple[int, ...], List[List[int]]] = {}
    for row, t in enumerate(labels.tolist()):
        if len(set(t)) != n:
            continue  # a repeated label makes the tuple no rotation of N distinct labels
        r = int(np.argmin(t))
        base = tuple(t[r:] + t[:r])
        groups.setdefault(base, [[] for _ in range(n)])[r].append(row)
    return groups


def _greedy_pass(groups, owner: np.ndarray, made: set, g: torch.Generator) -> List[Tuple[int, ...]]:
    """One pass: every seed joins at most one new combination, partners drawn in random order."""
    fresh = []
    for key in sorted(groups):
        lists = groups[key]
        if any(not rows for rows in lists):
            continue
        order = [[rows[i] for i in torch.randperm(len(rows), generator=g).tolist()] for rows in lists]
        used = [set() for _ in lists]
        start = [0] * len(lists)  # first possibly unused position: keeps a pass near-linear
        for a in order[0]:
            combo, owners = [a], {owner[a]}
            for r in range(1, len(lists)):
                last = r == len(lists) - 1
                while start[r] < len(order[r]) and order[r][start[r]] in used[r]:
                    start[r] += 1
                pick = next((b for b in itertools.islice(order[r], start[r], None)
                             if b not in used[r] and owner[b] not in owners
                             and not (last and tuple(combo + [b]) in made)), None)
                if pick is None:
                    break
                combo.append(pick)
                owners.add(owner[pick])
            if len(combo) == len(lists):
                made.add(tuple(combo))
                fresh.append(tuple(combo))
                for r, b in enumerate(combo):
                    used[r].add(b)
    return fresh


def _enumerate_rest(groups, owner: np.ndarray, made: set) -> List[Tuple[int, ...]]:
    """Every valid combination not made yet, for tuples with at most ENUMERATE_LIMIT candidates."""
    rest = []
    for key in sorted(groups):
        lists = groups[key]
        if math.prod(len(r) for r in lists) > ENUMERATE_LIMIT:
            continue
        for combo in itertools.product(*lists):
            if len({owner[b] for b in combo}) == len(combo) and combo not in made:
                made.add(combo)
                rest.append(combo)
    return rest


def inverse_mixup(seeds: SeedSet, n_out: int, N: int = 2, generator: Optional[torch.Generator] = None,
                  strict: bool = True) -> SeedSet:
    """Mix2FLD's inverse mixup (Eqs. 7-8): hard-labelled samples from N mixed seeds of N different devices.

    A combination takes one seed of each rotation of a label cycle (for N = 2: labels
    (a, b) with lam on a, and (b, a) from another device), all from different devices
    (the paper's guard against restoring a raw sample). With W = :func:`inverse_ratios`,
    output n = sum_r W[n, r] * seed_r has the hard label of base label n, so each
    combination gives N outputs, one per label of the cycle ("by alternating lambda_hat
    with n = 1 and 2"). ceil(n_out / N) combinations are made and the outputs cut to
    n_out (so n_out = N_I * |D| for N_I per device).

    Which combinations: in passes, each seed joining at most one new combination per
    pass (partners in seeded random order), each pass's combinations shuffled, until
    enough exist; no combination is made twice. So N_I = N_S uses each seed about
    once and N_I = 2 N_S about twice. If a pass finds nothing new, the remaining
    combinations of label cycles with at most ENUMERATE_LIMIT candidates are
    enumerated. DataError when no combination exists or too few distinct ones do.

    ``strict=False`` is for seed sets a channel thinned out (Mix2FLD under
    ``--seed-delivery channel``): the outputs of every combination found, at most n_out
    and possibly none (an empty set, also for no seeds or n_out = 0), instead of DataError;
    the combinations made are the first ones a strict call would make.
    """
    if generator is None:
        raise ConfigError("inverse_mixup needs a seeded torch.Generator (derive_seed(seed, 'inverse-mixup'))")
    if seeds.kind != "mixed":
        raise ConfigError(f"inverse mixup combines mixed seeds (MixFLD Eq. 6); got {seeds.kind} seeds")
    if seeds.labels.shape[1] != N or len(seeds.ratios) != N:
        raise ConfigError(f"the seeds mix {seeds.labels.shape[1]} samples each; inverse mixup with N = {N} needs "
                          f"seeds of N samples (set the seed mixing N and the inverse N alike)")
    if n_out < (1 if strict else 0):
        raise ConfigError(f"the number of inversely mixed samples must be >= 1, got {n_out}")
    w = inverse_ratios(seeds.ratios)
    labels = seeds.labels.cpu().numpy()
    owner = seeds.owner.cpu().numpy()
    _check_soft_labels(seeds)
    groups = _rotation_groups(labels)
    need = -(-n_out // N)
    made: set = set()
    combos: List[Tuple[int, ...]] = []
    while len(combos) < need:
        fresh = _greedy_pass(groups, owner, made, generator) or _enumerate_rest(groups, owner, made)
        if not fresh:
            break
        combos.extend(fresh[i] for i in torch.randperm(len(fresh), generator=generator).tolist())
    if not strict:
        n_out = min(n_out, N * len(combos))  # a thinned-out set gives what it has
        need = -(-n_out // N)
    elif not combos:
        raise DataError(
            f"no valid inverse-mixup combination among {len(seeds)} mixed seeds of {len(np.unique(owner))} "
            f"device(s): N = {N} seeds whose label tuples are rotations of one another, from {N} different "
            f"devices, are needed. Raise --seeds-per-device or the number of devices; --seed-pairing balanced "
            f"(the default) or shared schedules such partners, random leaves them to chance")
    elif len(combos) < need:
        per_device = N * len(combos) // max(len(np.unique(owner)), 1)
        raise DataError(f"only {len(combos)} distinct inverse-mixup combinations exist ({N * len(combos)} samples), "
                        f"fewer than the {n_out} asked for (--inverse-per-device times the devices): lower "
                        f"--inverse-per-device (these seeds give {per_device} per device) or upload more seeds "
                        f"(--seeds-per-device; --seed-pairing balanced, the default, or shared give far more "
                        f"symmetric partners than random)")
    combos = combos[:need]
    parents = torch.tensor(combos, dtype=torch.long).reshape(-1, N)         # (k, N), ordered by rotation
    k = len(combos)
    xs = seeds.x[parents.reshape(-1).to(seeds.x.device)].double().reshape((k, N) + tuple(seeds.x.shape[1:]))
    out_x = torch.einsum("nr,kr...->kn...", w.to(xs.device), xs).reshape((k * N,) + tuple(seeds.x.shape[1:]))
    base = torch.tensor([labels[c[0]].tolist() for c in combos], dtype=torch.long).reshape(-1, N)  # rotation 0
    hard = base.reshape(-1)
    coef = w.expand(k, N, N).reshape(k * N, N)                                  # (outputs, rotation)
    par = parents.repeat_interleave(N, dim=0)
    lam = torch.tensor(seeds.ratios, dtype=torch.float64)
    weights = (coef[:, :, None] * lam[None, None, :]).reshape(k * N, N * N)
    src_cid = seeds.source_cid.cpu()[par].reshape(k * N, N * N)
    src_idx = seeds.source_index.cpu()[par].reshape(k * N, N * N)
    keep = torch.arange(n_out)
    return SeedSet(
        x=out_x.to(seeds.x.dtype)[keep.to(out_x.device)],
        y=F.one_hot(hard, seeds.num_classes).to(seeds.y.dtype).to(seeds.y.device)[keep.to(seeds.y.device)],
        labels=hard[:, None][keep], source_cid=src_cid[keep], source_index=src_idx[keep],
        weights=weights[keep], owner=torch.full((n_out,), -1, dtype=torch.long), index=keep.clone(),
        kind="inverse", ratios=seeds.ratios, parents=par[keep], coef=coef[keep].clone())


def _check_soft_labels(seeds: SeedSet) -> None:
    """The inverse ratios assume Eq. 6's soft labels: lam_m on the m-th label of each tuple."""
    lam = torch.tensor(seeds.ratios, dtype=torch.float64)
    want = torch.zeros(len(seeds), seeds.num_classes, dtype=torch.float64)
    want.scatter_(1, seeds.labels.cpu(), lam.expand(len(seeds), -1).clone())
    if not torch.allclose(seeds.y.detach().cpu().double(), want, atol=1e-5):
        raise DataError("the mixed seeds' soft labels do not match their label tuples and ratios "
                        "(Eq. 6); make them with mixed_seeds() and collect them unchanged")
