"""Synthetic partitions of a labelled pool over clients.

Every partition assigns every sample to exactly one client (tests check this) and
depends only on the labels, the number of clients and the seed (``dirichlet_capped``
also on the dataset's minimum client size, where it exceeds MIN): never on the
number of ranks.

Specs: ``iid``; ``dirichlet:ALPHA`` (per-class proportions drawn from
Dir(ALPHA) over clients, nothing else: the plain label-skew rule, which leaves
client sizes free); ``dirichlet_capped:ALPHA[:MIN]`` (the rule of the code FedML,
MOON and FedAlign ship: the same per-class draw, but a client already holding
N/n samples takes no more, and the whole draw is repeated until every client
holds MIN samples, default 10; client sizes vary less: a coefficient of
variation of about 0.27 against 0.40 for 16 clients at alpha 0.5 on CIFAR-10,
0.05 against 0.13 on CIFAR-100);
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
to no client; ``deficient:L1,L2:A:B`` likewise, with the *same* minority labels on
every client (XorMixFL: every device holds 2 samples of the target labels, 60 of
the others).

The server's own base set (one-shot methods; ``server_*`` data options, see
:class:`fedhpc.data.base.ServerDataOptions`). :func:`fedhpc.data.build_dataset`
opens a :func:`server_set_request` around the dataset's builder; every builder of
a pooled dataset partitions through :func:`make_partition`, which then first takes
the server's samples out of the pool (per label, a seeded draw independent of the
partition's own stream) and partitions the rest. Its result is then a
:class:`Partition` whose ``server_indices`` (into the same pool) the in-memory data
turn into ``server_data()``. The request travels as a context variable rather than
a parameter so that it reaches the one place every dataset partitions (digits, the
IDX / CIFAR readers, synthetic partitions of natural datasets) without each builder
forwarding it; a builder that never partitions through here (``natural``) or that
writes clients to an HDF5 store leaves the request unserved, and ``build_dataset``
or the store refuses the run with the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError, DataError

#: bumped whenever a partition spec starts to mean a different split (2: classes:K became a
#: random draw). Part of a run's identity, so an older checkpoint is not resumed onto new data.
PARTITION_RULES = 2

PartitionFn = Callable[[np.ndarray, int, np.random.Generator, str], List[np.ndarray]]
_PARTITIONS: Dict[str, Tuple[PartitionFn, str]] = {}
#: name -> a check of the spec's argument alone (no labels): what can be refused before any data loads
_ARG_CHECKS: Dict[str, Callable[[str], object]] = {}
#: partitions that redraw until every client holds enough samples: they are told the caller's
#: ``min_samples`` (``fn(..., min_samples=)``) so that their redraw aims at it too
_TAKES_MIN_SAMPLES = set()


def register_partition(name: str, help: str, check: Optional[Callable[[str], object]] = None,
                       takes_min_samples: bool = False):
    """Register ``fn(labels, n, rng, arg)`` under ``name``; ``check(arg)`` raises ConfigError for an
    argument that no data could make valid (the partition calls it too, so the two agree).
    ``takes_min_samples``: ``fn`` also takes the keyword ``min_samples`` of :func:`make_partition`."""
    def deco(fn: PartitionFn) -> PartitionFn:
        _PARTITIONS[name] = (fn, help)
        if check is not None:
            _ARG_CHECKS[name] = check
        if takes_min_samples:
            _TAKES_MIN_SAMPLES.add(name)
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


def check_partition(spec: str) -> None:
    """Refuse ``spec`` if its name or argument is wrong whatever the data (``dirichlet:-1``,
    ``classes:two``). Pure, so the launcher and the sweep call it before loading a dataset;
    what depends on the labels or the client count is checked when the partition is made."""
    name, arg = parse_partition(spec)
    if name in _ARG_CHECKS:
        _ARG_CHECKS[name](arg)


def canonical_partition(spec: str) -> str:
    """``spec`` written one way for each split it names, so that a resume compares meanings:
    'Dirichlet:.50' and 'dirichlet:0.5' are one split, as are 'dirichlet_capped:0.5' and its
    default MIN written out, or 'deficient:3,1:2:60' and 'deficient:1,3:2:60' (the argument as its
    check parses it: every partition draws from that and the seed alone). 'auto' stays 'auto':
    what it means depends on the dataset. A spec no partition reads today is returned as typed."""
    text = str(spec).strip()
    if text.lower() in ("", "auto", "default"):
        return "auto"
    try:
        name, arg = parse_partition(text)
        value = _ARG_CHECKS[name](arg) if name in _ARG_CHECKS else arg
    except ConfigError:
        return text

    def spelled(v) -> str:
        if isinstance(v, tuple):
            return ":".join(spelled(e) for e in v)
        if isinstance(v, list):
            return ",".join(spelled(e) for e in v)
        return repr(v) if isinstance(v, float) else str(v)
    return name if value in (None, "") else f"{name}:{spelled(value)}"


class Partition(list):
    """A client partition (list of index arrays) that also names the server's own samples.

    ``server_indices``: sorted rows of the pool that form the server's base set
    (assigned to no client), or None when no server set was requested.
    """

    server_indices: Optional[np.ndarray] = None


#: the active server-set request (a ServerDataOptions), set by build_dataset around a builder
_SERVER_REQUEST: contextvars.ContextVar = contextvars.ContextVar("fedhpc_server_request", default=None)
#: how many partitions served the active request (build_dataset checks that one did)
_SERVED: contextvars.ContextVar = contextvars.ContextVar("fedhpc_server_served", default=None)


@contextlib.contextmanager
def server_set_request(options) -> Iterator[List[int]]:
    """Within the block, :func:`make_partition` carves ``options``' server set out of the pool.

    Yields a list that collects one entry per partition that served the request, so the
    caller can tell whether the dataset's builder partitioned through here at all.
    """
    served: List[int] = []
    t1 = _SERVER_REQUEST.set(options if options is not None and options.active else None)
    t2 = _SERVED.set(served)
    try:
        yield served
    finally:
        _SERVER_REQUEST.reset(t1)
        _SERVED.reset(t2)


def carve_server_set(labels: np.ndarray, options, seed: int) -> np.ndarray:
    """Sorted pool rows of the server's base set: ``options.counts`` samples of every label.

    Per label (in label order) the first ``count`` rows of a permutation drawn from
    ``default_rng([seed, 0x5E4E, label])``: independent of the client partition's stream
    and of the other labels, so changing one label's count moves no other label's samples.
    """
    labels = np.asarray(labels)
    present = np.unique(labels)
    unknown = [c for c in options.deficient_labels() if c not in set(present.tolist())]
    if unknown:
        raise ConfigError(f"data option server_deficient names label(s) {unknown} that the training pool does "
                          f"not hold (its labels: {present.tolist()}); list labels of this dataset")
    rows = []
    for c, want in sorted(options.counts(present.tolist()).items()):
        idx = np.flatnonzero(labels == c)
        if want > len(idx):
            raise ConfigError(f"the server's base set asks for {want} samples of label {c} but the training pool "
                              f"holds {len(idx)}; lower data option server_per_label (or "
                              f"server_deficient_count) to at most {len(idx)}")
        rng = np.random.default_rng([int(seed), 0x5E4E, int(c)])
        rows.append(idx[rng.permutation(len(idx))[:want]])
    return np.sort(np.concatenate(rows)) if rows else np.zeros(0, np.int64)


def make_partition(
    spec: str, labels: np.ndarray, num_clients: int, seed: int, min_samples: int = 1
) -> List[np.ndarray]:
    """Split indices 0..len(labels)-1 over ``num_clients`` clients following ``spec``.

    Under a :func:`server_set_request` the server's base set is taken out first and the
    rest is partitioned: the result is then a :class:`Partition` with ``server_indices``.
    """
    request = _SERVER_REQUEST.get()
    if request is not None:
        labels = np.asarray(labels)
        server = carve_server_set(labels, request, seed)
        rest = np.setdiff1d(np.arange(len(labels)), server, assume_unique=True)
        parts = Partition(rest[p] for p in _partition(spec, labels[rest], num_clients, seed, min_samples))
        parts.server_indices = server
        served = _SERVED.get()
        if served is not None:
            served.append(len(server))
        return parts
    return _partition(spec, labels, num_clients, seed, min_samples)


def _partition(spec: str, labels: np.ndarray, num_clients: int, seed: int, min_samples: int) -> List[np.ndarray]:
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
    fn = _PARTITIONS[name][0]
    if name in _TAKES_MIN_SAMPLES:
        parts = fn(labels, num_clients, rng, arg, min_samples=min_samples)
    else:
        parts = fn(labels, num_clients, rng, arg)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    small = [k for k, p in enumerate(parts) if len(p) < min_samples]
    if small:
        raise DataError(
            f"partition {spec!r} leaves {len(small)} of {num_clients} clients with fewer than "
            f"{min_samples} samples (e.g. client {small[0]}); use fewer clients or a milder "
            f"skew (larger Dirichlet alpha, more classes per client)"
        )
    return parts


def _no_argument(name: str, meaning: str = ""):
    def check(arg: str) -> None:
        if arg:
            raise ConfigError(f"partition {name!r} takes no argument{meaning}, got '{name}:{arg}'; write {name}")
    return check


@register_partition("iid", "", check=_no_argument("iid"))
def _iid(labels, n, rng, arg):
    _no_argument("iid")(arg)
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
                 rng: np.random.Generator) -> Optional[List[np.ndarray]]:
    """One draw of ``dirichlet_capped`` over the classes' index arrays ``members``; None where
    a class found no client to take it (all proportions left by the cap are exactly 0)."""
    parts: List[List[np.ndarray]] = [[] for _ in range(n)]
    sizes = np.zeros(n, dtype=np.int64)
    for idx in members:
        idx = rng.permutation(idx)
        props = rng.dirichlet(np.full(n, alpha))
        props[sizes * n >= total] = 0.0  # integer form of size >= N/n: no float rounding at the cap
        mass = props.sum()
        if not mass > 0:
            return None
        # A zeroed p_j repeats the cumulative sum exactly, so the capped client's chunk is empty.
        cuts = np.rint(np.cumsum(props / mass)[:-1] * len(idx)).astype(np.int64)
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].append(chunk)
            sizes[k] += len(chunk)
    return [np.concatenate(p) for p in parts]


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
        parts = _capped_draw(members, n, total, alpha, rng)
        if parts is not None and min(len(p) for p in parts) >= minimum:
            return parts
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


@register_partition("skewed", ":M:A:B", check=_parse_skewed)
def _skewed(labels, n, rng, arg):
    m, a, b = _parse_skewed(arg)
    return _deal_skewed(labels, n, rng, m, a, b, f"skewed:{arg}")


@register_partition("mix2fld", " (= skewed:2:2:62)", check=_no_argument("mix2fld", " (it is skewed:2:2:62)"))
def _mix2fld(labels, n, rng, arg):
    _no_argument("mix2fld", " (it is skewed:2:2:62)")(arg)
    return _deal_skewed(labels, n, rng, 2, 2, 62, "mix2fld")


def _parse_deficient(arg: str):
    """(minority labels, A, B) of ``deficient:L1,L2,...:A:B``, checked as far as possible without the labels."""
    try:
        listed, a, b = arg.split(":")
        minority = sorted({int(v) for v in listed.replace("+", ",").split(",") if v.strip()})
        a, b = int(a), int(b)
    except ValueError:
        raise ConfigError(f"partition 'deficient:{arg}' needs L1,L2,...:A:B (labels every client holds A "
                          f"samples of, B samples of every other label), e.g. deficient:0,2:2:60")
    if a < 0 or b < 0 or (a == 0 and b == 0):
        raise ConfigError(f"deficient:L:A:B needs non-negative A, B and not A = B = 0, got deficient:{arg}")
    return minority, a, b


@register_partition("deficient", ":L1,L2,...:A:B (same minority labels on every client)", check=_parse_deficient)
def _deficient(labels, n, rng, arg):
    """XorMixFL's devices: every client takes A samples of each listed label and B of every other
    label (the paper: 2 of the target label, 60 of the others), dealt like ``skewed``."""
    minority, a, b = _parse_deficient(arg)
    classes = np.unique(labels)
    missing = [c for c in minority if c not in set(classes.tolist())]
    if missing:
        raise ConfigError(f"partition 'deficient:{arg}' names label(s) {missing} the pool does not hold "
                          f"(its labels: {classes.tolist()})")
    spec = f"deficient:{arg}"
    queues = [rng.permutation(np.flatnonzero(labels == cl)) for cl in classes]
    taken = np.zeros(len(classes), dtype=np.int64)
    parts: List[np.ndarray] = []
    for i in range(n):
        mine = []
        for j, cl in enumerate(classes):
            want = a if int(cl) in minority else b
            if taken[j] + want > len(queues[j]):
                raise DataError(
                    f"partition {spec!r}: label {cl} has {len(queues[j])} samples, not enough for client "
                    f"{i + 1} of {n} (each takes {want}); lower --num-clients or the per-label counts")
            mine.append(queues[j][taken[j]:taken[j] + want])
            taken[j] += want
        parts.append(np.concatenate(mine))
    return parts
