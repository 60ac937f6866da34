"""Seed samples of FLD / MixFLD / Mix2FLD (Mix2FLD paper, Sec. III, Alg. 1) as pure functions and one collective.

At the first global update every device uploads N_S seed samples, which the
server keeps for its output-to-model conversion (Eq. 5):

* FLD: :func:`raw_seeds`, N_S raw samples drawn without replacement.
* MixFLD: :func:`mixed_seeds`, Eq. 6: ``s_hat = lam * s_i + (1 - lam) * s_j`` with
  labels ``L(i) != L(j)`` and lam in (0, 0.5): the *first* sample of the tuple gets
  lam, as in Eq. 6, so the soft label puts lam on L(i) and 1 - lam on L(j).
  General N (Proposition 1) mixes N samples of N different labels with ratios
  (lam_1, ..., lam_N) summing to 1; :func:`mixing_ratios` gives the defaults.
* Mix2FLD: :func:`fedhpc.exchanges.inverse_mixup.inverse_mixup` on the server, Eqs. 7-8 (see there).

:func:`collect_seeds` is the upload: every rank hands in the seed sets of the
devices it hosts, one ``all_gather_object`` carries them, and every rank sorts
them by (device id, position), so the collected set is identical for any
number of ranks.

How devices choose label tuples (``pairing``); the paper leaves this open beyond "randomly
selects two ... samples having different labels" (Sec. III-B). The server can only invert seeds
whose label tuples are rotations of each other (Eq. 8; for N = 2: (a, b) on one device and
(b, a) on another), so the schedules coordinate the labels and leave the samples random:

* ``"balanced"`` (the default for new runs): seed slot s on every device uses the same label
  tuple, and device ``cid`` its rotation ``cid mod N``, as under ``"shared"``; but the slots'
  tuples are dealt from a deck of seeded label permutations (:func:`balanced_tuples`), N
  distinct labels at a time, so that consecutive slots run through *every* label before any
  label comes back. With 10 labels and N = 2, slots 0-4 hold each label once, slots 5-9 once
  more: every device's N_S seeds, and the server's set, hold every label N_S N / 10 times
  (N_S = 10, 20, 50), or within one slot of it when 10 does not divide N_S N. Every slot
  still has |D| / N devices in each rotation (25 cross-device pairs per slot with 10 devices
  and N = 2), so N_I = 2 N_S is within reach.
* ``"shared"``: the schedule before ``"balanced"``: each slot's tuple drawn on its own, the first
  N labels of a fresh permutation from ``derive_seed(schedule_seed, "seed-labels", s)``. Slots
  then repeat labels and miss others: at N_S = 10 the server's set of run seed 0 lacks labels 1,
  5 and 6 (tests/test_seed_coverage.py). Kept so that a run started under it resumes under it.
* ``"random"``: the literal reading of Eq. 6 (i uniform over the device's data, j uniform over
  the samples of other labels). With 10 labels a seed finds on average about one mirrored
  partner among 90 seeds of 9 other devices, so a third of the seeds have none and N_I = 2 N_S
  is out of reach.
* ``"auto"`` (the option's default): ``"balanced"``, except for a run resumed from a checkpoint
  written before ``"balanced"`` existed, which keeps ``"shared"`` (:func:`resolve_pairing`).

Under the two shared schedules a device missing a label of its slot's tuple takes the first N
labels it holds of the slot's preference order (the tuple, then the other labels in a seeded
order common to all devices), so devices missing the same labels still agree with each other.

Samples inside a label are taken from a shuffled per-label queue, so no raw
sample enters two seeds of a device until every sample of its label has been
used once (labels with few samples, like Mix2FLD's 2-sample labels, are then
reused). Inputs are mixed in model-input space (``data.transform(x, False,
None)``); the wire size follows the paper (8 bits per pixel, b_s = 6,272 bits
for MNIST) and the samples are not quantised.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError, DataError
from ..seeding import derive_seed
from .ownership import canonical_order

# --------------------------------------------------------------------------- options

@dataclass
class SeedSampleOptions:
    """Seed-sample settings an FLD-family algorithm can mix into its own options."""

    seeds_per_device: int = field(default=10, metadata={
        "help": "N_S: seed samples each device uploads once (Mix2FLD paper: 10 or 50)"})
    inverse_per_device: int = field(default=10, metadata={
        "help": "N_I: inversely mixed samples the server makes per device (N_I >= N_S; paper: 10, 20, 50, 100)"})
    seed_lam: float = field(default=0.1, metadata={
        "help": "mixing ratio lambda of Eq. 6, in (0, 1/N); the first N-1 samples get lambda each"})
    seed_mix_n: int = field(default=2, metadata={
        "help": "N: raw samples per mixed seed and mixed seeds per inverse mixup (Eq. 8)"})
    seed_ratios: str = field(default="", metadata={
        "help": "explicit ratios lambda_1,...,lambda_N (comma separated, summing to 1); overrides --seed-lam"})
    seed_pairing: str = field(default="auto", metadata={
        "help": "label tuples: balanced (every device the same tuple per slot, rotated by device id, so the "
                "server finds mirrored partners; slots dealt from a deck of label permutations, so every label "
                "is used evenly) | shared (the same, each slot's tuple drawn on its own: labels can be missed) | "
                "random (Eq. 6 read literally) | auto (balanced; a run resumed from a checkpoint that predates "
                "balanced keeps shared)",
        # compared with the checkpointed state on a resume (MixFLD.load_state_dict), which knows that
        # a checkpoint without the record ran 'shared' (the default then); the identity would fill
        # that checkpoint's {} with today's default and refuse an explicit 'shared'
        "checked_by_state": True})

    def ratios(self) -> Tuple[float, ...]:
        if self.seed_ratios.strip():
            try:
                lam = [float(v) for v in self.seed_ratios.split(",")]
            except ValueError:
                raise ConfigError(f"--seed-ratios must be comma-separated numbers, got {self.seed_ratios!r}")
            return mixing_ratios(lam, len(lam))
        return mixing_ratios(self.seed_lam, self.seed_mix_n)

    def validate(self):
        if self.seeds_per_device < 1:
            raise ConfigError(f"--seeds-per-device must be >= 1, got {self.seeds_per_device}")
        if self.inverse_per_device < 0:
            raise ConfigError(f"--inverse-per-device must be >= 0, got {self.inverse_per_device}")
        if self.seed_pairing not in PAIRINGS:
            raise ConfigError(f"--seed-pairing must be one of {', '.join(PAIRINGS)}, got {self.seed_pairing!r}")
        self.ratios()


PAIRINGS = ("auto", "balanced", "shared", "random")
#: what a run whose checkpoint does not record its pairing ran with (before "balanced" existed)
LEGACY_PAIRING = "shared"


def resolve_pairing(option: str, saved: Optional[str] = None, resumed_without_record: bool = False) -> str:
    """The schedule a run uses: ``option`` unless it is ``"auto"``, which means ``saved`` (the
    schedule its checkpoint recorded), else ``"shared"`` for a run resumed from a checkpoint that
    recorded none (written before ``"balanced"`` existed, when ``"shared"`` was the default), else
    ``"balanced"``. Raises CheckpointError where ``option`` cannot be what the checkpoint ran."""
    if saved is None and resumed_without_record:
        if option == "balanced":
            raise CheckpointError(
                f"the checkpoint's seeds were made before --seed-pairing balanced existed, with shared (the "
                f"default then) or random (if the run asked for it); resume with --seed-pairing auto (the "
                f"default: shared for such a checkpoint), shared or random")
        return LEGACY_PAIRING if option == "auto" else option
    resolved = option if option != "auto" else (saved if saved is not None else "balanced")
    if saved is not None and resolved != saved:
        raise CheckpointError(f"the checkpoint's seeds were made with --seed-pairing {saved}, this run asks for "
                              f"{resolved}; resume with --seed-pairing {saved} (or auto)")
    return resolved


def mixing_ratios(lam: Union[float, Sequence[float]], n: int = 2) -> Tuple[float, ...]:
    """The ratios (lam_1, ..., lam_N) a device mixes N samples with.

    A number lam gives (lam, ..., lam, 1 - (N-1) lam): Eq. 6's (lam, 1 - lam) for
    N = 2, and for N > 2 a circulant (Eq. 8) that is invertible exactly when
    lam != 1/N (its non-trivial eigenvalues are (1 - N lam) times roots of unity).
    lam must lie in (0, 1/N), the paper's (0, 0.5) for N = 2. A sequence is taken
    as the ratios themselves: N positive numbers summing to 1.
    """
    if n < 2:
        raise ConfigError(f"a mixed seed mixes N >= 2 samples, got N = {n}")
    if isinstance(lam, (int, float)):
        if not 0 < lam < 1 / n:
            raise ConfigError(f"mixing ratio lambda must lie in (0, 1/N) = (0, {1 / n:g}) "
                              f"(Mix2FLD Eq. 6: (0, 0.5) for N = 2), got {lam}")
        return tuple([float(lam)] * (n - 1) + [1.0 - (n - 1) * float(lam)])
    out = tuple(float(v) for v in lam)
    if len(out) != n:
        raise ConfigError(f"{len(out)} mixing ratios given for N = {n}; give exactly N")
    if not all(v > 0 for v in out) or abs(sum(out) - 1) > 1e-9:
        raise ConfigError(f"mixing ratios must be positive and sum to 1 (Eq. 8), got {out}")
    return out


# --------------------------------------------------------------------------- the seed set

@dataclass
class SeedSet:
    """Seed samples with their provenance: every sample is ``sum_s weights[:, s] * raw(source_s)``.

    ``labels`` lists the labels of the raw samples in ratio order (K = 1 for raw
    seeds, N for mixed seeds; for inverse-mixup outputs the single hard label).
    ``source_cid`` / ``source_index`` name the raw samples behind each row (the
    device and the index into that device's training data): 1 for raw seeds, N
    for mixed seeds, N*N for inverse-mixup outputs.
    """

    x: torch.Tensor             # (n, *input_shape) float, model-input space
    y: torch.Tensor             # (n, C) float: soft labels (hard for raw and inverse samples)
    labels: torch.Tensor        # (n, K) long
    source_cid: torch.Tensor    # (n, S) long
    source_index: torch.Tensor  # (n, S) long
    weights: torch.Tensor       # (n, S) float64: coefficient of each raw source
    owner: torch.Tensor         # (n,) long: uploading device; -1 = made by the server
    index: torch.Tensor         # (n,) long: position in the owner's upload (server: output position)
    kind: str                   # "raw" | "mixed" | "inverse"
    ratios: Tuple[float, ...]   # the devices' mixing ratios (lam_1..lam_N); raw: (1.0,)
    parents: Optional[torch.Tensor] = None  # inverse only: (n, N) rows of the mixed set combined
    coef: Optional[torch.Tensor] = None     # inverse only: (n, N) float64 inverse ratios lambda_hat

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.y.shape[1])

    def _map(self, fn) -> "SeedSet":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return SeedSet(**{k: (fn(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})

    def select(self, rows: torch.Tensor) -> "SeedSet":
        return self._map(lambda t: t[rows.to(t.device)])

    def to(self, device) -> "SeedSet":
        return self._map(lambda t: t.to(device))

    def wire_bytes(self, pixel_bits: int = 8) -> int:
        """Bytes of the upload: ``pixel_bits`` per input value (the paper's b_s) plus K label ids."""
        return len(self) * self.row_bytes(pixel_bits)

    def row_bytes(self, pixel_bits: int = 8) -> int:
        """Bytes of one seed on the wire.

        The ratios are the same on every device (Eq. 6: "given identically for all
        devices"), so a soft label travels as its label ids, each in the fewest whole
        bytes that hold C classes.
        """
        pixels = int(np.prod(self.x.shape[1:]))
        label_bytes = max(1, math.ceil(math.log2(max(self.num_classes, 2)) / 8))
        return math.ceil(pixels * pixel_bits / 8) + self.labels.shape[1] * label_bytes

    @staticmethod
    def cat(parts: Sequence["SeedSet"]) -> "SeedSet":
        """Rows of several sets of one kind, in the given order."""
        if not parts:
            raise DataError("no seed samples to join: no device uploaded any")
        kinds = {(p.kind, p.ratios) for p in parts}
        if len(kinds) > 1:
            raise ConfigError(f"seed sets of different kinds or mixing ratios cannot be joined: {sorted(kinds)}; "
                              f"every device must use the same seed settings")
        first = parts[0]
        kw = {}
        for f in fields(SeedSet):
            v = getattr(first, f.name)
            kw[f.name] = torch.cat([getattr(p, f.name) for p in parts]) if isinstance(v, torch.Tensor) else v
        return SeedSet(**kw)


def _int_labels(y: torch.Tensor, num_classes: int, cid: int) -> torch.Tensor:
    y = torch.as_tensor(y).reshape(-1).long().cpu()
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"client {cid}: labels must lie in [0, {num_classes}), found {int(y.min())}..{int(y.max())}")
    return y


def _check_inputs(x: torch.Tensor, y: torch.Tensor, n_seeds: int, num_classes: int, cid: int) -> torch.Tensor:
    if not torch.is_floating_point(x):
        raise ConfigError("seed samples are taken in model-input space: pass float inputs "
                          "(e.g. data.transform(x, False, None)), not raw ids or bytes")
    if n_seeds < 1:
        raise ConfigError(f"N_S (seed samples per device) must be >= 1, got {n_seeds}")
    y = _int_labels(y, num_classes, cid)
    if len(y) != x.shape[0]:
        raise DataError(f"client {cid}: {x.shape[0]} inputs but {len(y)} labels")
    if len(y) == 0:
        raise DataError(f"client {cid} has no training samples to draw seed samples from; "
                        f"leave it out of the seed collection")
    return y


# --------------------------------------------------------------------------- device side

def raw_seeds(x: torch.Tensor, y: torch.Tensor, n_seeds: int, generator: torch.Generator, *,
              cid: int, num_classes: int) -> SeedSet:
    """FLD's seeds: N_S raw samples of the device, drawn uniformly without replacement."""
    y = _check_inputs(x, y, n_seeds, num_classes, cid)
    if n_seeds > len(y):
        raise DataError(f"client {cid} has {len(y)} training samples, fewer than N_S = {n_seeds} "
                        f"raw seeds drawn without replacement; lower --seeds-per-device to {len(y)} or "
                        f"give every device more samples (fewer clients, a milder partition)")
    pick = torch.randperm(len(y), generator=generator)[:n_seeds]
    n = len(pick)
    return SeedSet(
        x=x[pick.to(x.device)].clone(), y=F.one_hot(y[pick], num_classes).to(x.dtype).to(x.device),
        labels=y[pick][:, None], source_cid=torch.full((n, 1), cid, dtype=torch.long),
        source_index=pick[:, None], weights=torch.ones(n, 1, dtype=torch.float64),
        owner=torch.full((n,), cid, dtype=torch.long), index=torch.arange(n), kind="raw", ratios=(1.0,))


class _LabelQueues:
    """Per-label shuffled queues of sample indices: no reuse before a label is exhausted."""

    def __init__(self, y: torch.Tensor, generator: torch.Generator):
        self.g = generator
        self.members = {int(c): (y == c).nonzero().flatten() for c in torch.unique(y)}
        self.queue: Dict[int, List[int]] = {c: [] for c in self.members}

    def take(self, label: int) -> int:
        q = self.queue[label]
        if not q:
            m = self.members[label]
            q.extend(m[torch.randperm(len(m), generator=self.g)].tolist())
        return q.pop(0)


@functools.lru_cache(maxsize=4096)
def _slot_permutation(schedule_seed: int, slot: int, num_classes: int) -> torch.Tensor:
    """Slot ``slot``'s label permutation, common to all devices: drawn once per process, not once
    per device (20,000 devices x 10 slots: 7 s of generator set-up). Read-only."""
    g = torch.Generator().manual_seed(derive_seed(schedule_seed, "seed-labels", slot))
    return torch.randperm(num_classes, generator=g)


@functools.lru_cache(maxsize=64)
def balanced_tuples(schedule_seed: int, n_slots: int, n: int, num_classes: int) -> Tuple[Tuple[int, ...], ...]:
    """The ``"balanced"`` schedule: slot s's label tuple, common to all devices, for s < ``n_slots``.

    Dealt from a deck: permutation k of all labels, ``derive_seed(schedule_seed, "seed-label-deck",
    k)``, is appended when the deck runs short; each slot takes the N first labels of the deck that
    are not yet in its tuple, in deck order. So each permutation is used up before the next one
    starts, every label comes once per C / N slots (C labels; within one slot of it where N does
    not divide C), and no tuple repeats a label. Cached: the same for every device."""
    if not 2 <= n <= num_classes:
        raise ConfigError(f"a label tuple of N = {n} different labels needs N <= {num_classes} labels")
    deck: List[int] = []
    drawn = 0
    out = []
    for _ in range(n_slots):
        t: List[int] = []
        while len(t) < n:
            i = next((i for i, c in enumerate(deck) if c not in t), None)
            if i is None:  # the deck holds only labels already in the tuple: the next permutation
                g = torch.Generator().manual_seed(derive_seed(schedule_seed, "seed-label-deck", drawn))
                deck.extend(torch.randperm(num_classes, generator=g).tolist())
                drawn += 1
                continue
            t.append(deck.pop(i))
        out.append(tuple(t))
    return tuple(out)


def _held_first(order: torch.Tensor, held: torch.Tensor, n: int, cid: int) -> List[int]:
    """The first N labels of ``order`` the device holds, rotated by ``cid mod N``."""
    base = order[held[order]][:n]
    # torch.roll(a, r)[m] = a[m - r]: device rotation r weighs base label l with lam[(l + r) mod N],
    # row r of Eq. 8's circulant.
    return torch.roll(base, cid % n).tolist()


def _shared_tuple(slot: int, held: torch.Tensor, n: int, num_classes: int, schedule_seed: int, cid: int) -> List[int]:
    """Slot ``slot``'s label tuple: the first N held labels of a permutation common to all devices, rotated by cid."""
    return _held_first(_slot_permutation(schedule_seed, slot, num_classes), held, n, cid)


def _balanced_tuple(slot: int, tuples: Sequence[Tuple[int, ...]], held: torch.Tensor, n: int, num_classes: int,
                    schedule_seed: int, cid: int) -> List[int]:
    """Slot ``slot``'s tuple of :func:`balanced_tuples`, rotated by cid; a device missing one of its
    labels takes its first N held labels of (the tuple, then the slot's permutation of the rest)."""
    t = tuples[slot]
    if bool(held[list(t)].all()):
        order = torch.tensor(t)
    else:
        rest = [c for c in _slot_permutation(schedule_seed, slot, num_classes).tolist() if c not in t]
        order = torch.tensor(list(t) + rest)
    return _held_first(order, held, n, cid)


def _random_tuple(counts: torch.Tensor, n: int, generator: torch.Generator) -> List[int]:
    """Eq. 6 read literally: sample i uniform, then j uniform over samples of other labels (and so on for N)."""
    w = counts.double().clone()
    out = []
    for _ in range(n):
        c = int(torch.multinomial(w, 1, generator=generator))
        out.append(c)
        w[c] = 0
    return out


def mixed_seeds(x: torch.Tensor, y: torch.Tensor, n_seeds: int, lam: Union[float, Sequence[float]],
                num_classes: int, generator: torch.Generator, *, cid: int, n_mix: int = 2,
                pairing: str = "balanced", schedule_seed: int = 0) -> SeedSet:
    """MixFLD's seeds (Eq. 6): each mixes N samples of N different labels with ratios (lam_1..lam_N).

    ``lam`` is a number (ratios from :func:`mixing_ratios` with N = ``n_mix``) or the
    N ratios themselves (N = their count; ``n_mix`` is then ignored). Soft labels put
    lam_m on the label of the m-th sample.
    ``pairing`` chooses the label tuples (module docstring); ``schedule_seed`` must be
    the same on every device (the run's seed). ``generator`` (this device's own)
    draws the samples, and the labels too under ``"random"``.
    Raises DataError when the device holds fewer than N different labels.
    """
    ratios = mixing_ratios(lam, len(lam) if not isinstance(lam, (int, float)) else n_mix)
    n = len(ratios)
    if pairing not in PAIRINGS or pairing == "auto":
        raise ConfigError(f"pairing must be one of {', '.join(p for p in PAIRINGS if p != 'auto')} "
                          f"(resolve 'auto' with resolve_pairing), got {pairing!r}")
    y = _check_inputs(x, y, n_seeds, num_classes, cid)
    counts = torch.bincount(y, minlength=num_classes)
    held = counts > 0
    if int(held.sum()) < n:
        raise DataError(f"client {cid} holds {int(held.sum())} label(s) {held.nonzero().flatten().tolist()}; "
                        f"a mixed seed needs N = {n} samples of different labels (Mix2FLD Eq. 6). Use a "
                        f"partition giving every device at least {n} labels, or raw seeds (FLD)")
    queues = _LabelQueues(y, generator)
    deck = balanced_tuples(schedule_seed, n_seeds, n, num_classes) if pairing == "balanced" else None
    tuples, sources = [], []
    for s in range(n_seeds):
        if pairing == "balanced":
            t = _balanced_tuple(s, deck, held, n, num_classes, schedule_seed, cid)
        elif pairing == "shared":
            t = _shared_tuple(s, held, n, num_classes, schedule_seed, cid)
        else:
            t = _random_tuple(counts, n, generator)
        tuples.append(t)
        sources.append([queues.take(c) for c in t])
    labels = torch.tensor(tuples, dtype=torch.long)
    src = torch.tensor(sources, dtype=torch.long)
    r = torch.tensor(ratios, dtype=torch.float64)
    xs = x[src.reshape(-1).to(x.device)].reshape((n_seeds, n) + tuple(x.shape[1:]))
    mixed = torch.einsum("m,sm...->s...", r.to(x.device), xs.double()).to(x.dtype)
    soft = torch.zeros(n_seeds, num_classes, dtype=torch.float64)
    soft.scatter_(1, labels, r.expand(n_seeds, n).clone())
    return SeedSet(x=mixed, y=soft.to(x.dtype).to(x.device), labels=labels,
                   source_cid=torch.full((n_seeds, n), cid, dtype=torch.long), source_index=src,
                   weights=r.expand(n_seeds, n).clone(), owner=torch.full((n_seeds,), cid, dtype=torch.long),
                   index=torch.arange(n_seeds), kind="mixed", ratios=ratios)


# --------------------------------------------------------------------------- the upload

def collect_seeds(comm, local: Dict[int, SeedSet], device=None) -> SeedSet:
    """The server's collected seed set: every device's upload, in (device id, position) order.

    Collective: call it on every rank with the sets of the devices that rank hosts
    (an empty dict is fine). One ``all_gather_object`` of one joined set of CPU tensors
    per rank (pickling a set per device cost 10 s a rank at 20,000 devices); the result
    is the same on every rank and for any number of ranks. ``device``: where the
    result lives (default CPU).
    """
    mine = []
    for cid, s in sorted(local.items()):
        if len(s) and bool((s.owner != cid).any()):
            raise ConfigError(f"the seed set handed in for client {cid} belongs to client(s) "
                              f"{torch.unique(s.owner).tolist()}; pass cid= when making it")
        if len(s):
            mine.append((int(cid), s.to("cpu")))
    joined_here = SeedSet.cat([s for _, s in mine]) if mine else None
    parts = comm.all_gather_object(([c for c, _ in mine], joined_here))
    uploads = collections.Counter(c for cids, _ in parts for c in cids)
    dup = sorted(c for c, n in uploads.items() if n > 1)
    if dup:
        raise ConfigError(f"client(s) {dup} uploaded seeds from more than one rank; each device must be "
                          f"hosted by exactly one rank")
    if not uploads:
        raise DataError("no device uploaded seed samples (every device was empty or left out)")
    joined = SeedSet.cat([s for _, s in parts if s is not None])
    joined = joined.select(canonical_order(joined.owner, joined.index))
    return joined if device is None else joined.to(device)
