"""Partitions that deal fixed counts per client and leave the rest of the pool to no client:
``skewed:M:A:B`` / ``mix2fld`` (Mix2FLD) and ``deficient:L1,L2,...:A:B`` (XorMixFL)."""

from __future__ import annotations

from typing import List

import numpy as np

from ...errors import ConfigError, DataError
from . import no_argument, register_partition


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


def _deal(labels, n, rng, minority_of, a: int, b: int, spec: str) -> List[np.ndarray]:
    """Every client takes A samples of each of its minority labels (``minority_of(i)``: label
    positions, called once per client in client order, after the queues are drawn) and B samples
    of every other label, without replacement from one shuffled queue per label. Samples left in
    the queues afterwards belong to no client (the pool is larger than the clients' needs). If a
    label's queue runs dry before every client got its share, DataError says so rather than
    silently giving later clients a different distribution."""
    classes = np.unique(labels)
    queues = [rng.permutation(np.flatnonzero(labels == cl)) for cl in classes]
    taken = np.zeros(len(classes), dtype=np.int64)
    parts: List[np.ndarray] = []
    for i in range(n):
        minority = minority_of(i)
        mine = []
        for j, cl in enumerate(classes):
            want = a if j in minority else b
            if taken[j] + want > len(queues[j]):
                raise DataError(
                    f"partition {spec!r}: label {cl} has {len(queues[j])} samples, not enough for client "
                    f"{i + 1} of {n} (each takes {a} or {b}); lower --num-clients or the per-label counts")
            mine.append(queues[j][taken[j]:taken[j] + want])
            taken[j] += want
        parts.append(np.concatenate(mine))
    return parts


def _deal_skewed(labels, n, rng, m: int, a: int, b: int, spec: str):
    """Every client draws M distinct minority labels (seeded, uniformly), then is dealt as :func:`_deal` says."""
    c = len(np.unique(labels))
    if m > c:
        raise ConfigError(f"{spec}: M = {m} minority labels but the data has only {c} labels")
    return _deal(labels, n, rng, lambda i: set(rng.choice(c, size=m, replace=False).tolist()) if m else set(),
                 a, b, spec)


@register_partition("skewed", ":M:A:B", check=_parse_skewed)
def _skewed(labels, n, rng, arg):
    m, a, b = _parse_skewed(arg)
    return _deal_skewed(labels, n, rng, m, a, b, f"skewed:{arg}")


@register_partition("mix2fld", " (= skewed:2:2:62)", check=no_argument("mix2fld", " (it is skewed:2:2:62)"))
def _mix2fld(labels, n, rng, arg):
    no_argument("mix2fld", " (it is skewed:2:2:62)")(arg)
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
    positions = {j for j, cl in enumerate(classes.tolist()) if cl in minority}
    return _deal(labels, n, rng, lambda i: positions, a, b, f"deficient:{arg}")
