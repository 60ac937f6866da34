"""Hand-computed rounds of the FLD family (Mix2FLD paper Alg. 1): FLD, MixFLD, Mix2FLD.

One round: each sampled device trains the global model with plain SGD on CE (Eq. 1)
while averaging its softmax outputs per label (Eq. 2, summed sample by sample here);
the server averages them per label over the devices that saw the label (Eq. 3), then
runs K_s plain SGD steps of Eq. 5 (CE to the seed's label + beta * CE to the label
mixture of global output rows) on the server's samples, full batches, no micro-batching.

The server's samples are built here from the devices' raw training data, not with the
algorithm's seed functions (:func:`server_samples_by_hand`): FLD's raw seeds, MixFLD's
mixtures (Eq. 6) under the documented label schedules (balanced, shared), and Mix2FLD's inverse mixups
(Eqs. 7-8: lambda_hat = lambda / (2 lambda - 1) for N = 2, the inverse of the circulant
written out by hand for N > 2), each output's hard label checked against the raw labels
behind it. Shared with fedhpc: the data, the documented seeded draws (which samples, which
label pairs, which seeds are combined, in the documented order) and the server trainer's
documented batch order.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import derive_seed
from fedhpc.engine import sample_clients
from fedhpc.server.trainer import ServerTrainConfig, server_batches
from reference_steps import autograd, batch_indices, flat_of, reference, start_model

FAMILY_ARGV = ["--server-steps", "6", "--server-batch", "16", "--seeds-per-device", "4",
               "--inverse-per-device", "4", "--beta", "0.5"]


# ----------------------------------------------------------------------------- the server's samples, by hand

class Sample:
    """One sample the server holds: its input (float64), soft label (float64, C), label tuple,
    uploading device (-1: made by the server) and its raw sources {(device, row): coefficient}."""

    def __init__(self, x, soft, labels, owner, sources):
        self.x, self.soft, self.labels, self.owner, self.sources = x, soft, tuple(labels), owner, sources


def device_data(eng, cid):
    c = eng.data.client(cid)
    return eng.data.transform(c.x, False, None).double(), c.y.tolist()


def seed_ratios(o) -> List[float]:
    """Eq. 6's ratios: --seed-ratios as given, else (lam, ..., lam, 1 - (N-1) lam)."""
    if o.seed_ratios.strip():
        return [float(v) for v in o.seed_ratios.split(",")]
    return [o.seed_lam] * (o.seed_mix_n - 1) + [1 - (o.seed_mix_n - 1) * o.seed_lam]


def raw_seeds_by_hand(eng, cid) -> List[Sample]:
    """FLD: N_S of the device's samples, without replacement (randperm of its seeded generator)."""
    x, y = device_data(eng, cid)
    C = eng.data.num_classes
    g = torch.Generator().manual_seed(derive_seed(eng.cfg.seed, "seed-samples", cid))
    pick = torch.randperm(len(y), generator=g)[:eng.algo.options.seeds_per_device].tolist()
    return [Sample(x[i], F.one_hot(torch.tensor(y[i]), C).double(), (y[i],), cid, {(cid, i): 1.0}) for i in pick]


def balanced_deck_by_hand(schedule_seed, slots, n, num_classes) -> List[List[int]]:
    """The "balanced" schedule's tuples: each slot takes the first N labels not yet in its tuple from a
    deck of label permutations (permutation k from derive_seed(seed, "seed-label-deck", k), appended
    when no label of the deck can join the tuple), removing them from the deck."""
    deck, drawn, out = [], 0, []
    for _ in range(slots):
        t = []
        while len(t) < n:
            free = [i for i, label in enumerate(deck) if label not in t]
            if not free:
                g = torch.Generator().manual_seed(derive_seed(schedule_seed, "seed-label-deck", drawn))
                deck += torch.randperm(num_classes, generator=g).tolist()
                drawn += 1
                continue
            t.append(deck.pop(free[0]))
        out.append(t)
    return out


def mixed_seeds_by_hand(eng, cid) -> List[Sample]:
    """MixFLD's seeds (Eq. 6) under the label schedules of fedhpc.exchanges.seed_samples' docstring.
    Slot s's preference order: "shared", a permutation drawn from derive_seed(seed, "seed-labels", s);
    "balanced" (the default), the slot's tuple dealt from the deck, then the rest of that permutation.
    The device takes the first N labels it holds, rotated by cid mod N (the m-th label of the rotated
    tuple gets lam_m); the sample of each label is the next of a per-label queue, shuffled from the
    device's generator when it runs empty."""
    o, C = eng.algo.options, eng.data.num_classes
    pairing = getattr(eng.algo, "seed_pairing", o.seed_pairing)
    assert pairing in ("shared", "balanced"), f"the hand computation writes out no --seed-pairing {pairing!r}"
    lam = seed_ratios(o)
    n = len(lam)
    deck = balanced_deck_by_hand(eng.cfg.seed, o.seeds_per_device, n, C) if pairing == "balanced" else None
    x, y = device_data(eng, cid)
    g = torch.Generator().manual_seed(derive_seed(eng.cfg.seed, "seed-samples", cid))
    held = set(y)
    queues: Dict[int, List[int]] = {}

    def take(label):
        if not queues.get(label):
            members = [i for i, v in enumerate(y) if v == label]
            queues[label] = [members[j] for j in torch.randperm(len(members), generator=g).tolist()]
        return queues[label].pop(0)

    out = []
    for s in range(o.seeds_per_device):
        perm = torch.randperm(C, generator=torch.Generator().manual_seed(
            derive_seed(eng.cfg.seed, "seed-labels", s))).tolist()
        order = perm if deck is None else deck[s] + [label for label in perm if label not in deck[s]]
        base = [label for label in order if label in held][:n]
        r = cid % n
        labels = [base[(m - r) % n] for m in range(n)]
        rows = [take(label) for label in labels]
        soft = torch.zeros(C, dtype=torch.float64)
        for m, label in enumerate(labels):
            soft[label] += lam[m]
        out.append(Sample(sum(lam[m] * x[rows[m]] for m in range(n)), soft, labels, cid,
                          {(cid, rows[m]): lam[m] for m in range(n)}))
    return out


def inverse_weights(lam: Sequence[float]) -> np.ndarray:
    """W[n, r]: the weight of the rotation-r seed in the output of label n (Eq. 8). N = 2: the closed
    form lambda_hat = lambda / (2 lambda - 1) on the seed that gave the label lambda, 1 - lambda_hat on
    the other; N > 2: the inverse of the circulant M[r, l] = lam[(r + l) mod N], by numpy."""
    n = len(lam)
    if n == 2:
        hat = lam[0] / (2 * lam[0] - 1)
        return np.array([[hat, 1 - hat], [1 - hat, hat]])
    return np.linalg.inv(np.array([[lam[(r + col) % n] for col in range(n)] for r in range(n)]))


def combinations_by_hand(seeds: List[Sample], need: int, n: int, g: torch.Generator) -> List[Tuple[int, ...]]:
    """Which seeds the server combines (fedhpc.exchanges.inverse_mixup's documented rule): seeds
    grouped by label cycle (the tuple rotated to start at its smallest label) and by that rotation;
    in passes, per cycle in sorted order, each rotation's seeds in a seeded random order, every
    rotation-0 seed takes the first unused partner of each next rotation from a device not yet in
    the combination (and not completing a combination made before); each pass's combinations are
    shuffled; a pass that finds none enumerates the rest. Until ``need`` combinations exist."""
    groups: Dict[Tuple[int, ...], List[List[int]]] = {}
    for row, s in enumerate(seeds):
        t = list(s.labels)
        if len(set(t)) != n:
            continue
        r = t.index(min(t))
        groups.setdefault(tuple(t[r:] + t[:r]), [[] for _ in range(n)])[r].append(row)
    owner = [s.owner for s in seeds]
    made, combos = set(), []
    while len(combos) < need:
        fresh = []
        for key in sorted(groups):
            lists = groups[key]
            if any(not rows for rows in lists):
                continue
            order = [[rows[i] for i in torch.randperm(len(rows), generator=g).tolist()] for rows in lists]
            used = [set() for _ in lists]
            for a in order[0]:
                combo = [a]
                for r in range(1, n):
                    pick = next((b for b in order[r] if b not in used[r] and owner[b] not in {owner[c] for c in combo}
                                 and not (r == n - 1 and tuple(combo + [b]) in made)), None)
                    if pick is None:
                        break
                    combo.append(pick)
                if len(combo) == n:
                    made.add(tuple(combo))
                    fresh.append(tuple(combo))
                    for r, b in enumerate(combo):
                        used[r].add(b)
        if not fresh:
            for key in sorted(groups):
                for combo in itertools.product(*groups[key]):
                    if len({owner[b] for b in combo}) == n and combo not in made:
                        made.add(combo)
                        fresh.append(combo)
        if not fresh:
            break
        combos.extend(fresh[i] for i in torch.randperm(len(fresh), generator=g).tolist())
    return combos


def inverse_mixup_by_hand(eng, seeds: List[Sample], devices: int, strict: bool) -> List[Sample]:
    """Mix2FLD's server samples: N_I per device, each the W-weighted sum of N seeds of one label cycle
    from N different devices, carrying the cycle's n-th label hard. Each output's hard label is
    checked against the raw labels behind it: its coefficients on a label's raw samples sum to 1
    for its own label and to 0 for every other."""
    o, C = eng.algo.options, eng.data.num_classes
    lam = seed_ratios(o)
    n = len(lam)
    w = inverse_weights(lam)
    n_out = o.inverse_per_device * devices
    g = torch.Generator().manual_seed(derive_seed(eng.cfg.seed, "inverse-mixup"))
    combos = combinations_by_hand(seeds, -(-n_out // n), n, g)
    if not strict:
        n_out = min(n_out, n * len(combos))
    assert n * len(combos) >= n_out, "too few combinations for the hand computation's settings"
    raw_labels = {cid: device_data(eng, cid)[1] for cid in {s.owner for s in seeds}}
    out = []
    for combo in combos[:-(-n_out // n)]:
        cycle = seeds[combo[0]].labels  # rotation 0: starts at the cycle's smallest label
        for k in range(n):
            x = sum(float(w[k, r]) * seeds[b].x for r, b in enumerate(combo))
            sources: Dict[Tuple[int, int], float] = {}
            for r, b in enumerate(combo):
                for src, coef in seeds[b].sources.items():
                    sources[src] = sources.get(src, 0.0) + float(w[k, r]) * coef
            by_label = torch.zeros(C, dtype=torch.float64)
            for (cid, row), coef in sources.items():
                by_label[raw_labels[cid][row]] += coef
            hard = F.one_hot(torch.tensor(cycle[k]), C).double()
            assert torch.allclose(by_label, hard, atol=1e-12), \
                f"inverse mixup of {cycle} for label {cycle[k]}: raw label weights {by_label.tolist()}"
            out.append(Sample(x, hard, (cycle[k],), -1, sources))
    return out[:n_out]


def server_samples_by_hand(eng, delivering: Optional[Sequence[int]] = None) -> List[Sample]:
    """The samples the server trains on: every training device's seeds (``delivering`` None, as
    --seed-delivery always) or those of the devices ``delivering`` (--seed-delivery channel), in
    (device, position) order; Mix2FLD's inverse mixups of them."""
    algo = eng.cfg.algo
    cids = sorted(eng.training_clients if delivering is None else delivering)
    make = raw_seeds_by_hand if algo == "fld" else mixed_seeds_by_hand
    seeds = [s for cid in cids for s in make(eng, cid)]
    if algo != "mix2fld" or not seeds:
        return seeds
    devices = len(eng.training_clients) if delivering is None else len(cids)
    return inverse_mixup_by_hand(eng, seeds, devices, strict=delivering is None)


def fld_round(eng, arrived=None):
    """Round 1 by hand. ``arrived``: the devices whose round-1 upload got through the channel
    (--seed-delivery channel: the server has only their tables and their seeds); None: every
    sampled device's table arrives and every device's seeds do (--seed-delivery always)."""
    cfg, algo, C = eng.cfg, eng.algo, eng.data.num_classes
    sampled = sample_clients(cfg.seed, 0, eng.data.num_clients, cfg.clients_per_round)
    tables, present = [], []
    for cid in sampled:
        if arrived is not None and cid not in arrived:
            continue
        c = eng.data.client(cid)
        m = start_model(eng)
        sums, counts = torch.zeros(C, C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        for idx in batch_indices(cfg.seed, 0, cid, 0, c.num_train, cfg.batch_size):
            x, y = c.x[idx].double(), c.y[idx]
            logits = m(x)
            p = F.softmax(logits, -1).detach()
            for i in range(len(y)):
                sums[y[i]] += p[i]
                counts[y[i]] += 1
            grads = autograd(m, F.cross_entropy(logits, y))
            with torch.no_grad():
                for prm, gr in zip(m.parameters(), grads):
                    prm -= cfg.lr * gr
        tables.append([sums[n] / counts[n] for n in range(C)])
        present.append(counts > 0)
    g = torch.zeros(C, C, dtype=torch.float64)
    has = torch.zeros(C, dtype=torch.bool)
    for n in range(C):
        rows = [tb[n] for tb, pr in zip(tables, present) if pr[n]]
        if rows:
            g[n], has[n] = sum(rows) / len(rows), True

    # the server's samples, built here from the raw data (server_samples_by_hand)
    samples = server_samples_by_hand(eng, None if arrived is None else sorted(arrived))
    o = algo.options
    m = start_model(eng)
    if len(samples) == 0 or not has.any():  # no sample or no table at the server: no conversion
        return {"global_state": flat_of(eng, m), "teacher": g}
    tcfg = ServerTrainConfig(steps=o.server_steps, batch_size=min(o.server_batch, len(samples)),
                             micro_batch=o.server_micro_batch, lr=o.server_lr)
    sx, sy = torch.stack([s.x for s in samples]), torch.stack([s.soft for s in samples])
    for idx in server_batches(len(sx), tcfg, derive_seed(cfg.seed, "server-train", 0)):
        logits = m(sx[idx])
        logp = F.log_softmax(logits, -1)
        loss = 0
        for i in range(len(idx)):  # Eq. 5 sample by sample
            yi = sy[idx[i]]
            w = yi * has.double()
            loss = loss - (yi * logp[i]).sum()
            if w.sum() > 0:
                loss = loss - o.beta * ((w @ g) / w.sum() * logp[i]).sum()
        grads = autograd(m, loss / len(idx))
        with torch.no_grad():
            for prm, gr in zip(m.parameters(), grads):
                prm -= o.server_lr * gr
    return {"global_state": flat_of(eng, m), "teacher": g}


for _name in ("fld", "mixfld", "mix2fld"):
    fn = reference(_name)(lambda eng: fld_round(eng))
    fn.argv = FAMILY_ARGV
    fn.standard_argv = FAMILY_ARGV
