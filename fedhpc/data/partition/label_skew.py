"""Label-skew partitions that assign every sample: ``iid``, ``dirichlet``, ``dirichlet_capped``,
``classes`` and ``classes_cyclic`` (what each draws: the package's docstring)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...errors import ConfigError, DataError
from . import no_argument, register_partition


@register_partition("iid", "", check=no_argument("iid"))
def _iid(labels, n, rng, arg):
    no_argument("iid")(arg)
    return np.array_split(rng.permutation(len(labels)), n)


def _dirichlet_alpha(arg: str, name: str = "dirichlet") -> float:
    try:
        alpha = float(arg)
    except ValueError:
        raise ConfigError(f"partition '{name}:{arg}' needs a positive number, e.g. {name}:0.5")
    if not alpha > 0:
        raise ConfigError(f"partition '{name}:{arg}' needs a positive alpha (e.g. {name}:0.5)")
    if not math.isfinite(alpha):  # Dir(inf) draws NaN proportions; the limit is the uniform split
        raise ConfigError(f"partition '{name}:{arg}' needs a finite alpha; for a near-uniform split use a "
                          f"large one (e.g. {name}:100) or the partition iid")
    return alpha


@register_partition("dirichlet", ":ALPHA", check=_dirichlet_alpha)
def _dirichlet(labels, n, rng, arg):
    alpha = _dirichlet_alpha(arg)
    parts: List[List[np.ndarray]] = [[] for _ in range(n)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(n, alpha))
        cuts = np.rint(np.cumsum(props)[:-1] * len(idx)).astype(np.int64)  # nearest: no client favoured
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


#: dirichlet_capped's default MIN: the value of the FedML / MOON / FedAlign code
CAPPED_MIN_SAMPLES = 10
#: whole draws dirichlet_capped tries before it gives up (the FedML code loops without a bound)
CAPPED_ATTEMPTS = 1000


def _dirichlet_capped_args(arg: str) -> Tuple[float, int]:
    """(ALPHA, MIN) of ``dirichlet_capped:ALPHA[:MIN]``."""
    alpha_text, _, min_text = arg.partition(":")
    alpha = _dirichlet_alpha(alpha_text, "dirichlet_capped")
    if not min_text:
        return alpha, CAPPED_MIN_SAMPLES
    try:
        minimum = int(min_text)
    except ValueError:
        raise ConfigError(f"partition 'dirichlet_capped:{arg}' needs ALPHA[:MIN] with MIN a whole number of "
                          f"samples per client, e.g. dirichlet_capped:0.5 (MIN = {CAPPED_MIN_SAMPLES}) or "
                          f"dirichlet_capped:0.5:5")
    if minimum < 1:
        raise ConfigError(f"partition 'dirichlet_capped:{arg}' needs MIN >= 1 samples per client, e.g. "
                          f"dirichlet_capped:{alpha_text}:1")
    return alpha, minimum


def _capped_draw(members: List[np.ndarray], n: int, total: int, alpha: float,
                 rng: np.random.Generator) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One draw of ``dirichlet_capped`` over the classes' index arrays ``members``: (the indices
    in drawn order, class after class; the client each goes to; the clients' sizes), or None
    where a class found no client to take it (all proportions left by the cap are exactly 0).

    Only client sizes are kept while drawing; nothing is split into per-client arrays, since most
    draws are thrown away when the minimum is hard to meet (20,000 clients: 0.3 s a draw with
    the split, a few ms without)."""
    sizes = np.zeros(n, dtype=np.int64)
    order, owner = [], []
    for idx in members:
        idx = rng.permutation(idx)
        props = rng.dirichlet(np.full(n, alpha))
        props[sizes * n >= total] = 0.0  # integer form of size >= N/n: no float rounding at the cap
        mass = props.sum()
        if not mass > 0:
            return None
        # A zeroed p_j repeats the cumulative sum exactly, so the capped client's chunk is empty.
        cuts = np.rint(np.cumsum(props / mass)[:-1] * len(idx)).astype(np.int64)
        chunk = np.diff(cuts, prepend=0, append=len(idx))
        sizes += chunk
        order.append(idx)
        owner.append(np.repeat(np.arange(n), chunk))
    return np.concatenate(order), np.concatenate(owner), sizes


def _split_by_owner(order: np.ndarray, owner: np.ndarray, sizes: np.ndarray) -> List[np.ndarray]:
    """Client k's indices: those of ``order`` whose ``owner`` is k, ``sizes[k]`` of them
    (make_partition sorts them)."""
    by_client = np.argsort(owner, kind="stable")
    return np.split(order[by_client], np.cumsum(sizes)[:-1])


@register_partition("dirichlet_capped", f":ALPHA[:MIN] (Dir(ALPHA) with the FedML/MOON/FedAlign code's size cap, "
                    f"redrawn until every client has MIN samples, default {CAPPED_MIN_SAMPLES})",
                    check=_dirichlet_capped_args, takes_min_samples=True)
def _dirichlet_capped(labels, n, rng, arg, min_samples=1):
    """Dir(ALPHA) label skew under the size cap of the partition code FedML ships ("hetero"),
    which MOON's and FedAlign's code reuse (FedAlign Sec. 3.2 cites both for its Dir(alpha)
    "as common in the literature").

    One draw: for each class in label order, its indices are shuffled and proportions
    p ~ Dir(ALPHA) over the clients are drawn (in that order, one permutation then one
    Dirichlet per class, like :func:`_dirichlet`); p_j is set to 0 for every client j
    that already holds at least N/n samples (N the pool, n the clients), p is
    renormalised, and the shuffled indices are cut at the cumulative proportions. The
    whole draw is repeated until every client holds at least MIN samples (the larger of
    the spec's MIN and the caller's ``min_samples``). A client thus only grows while it
    is under N/n: it ends below N/n plus its chunk of the last class it received.

    Where fedhpc departs from that code:

    * cuts are rounded to the nearest index, as in ``dirichlet``, where FedML truncates:
      truncation moves about half a sample per class from the first client to the
      last, and can give the last client a sample even when the cap zeroed its
      proportion (the cumulative sum ends a rounding error below 1);
    * a class whose proportions are all zero after the cap (every client under N/n
      drew exactly 0, which float underflow allows at a tiny ALPHA) has no split: the
      draw counts as failed and is repeated (FedML would divide by zero);
    * at most :data:`CAPPED_ATTEMPTS` draws, then a ConfigError with the fix (FedML's
      loop has no bound and never returns if the minimum cannot be met).
    """
    alpha, minimum = _dirichlet_capped_args(arg)
    minimum = max(minimum, min_samples)
    total = len(labels)
    if n * minimum > total:
        raise ConfigError(f"partition 'dirichlet_capped:{arg}' cannot give {n} clients at least {minimum} samples "
                          f"each out of {total}; lower MIN (dirichlet_capped:{alpha:g}:MIN) or use fewer clients")
    members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(CAPPED_ATTEMPTS):
        drawn = _capped_draw(members, n, total, alpha, rng)
        if drawn is not None and drawn[2].min() >= minimum:
            return _split_by_owner(*drawn)
    raise ConfigError(
        f"partition 'dirichlet_capped:{arg}': {CAPPED_ATTEMPTS} draws all left some of the {n} clients with fewer "
        f"than {minimum} samples (pool of {total}); lower MIN (dirichlet_capped:{alpha:g}:MIN), use fewer "
        f"clients, or a larger alpha")


def _classes_k(arg: str, name: str) -> int:
    """K of ``name:K`` as far as it can be checked without the labels."""
    try:
        k = int(arg)
    except ValueError:
        raise ConfigError(f"partition '{name}:{arg}' needs an integer, e.g. {name}:2")
    if k < 1:
        raise ConfigError(f"{name}:K needs K >= 1 classes per client, got {k}; e.g. {name}:2")
    return k


def _parse_classes(labels, n, arg: str, name: str):
    """The class list and K of ``name:K``; refuses K out of range and uncovered classes."""
    k = _classes_k(arg, name)
    classes = np.unique(labels)
    c = len(classes)
    if not 1 <= k <= c:
        raise ConfigError(f"{name}:K needs 1 <= K <= {c} (the number of classes), got {k}")
    if n * k < c:
        raise DataError(
            f"{name}:{k} with {n} clients covers only {n * k} of {c} classes, so some samples "
            f"would belong to no client; raise K or --num-clients to at least {-(-c // k)}"
        )
    return classes, k


def _split_classes(labels, n, rng, holders: Dict[int, List[int]]) -> List[np.ndarray]:
    """Every class's samples, shuffled, split evenly (+-1) over the clients holding it."""
    parts: List[List[np.ndarray]] = [[] for _ in range(n)]
    for cl, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == cl))
        if len(idx) < len(owners):  # some holder would get none of it: fewer than K classes, silently
            raise DataError(
                f"class {cl} has {len(idx)} sample(s) but {len(owners)} clients are to hold it, so some would "
                f"get none of it and hold fewer classes than asked; lower --num-clients or K, or use more data")
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].append(chunk)
    return [np.concatenate(p) for p in parts]


@register_partition("classes", ":K (K random classes per client)", check=lambda arg: _classes_k(arg, "classes"))
def _classes(labels, n, rng, arg):
    """K distinct classes per client, drawn at random under balanced per-class quotas.

    The papers draw each client's classes at random (FedMix Sec. 4: "each client only has
    data from 2 (20 for CIFAR100) randomly chosen classes"). A fully independent draw would
    leave some classes with many holders and others with none (unassigned samples), so
    the draw is constrained: every class gets a quota of holders, floor(N*K/C) or one more
    (the +1 goes to a seeded random subset of classes), and the quotas sum to N*K. Clients
    are then served in order; client i takes

    1. every *forced* class, whose remaining quota equals the number of clients left
       (including i): each of them must go to every remaining client, and
    2. the rest of its K classes one at a time, each drawn with probability proportional
       to its remaining quota among the classes it does not hold yet.

    It never gets stuck. Invariant before client i, with r = N - i clients left: the
    quotas sum to r*K and none exceeds r. Hence at least K classes have a positive quota
    (fewer than K classes of quota <= r sum to less than r*K) and at most K are forced
    (K+1 classes of quota r would sum to more than r*K), so step 1 fits in K and step 2
    finds enough positive quotas. After the client every forced class dropped to r - 1,
    every other class was already <= r - 1, and the sum fell by exactly K: the invariant
    holds for r - 1. At the start the quotas are <= ceil(N*K/C) <= N because K <= C. At
    the end every quota is 0, so each class has exactly its quota of holders (counts
    differ by at most 1) and, since every quota is >= 1 (N*K >= C is checked), every
    sample has an owner.

    Drawing by remaining quota (rather than taking the K largest, a round-robin in
    disguise) keeps the draw close to the papers' independent one: with N = 60, K = 2,
    C = 10 the clients hold about 35 of the 45 possible pairs (60 independent uniform
    draws give about 33), where ``classes_cyclic`` gives 5 pairs shared by 12 clients each.
    """
    classes, k = _parse_classes(labels, n, arg, "classes")
    c = len(classes)
    quota = np.full(c, (n * k) // c, dtype=np.int64)
    quota[rng.permutation(c)[: (n * k) % c]] += 1
    holders: Dict[int, List[int]] = {int(cl): [] for cl in classes}
    for i in range(n):
        left = n - i
        chosen = list(np.flatnonzero(quota == left))
        while len(chosen) < k:
            w = quota.astype(np.float64)
            w[chosen] = 0.0
            # Inverse-CDF draw on the integer quotas: exact, and one uniform per pick.
            cum = np.cumsum(w)
            chosen.append(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")))
        for j in chosen:
            quota[j] -= 1
            holders[int(classes[j])].append(i)
    return _split_classes(labels, n, rng, holders)


@register_partition("classes_cyclic", ":K (K consecutive classes, round-robin)",
                    check=lambda arg: _classes_k(arg, "classes_cyclic"))
def _classes_cyclic(labels, n, rng, arg):
    """The earlier ``classes:K``, unchanged: clients take K consecutive classes of one
    seeded class order, round-robin, so every class is held by N*K/C clients (+-1) but
    at most C/gcd(K, C) distinct class sets exist (5 pairs for K = 2, C = 10)."""
    classes, k = _parse_classes(labels, n, arg, "classes_cyclic")
    c = len(classes)
    order = rng.permutation(classes)
    holders: Dict[int, List[int]] = {int(cl): [] for cl in classes}
    for i in range(n):
        for j in range(k):
            holders[int(order[(i * k + j) % c])].append(i)
    return _split_classes(labels, n, rng, holders)
