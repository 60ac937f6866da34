"""Mean-data exchange of MAFL (FedMix paper, Alg. 1) as a collective any algorithm can call.

Every client k splits its training data at random into batches of at least M_k
samples, averages each batch (inputs and one-hot labels) and sends the means to
the server, which collects them into (Xg, Yg) and hands them to the clients it
samples. In this simulator :func:`exchange_means` runs on every rank at once:

* layout: the number of entries of every client, and the samples behind each,
  follow from the client sizes and the options alone (:class:`MeanLayout`), so
  every rank knows the whole table's canonical order, sorted by (client id,
  batch index), before any mean is computed. No metadata is exchanged.
* ownership: rank ``cid % world_size`` computes the means of client ``cid`` (all
  clients, not only the sampled ones: Alg. 1 sends the means of every client
  with data, before sampling) straight into its canonical rows of the final
  table, in the final dtype. Ownership does not depend on the round.
* sharing: the rows then travel through ``comm.all_gather`` in pieces of a
  bounded size and are scattered into place on every rank, so the exchange
  holds the final table plus a few pieces of about 1/16 of it (1 MiB at least),
  instead of several packed, padded and sorted copies. Each mean is
  computed by exactly one rank with the same operations whatever the rank
  count, so the table is bit-identical for any number of ranks.

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
the model trains; the mixing code (``fedhpc.algorithms.mafl.mixing``) multiplies them
by the current embedding table and mixes in embedding space (paper, App. B/E).
Labels are per-position mean one-hot next characters, shape (T, V).

What a sampled client receives (:meth:`MeanData.external`) is a view: the table
entries that hold none of its data, in table order, addressed through an
inverted index (client -> its sorted positions) built once per table, so a
client's download costs O(its own entries), not O(table).

Every row a client puts into a collective is reported to
:func:`fedhpc.exchanges.traffic_audit.record_sent`, so a test can see which raw samples
it was computed from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError, DataError
from ..seeding import derive_seed
from .ownership import invert_owners, owner_rank
from .traffic_audit import auditing, record_sent


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
    # inverted index (ptr, positions), built on first use: client c's entries are
    # positions[ptr[c]:ptr[c + 1]], ascending. The table is never modified after the exchange.
    _by_owner: Optional[Tuple[np.ndarray, torch.Tensor]] = field(
        default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def select(self, index: torch.Tensor) -> "MeanData":
        return MeanData(self.x[index], self.y[index], self.owners[index], self.counts[index])

    def take(self, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Input and label means of entries ``index`` (a long tensor on any device)."""
        index = index.to(self.x.device)
        return self.x[index], self.y[index]

    def positions_of(self, cid: int) -> torch.Tensor:
        """Sorted positions of the entries that hold client ``cid``'s data (O(own entries))."""
        if self._by_owner is None:
            self._by_owner = invert_owners(self.owners)
        ptr, positions = self._by_owner
        if not 0 <= cid < len(ptr) - 1:
            return positions[:0]
        return positions[int(ptr[cid]):int(ptr[cid + 1])]

    def external(self, cid: int) -> "ExternalMeans":
        """The entries that hold none of client ``cid``'s data: what the server sends it (a view)."""
        return ExternalMeans(self, self.positions_of(cid))

    def own(self, cid: int) -> "MeanData":
        """The entries that hold client ``cid``'s data (its own means; a small copy)."""
        return self.select(self.positions_of(cid))

    def entry_bytes(self) -> int:
        """Bytes of one entry on the wire (its input and label means)."""
        if not len(self):
            return 0
        return self.x[0].numel() * self.x.element_size() + self.y[0].numel() * self.y.element_size()

    def nbytes(self) -> int:
        return len(self) * self.entry_bytes()


class ExternalMeans:
    """The entries of a table that hold none of one client's data, in table order, not copied.

    The i-th external entry is the i-th entry of the table once the client's own
    entries (sorted positions o_0 < o_1 < ...) are skipped: its position is
    ``i + #{j : o_j - j <= i}``, since ``o_j - j`` counts the external entries before
    o_j. So a draw ``torch.randint(len(ext), ...)`` picks exactly the entry that the
    same draw picked from the old copied subset (table order, own entries removed).
    Indices must lie in [0, len(self)); none is checked on this hot path.
    """

    def __init__(self, table: MeanData, own_positions: torch.Tensor):
        self.table = table
        self.own_positions = own_positions
        self._skip = (own_positions - torch.arange(len(own_positions), device=own_positions.device)).contiguous()

    def __len__(self) -> int:
        return len(self.table) - len(self.own_positions)

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Table positions of external entries ``index``."""
        index = index.to(self._skip.device)
        if not len(self._skip):
            return index
        return index + torch.searchsorted(self._skip, index, right=True)

    def take(self, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Input and label means of external entries ``index``."""
        return self.table.take(self.positions(index))

    def entry_bytes(self) -> int:
        return self.table.entry_bytes()

    def nbytes(self) -> int:
        """Bytes the client receives: every external entry (booked, never materialised)."""
        return len(self) * self.entry_bytes()

    def materialize(self) -> MeanData:
        """The external entries as a table of their own: O(table), for tests and inspection."""
        return self.table.select(self.positions(torch.arange(len(self))))


#: what a client mixes with: the table itself, a copy of its own entries, or a view
MeanRows = Union[MeanData, ExternalMeans]


# --------------------------------------------------------------------------- layout

def batches_per_client(sizes, opts: MeanDataOptions) -> np.ndarray:
    """How many means each client sends, from its training-set size n_k alone.

    0 for an empty client, one below the App. H cutoff, or one with n_k < M_k;
    1 with M_k = 0 (one mean of all its data); otherwise n_k // M_k.
    """
    n = np.asarray(sizes, dtype=np.int64)
    k = n // opts.mean_batch if opts.mean_batch else np.ones_like(n)
    k[n == 0] = 0
    if opts.mean_cutoff:
        k[n < opts.mean_cutoff] = 0
    return k


def mean_batches(n: int, opts: MeanDataOptions, seed: int, refresh: int, cid: int) -> List[np.ndarray]:
    """Index sets, each of at least M_k samples, whose means client ``cid`` sends (may be empty)."""
    k = int(batches_per_client([n], opts)[0])
    if k == 0:
        return []
    if opts.mean_batch == 0 or opts.mean_batch >= n:
        return [np.arange(n)]
    g = torch.Generator().manual_seed(derive_seed(seed, "mean_split", refresh, cid))
    perm = torch.randperm(n, generator=g).numpy()
    return [np.sort(b) for b in np.array_split(perm, k)]


@dataclass
class MeanLayout:
    """The table's canonical order, (client id, batch index), known on every rank before any mean.

    ``np.array_split`` gives the first ``n % k`` of a client's k batches one sample
    more than the others, so the samples behind every entry follow from n_k too.
    """

    per_client: np.ndarray  # (N,) entries of each client
    start: np.ndarray       # (N,) position of each client's first entry
    cids: np.ndarray        # (E,) client of each entry
    batch: np.ndarray       # (E,) batch index of each entry within its client
    counts: np.ndarray      # (E,) samples averaged into each entry

    @classmethod
    def build(cls, sizes, opts: MeanDataOptions) -> "MeanLayout":
        n = np.asarray(sizes, dtype=np.int64)
        k = batches_per_client(n, opts)
        start = np.cumsum(k) - k
        cids = np.repeat(np.arange(len(n), dtype=np.int64), k)
        batch = np.arange(len(cids), dtype=np.int64) - start[cids]
        kc = k[cids]  # >= 1 on every entry
        counts = n[cids] // kc + (batch < n[cids] % kc)
        return cls(k, start, cids, batch, counts.astype(np.int64))

    def __len__(self) -> int:
        return len(self.cids)

    def rank_positions(self, world_size: int) -> List[np.ndarray]:
        """For every rank, the ascending positions of the entries it computes."""
        owner = owner_rank(self.cids, world_size)
        order = np.argsort(owner, kind="stable")
        return np.split(order, np.cumsum(np.bincount(owner, minlength=world_size))[:-1])


# --------------------------------------------------------------------------- computing means

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
    return data.model_input_shape(train=False), (data.num_classes,)  # means are of evaluation-transformed inputs


#: the all_gather buffers of one piece hold about 1/PIECE_FRACTION of the table, and at
#: least PIECE_MIN_BYTES (fewer, larger collectives when the table is small)
PIECE_FRACTION = 16
PIECE_MIN_BYTES = 1 << 20


def exchange_means(data, comm, opts: MeanDataOptions, seed: int, refresh: int,
                   device=None, dtype=torch.float32, piece_rows: Optional[int] = None,
                   clients: Optional[Sequence[int]] = None) -> MeanData:
    """Every rank computes its owned clients' means into the final table; the rows are shared piece by piece.

    Collective: call it on every rank. Returns the same :class:`MeanData` everywhere.
    ``piece_rows`` (rows each rank puts into one all_gather) is chosen from the
    table size when not given; tests set it small to exercise many pieces. ``clients``: those
    that send means (default every client); the others have no entries.
    """
    device = torch.device("cpu") if device is None else device
    xshape, yshape = _shapes(data)
    train_shape = data.model_input_shape(train=True)
    if data.task != "next_char" and train_shape != xshape:
        raise ConfigError(
            f"mean data average evaluation-transformed inputs ({'x'.join(map(str, xshape))}) and are mixed with "
            f"training batches ({'x'.join(map(str, train_shape))}): the data options crop the two to different "
            f"sizes; make them agree (e.g. --data-opt center_crop={train_shape[-1]})")
    dx, dy = int(np.prod(xshape)), int(np.prod(yshape))
    sizes = np.asarray(data.client_sizes(), dtype=np.int64)
    shared = None if clients is None else set(int(c) for c in clients)
    if shared is not None:  # the others (cold-start clients) send no means: no entries in the table
        sizes = np.where(np.isin(np.arange(len(sizes)), sorted(shared)), sizes, 0)
    layout = MeanLayout.build(sizes, opts)
    if len(layout.per_client) != data.num_clients:
        raise DataError(f"{type(data).__name__}.client_sizes() lists {len(layout.per_client)} clients, "
                        f"num_clients is {data.num_clients}; the dataset must report one size per client")
    e = len(layout)
    # The final tables, allocated once; each rank fills its own clients' rows in place. Means
    # are computed in float32 and cast on assignment, the same rounding as casting the table.
    x = torch.empty((e, dx), dtype=dtype, device=device)
    y = torch.empty((e, dy), dtype=dtype, device=device)
    for cid in range(comm.rank, data.num_clients, comm.size):
        if shared is not None and cid not in shared:
            continue
        xm, ym, batches = client_means(data, cid, opts, seed, refresh, device)
        k, s = int(layout.per_client[cid]), int(layout.start[cid])
        if len(batches) != k:
            raise DataError(f"client {cid} holds a different number of training samples than "
                            f"{type(data).__name__}.client_sizes() reports; the two must agree")
        if k == 0:
            continue
        x[s:s + k] = xm.reshape(k, dx)
        y[s:s + k] = ym.reshape(k, dy)
        for b, idx in enumerate(batches if auditing() else ()):
            record_sent(cid, "mean_data", torch.cat([x[s + b], y[s + b]]), xm[b], idx)
    if piece_rows is None:
        budget = max(PIECE_MIN_BYTES, e * (dx + dy) * x.element_size() // PIECE_FRACTION)
        piece_rows = max(1, budget // ((dx + dy) * x.element_size() * comm.size))
    _share_rows(comm, x, y, [torch.from_numpy(p).to(device) for p in layout.rank_positions(comm.size)],
                piece_rows)
    owners = torch.from_numpy(layout.cids).to(device)[:, None]
    md = MeanData(x.view((e,) + xshape), y.view((e,) + yshape), owners, torch.from_numpy(layout.counts).to(device))
    md.uploaded_bytes = md.nbytes()
    if opts.mean_server_avg > 1 and len(md) > 0:
        md = server_average(md, opts.mean_server_avg, derive_seed(seed, "mean_group", refresh))
    return md


def _share_rows(comm, x: torch.Tensor, y: torch.Tensor, positions: List[torch.Tensor], piece_rows: int) -> None:
    """Fill every rank's (x, y) with the rows the other ranks computed, ``piece_rows`` per rank at a time.

    Piece j of rank r is its rows ``positions[r][j*p:(j+1)*p]``, packed as [x | y];
    every rank knows every ``positions[r]``, so a received piece is scattered into
    place with no metadata. One rank also goes through the collective (an identity
    there), so the rows a client hands over are the same, and audited the same, on
    any number of ranks.
    """
    longest = max(len(p) for p in positions)
    mine, dx = positions[comm.rank], x.shape[1]
    for start in range(0, longest, piece_rows):
        idx = mine[start:start + piece_rows]
        got = comm.all_gather(torch.cat([_rows(x, idx), _rows(y, idx)], 1))
        for r, rows in enumerate(got):
            where = positions[r][start:start + piece_rows]
            if len(rows) != len(where):
                raise DataError(f"rank {r} sent {len(rows)} mean rows where {len(where)} were expected: "
                                "the ranks disagree about the client sizes; every rank must load the same dataset")
            if r != comm.rank and len(rows):
                x.index_copy_(0, where, rows[:, :dx])
                y.index_copy_(0, where, rows[:, dx:])


def _rows(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos`` (ascending, distinct) of ``t``: a view when they are consecutive (always on one rank)."""
    if len(pos) and int(pos[-1]) - int(pos[0]) + 1 == len(pos):
        return t[int(pos[0]):int(pos[-1]) + 1]
    return t.index_select(0, pos)


def server_average(md: MeanData, m: int, seed: int) -> MeanData:
    """Average every m entries (seeded random grouping), weighting each by its sample count.

    The group means are written into tables allocated once (1/m of the input), not
    stacked from a list, so App. J adds 1/m of the table to the exchange's peak.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(md), generator=g).to(md.x.device)
    groups = [perm[i:i + m] for i in range(0, len(md), m)]
    x = md.x.new_empty((len(groups),) + tuple(md.x.shape[1:]))
    y = md.y.new_empty((len(groups),) + tuple(md.y.shape[1:]))
    owners, counts = [], []
    for i, grp in enumerate(groups):
        w = md.counts[grp].to(torch.float64)
        wn = (w / w.sum()).to(md.x.dtype)
        x[i] = torch.tensordot(wn, md.x[grp], dims=1)
        y[i] = torch.tensordot(wn, md.y[grp], dims=1)
        own = torch.unique(md.owners[grp])
        own = own[own >= 0]
        owners.append(F.pad(own, (0, m * md.owners.shape[1] - len(own)), value=-1))
        counts.append(md.counts[grp].sum())
    return MeanData(x, y, torch.stack(owners), torch.stack(counts), md.uploaded_bytes)


class KeptCopies:
    """Which version of a shared table (MAFL's means, GlobalMix's raw pool) every client keeps.

    A client downloads the table the first round it is sampled after the table changed and
    keeps it: later rounds it mixes with its copy, and the ledger books nothing. Updated from
    the round's sampled clients, the same list on every rank, so it is identical on every
    rank; checkpointed through :meth:`state_dict`.
    """

    def __init__(self, num_clients: int):
        #: (N,) int64: the version each client keeps, -1 none
        self.version = torch.full((num_clients,), -1, dtype=torch.int64)
        self._receives = torch.zeros(num_clients, dtype=torch.bool)

    def round_begin(self, version: int, sampled) -> None:
        """This round's table is ``version``; the clients ``sampled`` get it if they lack it."""
        self._receives = self.version != version
        self.version[torch.as_tensor(sampled, dtype=torch.long)] = version

    def receives(self, cid: int) -> bool:
        """Whether client ``cid`` (sampled this round) downloads the table this round."""
        return bool(self._receives[cid])

    def state_dict(self) -> dict:
        return {"version": self.version.clone()}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint from before this record: every client counts as keeping nothing, so each
        # books one more download than the uninterrupted run would (the ledger only).
        if state.get("version") is not None:
            self.version = state["version"].to("cpu", torch.int64).clone()


class MeanDataExchange:
    """The per-algorithm state of MAFL: when to refresh, the current (Xg, Yg), the ledger.

    A refresh's upload is booked in ``round_begin`` on rank 0 alone: the ledger is
    summed over ranks, so booking it once gives the true total.

    The download is booked once per refresh and client, the first round the client is
    sampled after the refresh: Alg. 1 sends (Xg, Yg) to the sampled clients only "if
    updated", and the means are "only exchanged at the beginning of the first
    communication round" (Sec. 3.4), so a client keeps the table it received
    (:class:`KeptCopies`, versions numbered by refresh). With ``every_round`` every round is
    a refresh, so every sampled client downloads.
    """

    def __init__(self, algo, opts: MeanDataOptions):
        self.algo, self.opts = algo, opts
        self.means: Optional[MeanData] = None
        #: the refresh (round index; 0 with ``once``) whose table each client keeps
        self.kept = KeptCopies(algo.data.num_clients)

    def round_begin(self, rnd) -> None:
        a, o = self.algo, self.opts
        up = 0
        refresh = 0 if o.mean_refresh == "once" else rnd.index
        if self.means is None or o.mean_refresh == "every_round":
            self.means = None  # the old table goes before the new one is built (peak memory)
            self.means = exchange_means(a.data, a.comm, o, a.cfg.seed, refresh, a.device, a.flat.flat.dtype,
                                        clients=a.training_clients)
            # 'once' on a resumed run rebuilds what the server already held: nothing is re-sent.
            if o.mean_refresh == "every_round" or rnd.index == 0:
                up = self.means.uploaded_bytes
        if up and a.comm.rank == 0:
            a.ledger.add("up", "mean_data", up)
        self.kept.round_begin(refresh, rnd.sampled)

    def download(self, ctx, mix_with: str = "others") -> MeanRows:
        """The entries client ctx.cid mixes with this round; books the bytes in the ledger.

        ``others`` (default): the entries holding none of its data, as the paper's server
        sends them: a view of the table (:class:`ExternalMeans`), not a copy. ``all``: every
        entry, its own included. ``own``: only its own means (the "Mixup w/ local means"
        ablation of App. D; nothing is received). Pick rows with ``take(index)``. The ledger
        books every byte the client receives, the first round it is sampled after a refresh
        only (see the class); later rounds it mixes with the copy it kept.
        """
        if mix_with == "own":
            return self.means.own(ctx.cid)
        got = self.means if mix_with == "all" else self.means.external(ctx.cid)
        if self.kept.receives(ctx.cid):
            ctx.ledger.add("down", "mean_data", got.nbytes())
        return got

    def state_dict(self) -> dict:
        """Which table every client keeps: what the download ledger of later rounds depends on."""
        return self.kept.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.kept.load_state_dict(state)
