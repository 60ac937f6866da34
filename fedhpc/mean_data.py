"""Mean-data exchange of MAFL (FedMix paper, Alg. 1) as a collective any algorithm can call.

Every client k splits its training data at random into batches of at least M_k
samples, averages each batch (inputs and one-hot labels) and sends the means to
the server, which collects them into (Xg, Yg) and hands them to the clients it
samples. In this simulator :func:`exchange_means` runs on every rank at once:

* ownership: rank ``cid % world_size`` computes the means of client ``cid`` (all
  clients, not only the sampled ones: Alg. 1 sends the means of every client
  with data, before sampling). Ownership does not depend on the round.
* one ``comm.all_gather`` of packed rows ``[x_mean, y_mean, cid, batch, count]``;
  every rank then sorts the rows by (client id, batch index), so the result is
  bit-identical for any number of ranks (each mean is computed by exactly one
  rank with the same operations, whatever the rank count).

Options (:class:`MeanDataOptions`, mixed into the algorithms' own options):

* ``mean_batch`` M_k: samples per mean. 0 (default, the paper's main setting)
  means M_k = n_k, one mean per client. Otherwise the client's data are cut into
  ``n_k // M_k`` random batches of sizes floor/ceil(n_k / (n_k // M_k)), so every
  mean averages *at least* M_k samples (the remainder is spread, never sent as a
  smaller batch); a client with n_k < M_k sends nothing.
* ``mean_cutoff`` (App. H): clients with n_k below it send nothing.
* ``mean_noise`` sigma (App. I): the client adds N(0, sigma^2) noise to every
  coordinate of its input means before sending (not to the labels), seeded by
  (seed, refresh, client, batch) so it is reproducible and rank-independent.
* ``mean_server_avg`` m (App. J): the server averages every m entries, taken in a
  seeded random order; the last group may be smaller. Entries are weighted by
  the number of samples they average, so a group entry is exactly the mean of
  all the raw samples behind it. Its ``owners`` row lists every client inside.
* ``mean_refresh``: ``once`` (the paper: means are exchanged before the first
  round) or ``every_round`` (new random splits and noise every round).

Inputs are averaged in model-input space, i.e. after ``data.transform(x, False,
None)``. Text (task ``next_char``, x = character ids of shape (n, T)): a client
sends the per-position mean *one-hot* characters, shape (T, V). Because an
embedding is a linear lookup, ``mean_onehot @ E`` is exactly the mean of the
sequences' embeddings under any embedding matrix E, so these means stay valid as
the model trains; the mixing code (``fedhpc.algorithms.mixing``) multiplies them
by the current embedding table and mixes in embedding space (paper, App. B/E).
Labels are per-position mean one-hot next characters, shape (T, V).

The traffic audit (:func:`audit_traffic`) lets a test observe, for every row a
client puts into a collective, which raw samples it was computed from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .algorithms.base import derive_seed
from .errors import ConfigError


# --------------------------------------------------------------------------- options

@dataclass
class MeanDataOptions:
    mean_batch: int = field(default=0, metadata={
        "help": "M_k: raw samples averaged per mean entry (0 = all of the client's data, one mean per client)"})
    mean_cutoff: int = field(default=0, metadata={
        "help": "clients with fewer training samples than this send no mean data (FedMix App. H; 0 = off)"})
    mean_noise: float = field(default=0.0, metadata={
        "help": "std of Gaussian noise a client adds to its input means (FedMix App. I; 0 = off)"})
    mean_server_avg: int = field(default=1, metadata={
        "help": "the server averages every m mean entries into one (FedMix App. J; 1 = off)"})
    mean_refresh: str = field(default="once", metadata={
        "help": "exchange the means once before round 1 (paper) or every_round"})

    def validate(self):
        if self.mean_batch < 0:
            raise ConfigError(f"--mean-batch must be >= 0 (0 = one mean per client), got {self.mean_batch}")
        if self.mean_cutoff < 0:
            raise ConfigError(f"--mean-cutoff must be >= 0 (0 = off), got {self.mean_cutoff}")
        if not self.mean_noise >= 0:
            raise ConfigError(f"--mean-noise must be >= 0, got {self.mean_noise}")
        if self.mean_server_avg < 1:
            raise ConfigError(f"--mean-server-avg must be >= 1 (1 = off), got {self.mean_server_avg}")
        if self.mean_refresh not in ("once", "every_round"):
            raise ConfigError(f"--mean-refresh must be once or every_round, got {self.mean_refresh!r}")


# --------------------------------------------------------------------------- the exchanged data

@dataclass
class MeanData:
    """(Xg, Yg) with bookkeeping the server keeps: who is inside each entry, and how many samples."""

    x: torch.Tensor       # (E, *input_shape); text: (E, T, V) mean one-hot characters
    y: torch.Tensor       # (E, C) mean one-hot labels; text: (E, T, V)
    owners: torch.Tensor  # (E, m) long: ids of the clients averaged into each entry, -1 padded
    counts: torch.Tensor  # (E,) long: raw samples averaged into each entry
    #: bytes the clients sent to build this (before any server-side averaging)
    uploaded_bytes: int = 0

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def select(self, index: torch.Tensor) -> "MeanData":
        return MeanData(self.x[index], self.y[index], self.owners[index], self.counts[index])

    def external(self, cid: int) -> "MeanData":
        """The entries that hold none of client ``cid``'s data: what the server sends it."""
        keep = ~(self.owners == cid).any(dim=1)
        return self.select(keep.nonzero().flatten())

    def own(self, cid: int) -> "MeanData":
        """The entries that hold client ``cid``'s data (its own means)."""
        return self.select((self.owners == cid).any(dim=1).nonzero().flatten())

    def entry_bytes(self) -> int:
        """Bytes of one entry on the wire (its input and label means)."""
        return (self.x[0].numel() * self.x.element_size() + self.y[0].numel() * self.y.element_size()) if len(self) else 0

    def nbytes(self) -> int:
        return len(self) * self.entry_bytes()


# --------------------------------------------------------------------------- traffic audit

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


# --------------------------------------------------------------------------- computing means

def canonical_order(major: torch.Tensor, minor: torch.Tensor) -> torch.Tensor:
    """Permutation sorting gathered rows by (major, minor): the same order for any rank count."""
    span = int(minor.max()) + 1 if len(minor) else 1
    return torch.argsort(major * span + minor)


def owner_rank(cid: int, world_size: int) -> int:
    """The rank that computes (and, in the ledger, sends) client ``cid``'s means."""
    return cid % world_size


def mean_batches(n: int, opts: MeanDataOptions, seed: int, refresh: int, cid: int) -> List[np.ndarray]:
    """Index sets, each of at least M_k samples, whose means client ``cid`` sends (may be empty)."""
    if n == 0 or (opts.mean_cutoff and n < opts.mean_cutoff):
        return []
    if opts.mean_batch == 0 or opts.mean_batch >= n:
        if opts.mean_batch > n:
            return []  # cannot form one batch of M_k samples
        return [np.arange(n)]
    g = torch.Generator().manual_seed(derive_seed(seed, "mean_split", refresh, cid))
    perm = torch.randperm(n, generator=g).numpy()
    return [np.sort(b) for b in np.array_split(perm, n // opts.mean_batch)]


def model_input_means(data, x: torch.Tensor) -> torch.Tensor:
    """Mean of a batch of stored inputs in model-input space (text: mean one-hot ids)."""
    if data.task == "next_char":
        return F.one_hot(x.long(), data.num_classes).float().mean(0)
    return data.transform(x, False, None).float().mean(0)


def label_means(data, y: torch.Tensor) -> torch.Tensor:
    return F.one_hot(y.long(), data.num_classes).float().mean(0)


def client_means(data, cid: int, opts: MeanDataOptions, seed: int, refresh: int,
                 device) -> Tuple[torch.Tensor, torch.Tensor, List[np.ndarray]]:
    """Client ``cid``'s (noised) input means (B, *xshape), label means (B, *yshape), and batches."""
    c = data.client(cid)
    batches = mean_batches(c.num_train, opts, seed, refresh, cid)
    xs, ys = [], []
    for b, idx in enumerate(batches):
        it = torch.from_numpy(idx)
        xm = model_input_means(data, c.x[it].to(device))
        if opts.mean_noise > 0:
            g = torch.Generator().manual_seed(derive_seed(seed, "mean_noise", refresh, cid, b))
            xm = xm + opts.mean_noise * torch.randn(xm.shape, generator=g).to(xm)
        xs.append(xm)
        ys.append(label_means(data, c.y[it].to(device)))
    return (torch.stack(xs) if xs else None), (torch.stack(ys) if ys else None), batches


def _shapes(data) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    if data.task == "next_char":
        t = int(data.input_shape[0])
        return (t, data.num_classes), (t, data.num_classes)
    return tuple(data.input_shape), (data.num_classes,)


def exchange_means(data, comm, opts: MeanDataOptions, seed: int, refresh: int,
                   device=None, dtype=torch.float32) -> MeanData:
    """Every rank computes its owned clients' means; one all_gather; canonical order; optional m-averaging.

    Collective: call it on every rank. Returns the same :class:`MeanData` everywhere.
    """
    device = torch.device("cpu") if device is None else device
    xshape, yshape = _shapes(data)
    dx, dy = int(np.prod(xshape)), int(np.prod(yshape))
    rows = []
    for cid in range(comm.rank, data.num_clients, comm.size):
        xm, ym, batches = client_means(data, cid, opts, seed, refresh, device)
        for b, idx in enumerate(batches):
            meta = torch.tensor([cid, b, len(idx)], dtype=torch.float64, device=device)
            row = torch.cat([xm[b].reshape(-1).double(), ym[b].reshape(-1).double(), meta])
            record_sent(cid, "mean_data", row, xm[b], idx)
            rows.append(row)
    # Packing in float64 is exact for float32 means and for ids below 2**53. A rank without
    # entries sends a single row of count 0 (dropped below), so the gather is never empty.
    local = torch.stack(rows) if rows else torch.zeros(1, dx + dy + 3, dtype=torch.float64, device=device)
    table = torch.cat(comm.all_gather(local))
    table = table[table[:, -1] > 0]
    cids, batch, counts = table[:, -3].long(), table[:, -2].long(), table[:, -1].long()
    order = canonical_order(cids, batch)
    table, cids, counts = table[order], cids[order], counts[order]
    x = table[:, :dx].to(dtype).reshape((-1,) + xshape)
    y = table[:, dx:dx + dy].to(dtype).reshape((-1,) + yshape)
    md = MeanData(x, y, cids[:, None].clone(), counts)
    md.uploaded_bytes = md.nbytes()
    if opts.mean_server_avg > 1 and len(md) > 0:
        md = server_average(md, opts.mean_server_avg, derive_seed(seed, "mean_group", refresh))
    return md


def server_average(md: MeanData, m: int, seed: int) -> MeanData:
    """Average every m entries (seeded random grouping), weighting each by its sample count."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(md), generator=g).to(md.x.device)
    groups = [perm[i:i + m] for i in range(0, len(md), m)]
    xs, ys, owners, counts = [], [], [], []
    for grp in groups:
        w = md.counts[grp].to(torch.float64)
        wn = (w / w.sum()).to(md.x.dtype)
        xs.append(torch.tensordot(wn, md.x[grp], dims=1))
        ys.append(torch.tensordot(wn, md.y[grp], dims=1))
        own = torch.unique(md.owners[grp])
        own = own[own >= 0]
        owners.append(F.pad(own, (0, m * md.owners.shape[1] - len(own)), value=-1))
        counts.append(md.counts[grp].sum())
    return MeanData(torch.stack(xs), torch.stack(ys), torch.stack(owners), torch.stack(counts),
                    md.uploaded_bytes)


class MeanDataExchange:
    """The per-algorithm state of MAFL: when to refresh, the current (Xg, Yg), the ledger.

    A refresh's upload is booked in ``round_begin`` on rank 0 alone: the ledger is
    summed over ranks, so booking it once gives the true total.
    """

    def __init__(self, algo, opts: MeanDataOptions):
        self.algo, self.opts = algo, opts
        self.means: Optional[MeanData] = None

    def round_begin(self, rnd) -> None:
        a, o = self.algo, self.opts
        up = 0
        if self.means is None or o.mean_refresh == "every_round":
            refresh = 0 if o.mean_refresh == "once" else rnd.index
            self.means = exchange_means(a.data, a.comm, o, a.cfg.seed, refresh, a.device, a.flat.flat.dtype)
            # 'once' on a resumed run rebuilds what the server already held: nothing is re-sent.
            if o.mean_refresh == "every_round" or rnd.index == 0:
                up = self.means.uploaded_bytes
        if up and a.comm.rank == 0:
            a.ledger.add("up", "mean_data", up)

    def download(self, ctx, mix_with: str = "others") -> MeanData:
        """The entries client ctx.cid mixes with this round; books the bytes in the ledger.

        ``others`` (default): the entries holding none of its data, as the paper's server
        sends them. ``all``: every entry, its own included (received in full). ``own``: only
        its own means (the "Mixup w/ local means" ablation of App. D; nothing is received).
        """
        if mix_with == "own":
            return self.means.own(ctx.cid)
        got = self.means if mix_with == "all" else self.means.external(ctx.cid)
        ctx.ledger.add("down", "mean_data", got.nbytes())
        return got
