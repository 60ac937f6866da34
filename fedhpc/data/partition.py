"""Synthetic partitions of a labelled pool over clients.

Every partition assigns every sample to exactly one client (tests check this) and
depends only on the labels, the number of clients and the seed: never on the
number of ranks.

Specs: ``iid``; ``dirichlet:ALPHA`` (per-class proportions drawn from
Dir(ALPHA) over clients, as in FedAlign and most label-skew studies);
``classes:K`` (every client holds K distinct, randomly drawn classes, as in FedMix:
"each client only has data from 2 (20 for CIFAR100) randomly chosen classes", and
pMixFed); ``classes_cyclic:K`` (the scheme ``classes:K`` meant before: K
consecutive classes of one seeded class order, dealt round-robin, so at most
C/gcd(K, C) distinct class sets exist; kept to reproduce runs made with it).

Both ``classes`` variants balance the number of clients holding each class (the
counts differ by at most one) and split each class evenly over its holders.

Exception: ``skewed:M:A:B`` / ``mix2fld`` deal *fixed counts* per client (Mix2FLD:
"each device has two labels with 2 samples each and the other labels with 62
each"), so they assign every sample *at most* once and leave the rest of the pool
to no client.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

from ..errors import ConfigError, DataError

#: bumped whenever a partition spec starts to mean a different split (2: classes:K became a
#: random draw). Part of a run's identity, so an older checkpoint is not resumed onto new data.
PARTITION_RULES = 2

PartitionFn = Callable[[np.ndarray, int, np.random.Generator, str], List[np.ndarray]]
_PARTITIONS: Dict[str, Tuple[PartitionFn, str]] = {}


def register_partition(name: str, help: str):
    def deco(fn: PartitionFn) -> PartitionFn:
        _PARTITIONS[name] = (fn, help)
        return fn

    return deco


def partition_names() -> List[str]:
    return sorted(_PARTITIONS)


def partition_help() -> str:
    return "; ".join(f"{n}{h}" for n, (_, h) in sorted(_PARTITIONS.items()))


def parse_partition(spec: str) -> Tuple[str, str]:
    """'dirichlet:0.5' -> ('dirichlet', '0.5'); validates the name."""
    name, _, arg = spec.partition(":")
    name = name.strip().lower()
    if name in ("", "auto", "default"):
        # The dataset's own partition: naturally federated datasets resolve this to
        # 'natural' before calling here; for a pooled dataset it is iid.
        name = "iid"
    if name not in _PARTITIONS:
        raise ConfigError(
            f"unknown partition {spec!r}; use one of: {partition_help()}"
        )
    return name, arg.strip()


def make_partition(
    spec: str, labels: np.ndarray, num_clients: int, seed: int, min_samples: int = 1
) -> List[np.ndarray]:
    """Split indices 0..len(labels)-1 over ``num_clients`` clients following ``spec``."""
    name, arg = parse_partition(spec)
    labels = np.asarray(labels)
    if num_clients < 1:
        raise ConfigError(f"num_clients must be at least 1, got {num_clients}")
    if num_clients * min_samples > len(labels):
        raise DataError(
            f"{len(labels)} samples cannot give {num_clients} clients at least {min_samples} "
            f"each; lower --num-clients"
        )
    rng = np.random.default_rng([seed, 0xDA7A])
    parts = _PARTITIONS[name][0](labels, num_clients, rng, arg)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    small = [k for k, p in enumerate(parts) if len(p) < min_samples]
    if small:
        raise DataError(
            f"partition {spec!r} leaves {len(small)} of {num_clients} clients with fewer than "
            f"{min_samples} samples (e.g. client {small[0]}); use fewer clients or a milder "
            f"skew (larger Dirichlet alpha, more classes per client)"
        )
    return parts


@register_partition("iid", "")
def _iid(labels, n, rng, arg):
    if arg:
        raise ConfigError(f"partition 'iid' takes no argument, got 'iid:{arg}'")
    return np.array_split(rng.permutation(len(labels)), n)


@register_partition("dirichlet", ":ALPHA")
def _dirichlet(labels, n, rng, arg):
    try:
        alpha = float(arg)
    except ValueError:
        raise ConfigError(f"partition 'dirichlet:{arg}' needs a positive number, e.g. dirichlet:0.5")
    if not alpha > 0:
        raise ConfigError(f"partition 'dirichlet:{arg}' needs a positive alpha (e.g. dirichlet:0.5)")
    parts: List[List[np.ndarray]] = [[] for _ in range(n)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(n, alpha))
        cuts = np.rint(np.cumsum(props)[:-1] * len(idx)).astype(np.int64)  # nearest: no client favoured
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


def _parse_classes(labels, n, arg: str, name: str):
    """The class list and K of ``name:K``; refuses K out of range and uncovered classes."""
    try:
        k = int(arg)
    except ValueError:
        raise ConfigError(f"partition '{name}:{arg}' needs an integer, e.g. {name}:2")
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
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].append(chunk)
    return [np.concatenate(p) for p in parts]


@register_partition("classes", ":K (K random classes per client)")
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


@register_partition("classes_cyclic", ":K (K consecutive classes, round-robin)")
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


def _parse_skewed(arg: str):
    try:
        m, a, b = (int(v) for v in arg.split(":"))
    except ValueError:
        raise ConfigError(
            f"partition 'skewed:{arg}' needs three integers M:A:B (M minority labels per client "
            f"with A samples each, B samples of every other label), e.g. skewed:2:2:62"
        )
    if m < 0 or a < 0 or b < 0 or (a == 0 and b == 0):
        raise ConfigError(f"skewed:M:A:B needs non-negative M, A, B and not A = B = 0, got skewed:{arg}")
    return m, a, b


def _deal_skewed(labels, n, rng, m: int, a: int, b: int, spec: str):
    """Every client draws M distinct minority labels (seeded, uniformly) and takes A samples
    of each of them and B samples of every other label, without replacement from one
    shuffled queue per label. Samples left in the queues afterwards belong to no client
    (they are simply not used: the pool is larger than the clients' needs). If a label's
    queue runs dry before every client got its share, DataError says so rather than
    silently giving later clients a different distribution."""
    classes = np.unique(labels)
    c = len(classes)
    if m > c:
        raise ConfigError(f"{spec}: M = {m} minority labels but the data has only {c} labels")
    queues = [rng.permutation(np.flatnonzero(labels == cl)) for cl in classes]
    taken = np.zeros(c, dtype=np.int64)
    parts: List[np.ndarray] = []
    for i in range(n):
        minority = set(rng.choice(c, size=m, replace=False).tolist()) if m else set()
        mine = []
        for j in range(c):
            want = a if j in minority else b
            if taken[j] + want > len(queues[j]):
                raise DataError(
                    f"partition {spec!r}: label {classes[j]} has {len(queues[j])} samples, not enough "
                    f"for client {i + 1} of {n} (each takes {a} or {b}); lower --num-clients or the "
                    f"per-label counts"
                )
            mine.append(queues[j][taken[j]:taken[j] + want])
            taken[j] += want
        parts.append(np.concatenate(mine))
    return parts


@register_partition("skewed", ":M:A:B")
def _skewed(labels, n, rng, arg):
    m, a, b = _parse_skewed(arg)
    return _deal_skewed(labels, n, rng, m, a, b, f"skewed:{arg}")


@register_partition("mix2fld", " (= skewed:2:2:62)")
def _mix2fld(labels, n, rng, arg):
    if arg:
        raise ConfigError(f"partition 'mix2fld' takes no argument (it is skewed:2:2:62), got 'mix2fld:{arg}'")
    return _deal_skewed(labels, n, rng, 2, 2, 62, "mix2fld")
