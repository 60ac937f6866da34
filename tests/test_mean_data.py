"""The MAFL mean-data exchange (fedhpc/exchanges/mean_data.py): values, options, rank
independence, and the per-client view of the table.

Expected values come from direct computations on the client data here, not from
the functions under test; ``old_exchange_means`` / ``old_external`` are the
straightforward implementations the exchange replaced (pack, gather, sort, cast;
mask and copy), written out here as the reference the new one must match exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, clean_env, mpiexec
from fedhpc.algorithms.base import derive_seed
from fedhpc.errors import DataError
from fedhpc.exchanges.mean_data import (MeanData, MeanDataExchange, MeanDataOptions, batches_per_client,
                                        exchange_means, mean_batches)
from fedhpc.exchanges.traffic_audit import audit_traffic


class OneRank:
    """The single-process World's collectives (identities)."""

    rank, size = 0, 1

    def all_gather(self, t):
        return [t]


class ThreadRanks:
    """`size` ranks as threads of this process; all_gather meets at a barrier (any number of calls)."""

    def __init__(self, size):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def run(self, fn):
        """fn(comm) on every rank at once; the list of results in rank order."""
        out, errors = [None] * self.size, []

        def body(rank):
            try:
                out[rank] = fn(SimpleNamespace(rank=rank, size=self.size, all_gather=lambda t: self.gather(rank, t)))
            except BaseException as e:  # noqa: BLE001 - re-raised below, peers released
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        return out

    def gather(self, rank, t):
        self.slots[rank] = t
        self.barrier.wait()
        got = [s.clone() for s in self.slots]  # received buffers are copies, as over a wire
        self.barrier.wait()                    # nobody overwrites a slot before everyone read it
        return got


def build(cfg_factory, **kw):
    from fedhpc.data import build_dataset

    base = dict(dataset="digits", num_clients=12, partition="dirichlet:0.3", seed=3)
    base.update(kw)
    return build_dataset(cfg_factory(**base))


def model_input(data, cid, idx=None):
    c = data.client(cid)
    x = c.x if idx is None else c.x[torch.as_tensor(idx)]
    y = c.y if idx is None else c.y[torch.as_tensor(idx)]
    return data.transform(x, False, None).double(), y


def test_default_one_mean_per_client_equals_client_mean(cfg_factory):
    data = build(cfg_factory)
    md = exchange_means(data, OneRank(), MeanDataOptions(), seed=3, refresh=0)
    assert len(md) == data.num_clients
    assert md.owners[:, 0].tolist() == list(range(data.num_clients))  # canonical order
    for cid in range(data.num_clients):
        x, y = model_input(data, cid)
        assert torch.allclose(md.x[cid].double(), x.mean(0), atol=1e-6)
        counts = torch.bincount(y, minlength=10).double() / len(y)
        assert torch.allclose(md.y[cid].double(), counts, atol=1e-7)
        assert int(md.counts[cid]) == len(y)
        ext = md.external(cid).materialize()
        assert len(ext) == data.num_clients - 1 and not (ext.owners == cid).any()
        assert md.own(cid).owners.flatten().tolist() == [cid]


def test_mean_batch_entries_average_at_least_mk_samples(cfg_factory):
    data = build(cfg_factory)
    mk = 7
    with audit_traffic() as audit:
        md = exchange_means(data, OneRank(), MeanDataOptions(mean_batch=mk), seed=3, refresh=0)
    sizes = data.client_sizes()
    assert len(md) == sum(int(n) // mk for n in sizes)
    assert int(md.counts.min()) >= mk
    for cid in range(data.num_clients):
        mine = md.owners[:, 0] == cid
        assert int(md.counts[mine].sum()) == (int(sizes[cid]) if sizes[cid] >= mk else 0)
    # Every entry is the mean of its recorded source samples, and the sources partition the client.
    assert len(audit.records) == len(md)
    seen = {}
    for rec, xrow in zip(audit.records, md.x):
        x, _ = model_input(data, rec.cid, rec.sources)
        assert len(rec.sources) >= mk
        assert torch.allclose(xrow.double(), x.mean(0), atol=1e-6)
        seen.setdefault(rec.cid, []).extend(rec.sources.tolist())
    for cid, idx in seen.items():
        assert sorted(idx) == list(range(int(sizes[cid])))


def test_cutoff_drops_small_clients(cfg_factory):
    data = build(cfg_factory)
    sizes = data.client_sizes()
    cut = int(np.median(sizes))
    md = exchange_means(data, OneRank(), MeanDataOptions(mean_cutoff=cut), seed=3, refresh=0)
    expected = [c for c in range(data.num_clients) if sizes[c] >= cut]
    assert 0 < len(expected) < data.num_clients
    assert md.owners[:, 0].tolist() == expected


def test_noise_has_requested_std_and_is_seeded(cfg_factory):
    data = build(cfg_factory, num_clients=40, partition="iid")
    clean = exchange_means(data, OneRank(), MeanDataOptions(), seed=3, refresh=0)
    sigma = 0.3
    noisy = exchange_means(data, OneRank(), MeanDataOptions(mean_noise=sigma), seed=3, refresh=0)
    again = exchange_means(data, OneRank(), MeanDataOptions(mean_noise=sigma), seed=3, refresh=0)
    other = exchange_means(data, OneRank(), MeanDataOptions(mean_noise=sigma), seed=3, refresh=1)
    eps = (noisy.x - clean.x).double().flatten()
    n = eps.numel()  # 40 clients x 64 pixels
    # std of the sample std of n normals is sigma / sqrt(2n): allow 5 of those.
    assert abs(float(eps.std()) - sigma) < 5 * sigma / (2 * n) ** 0.5
    assert abs(float(eps.mean())) < 5 * sigma / n ** 0.5
    assert torch.equal(noisy.y, clean.y)  # labels are not noised
    assert torch.equal(noisy.x, again.x)
    assert not torch.allclose(noisy.x, other.x)


def test_server_averaging_groups_m_entries_into_their_pooled_mean(cfg_factory):
    data = build(cfg_factory, num_clients=10)
    m = 3
    md = exchange_means(data, OneRank(), MeanDataOptions(mean_server_avg=m), seed=3, refresh=0)
    assert len(md) == 4  # ceil(10 / 3)
    members = [sorted(int(o) for o in row if o >= 0) for row in md.owners]
    assert sorted(len(g) for g in members) == [1, 3, 3, 3]
    assert sorted(c for g in members for c in g) == list(range(10))
    for e, group in enumerate(members):
        xs = torch.cat([model_input(data, c)[0] for c in group])
        ys = torch.cat([model_input(data, c)[1] for c in group])
        assert torch.allclose(md.x[e].double(), xs.mean(0), atol=1e-6)  # mean of all the raw samples
        assert torch.allclose(md.y[e].double(), torch.bincount(ys, minlength=10).double() / len(ys), atol=1e-6)
        assert int(md.counts[e]) == len(ys)
    for c in range(10):  # a client never receives a group containing its own data
        ext = md.external(c).materialize()
        assert len(ext) == 3 and not (ext.owners == c).any()


def test_emulated_ranks_give_identical_tables(cfg_factory):
    data = build(cfg_factory)
    sizes = data.client_sizes()
    for opts in (MeanDataOptions(mean_batch=5, mean_noise=0.1, mean_server_avg=2),
                 MeanDataOptions(mean_cutoff=int(np.median(sizes)))):  # some ranks own fewer entries
        ref = exchange_means(data, OneRank(), opts, seed=3, refresh=2)
        for size, piece in ((2, None), (3, 1), (5, 2), (13, 3)):  # 13 ranks: one owns no client
            outs = ThreadRanks(size).run(
                lambda comm: exchange_means(data, comm, opts, seed=3, refresh=2, piece_rows=piece))
            for out in outs:  # every rank holds the whole table
                assert torch.equal(out.x, ref.x) and torch.equal(out.y, ref.y)
                assert torch.equal(out.owners, ref.owners) and torch.equal(out.counts, ref.counts)


MPI_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from fedhpc.config import RunConfig
    from fedhpc.data import build_dataset
    from fedhpc.exchanges.mean_data import MeanDataOptions, exchange_means
    from fedhpc.world import World

    CASES = {name: (MeanDataOptions(**o), piece) for name, (o, piece) in json.loads(sys.argv[2]).items()}
    world = World("cpu", threads=1)
    assert world.size == 2, world.size
    cfg = RunConfig(dataset="digits", num_clients=12, partition="dirichlet:0.3", seed=3)
    data = build_dataset(cfg)
    out = {}
    for name, (opts, piece) in CASES.items():
        md = exchange_means(data, world, opts, seed=3, refresh=1, piece_rows=piece)
        out[name] = (md.x, md.y, md.owners, md.counts)
    gathered = world.all_gather_object(out)
    if world.rank == 0:
        torch.save(gathered, sys.argv[1])
    world.close()
    from fedhpc.launch import exit_now
    exit_now(0)  # outputs are written: skip the teardown in which gloo sometimes aborts
""")

MPI_CASES = {"plain": ({}, None),  # name: (MeanDataOptions fields, piece_rows)
             "mk_noise_avg": ({"mean_batch": 5, "mean_noise": 0.1, "mean_server_avg": 2}, None),
             "cutoff_pieces": ({"mean_batch": 3, "mean_cutoff": 60}, 2)}  # rank 1 owns fewer; many pieces


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec")
def test_two_mpi_ranks_match_single_process(cfg_factory, tmp_path):
    script = tmp_path / "means.py"
    script.write_text(MPI_SCRIPT)
    result_file = tmp_path / "means.pt"
    env = clean_env(PYTHONPATH=REPO)
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(result_file), json.dumps(MPI_CASES)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_rank = torch.load(result_file)
    assert len(per_rank) == 2
    data = build(cfg_factory)
    for name, (fields, _) in MPI_CASES.items():
        md = exchange_means(data, OneRank(), MeanDataOptions(**fields), seed=3, refresh=1)
        for got in per_rank:  # both ranks hold the single-process table, bit for bit
            x, y, owners, counts = got[name]
            assert torch.equal(x, md.x) and torch.equal(y, md.y)
            assert torch.equal(owners, md.owners) and torch.equal(counts, md.counts)
    # and the 2-rank tables are not trivially empty
    assert len(per_rank[0]["plain"][0]) == 12
    assert 0 < len(per_rank[0]["cutoff_pieces"][0]) < sum(int(n) // 3 for n in data.client_sizes())


# --------------------------------------------------------------------------- the replaced implementation

def old_mean_batches(n, opts, seed, refresh, cid):
    if n == 0 or (opts.mean_cutoff and n < opts.mean_cutoff):
        return []
    if opts.mean_batch == 0 or opts.mean_batch >= n:
        return [] if opts.mean_batch > n else [np.arange(n)]
    g = torch.Generator().manual_seed(derive_seed(seed, "mean_split", refresh, cid))
    perm = torch.randperm(n, generator=g).numpy()
    return [np.sort(b) for b in np.array_split(perm, n // opts.mean_batch)]


def old_exchange_means(data, opts, seed, refresh, dtype=torch.float32):
    """The exchange as it was, on one rank: float64 packed rows, concatenate, sort, cast, group."""
    text = data.task == "next_char"
    rows = []
    for cid in range(data.num_clients):
        c = data.client(cid)
        for b, idx in enumerate(old_mean_batches(c.num_train, opts, seed, refresh, cid)):
            it = torch.from_numpy(idx)
            xin = F.one_hot(c.x[it].long(), data.num_classes) if text else data.transform(c.x[it], False, None)
            xm = xin.float().mean(0)
            if opts.mean_noise > 0:
                g = torch.Generator().manual_seed(derive_seed(seed, "mean_noise", refresh, cid, b))
                xm = xm + opts.mean_noise * torch.randn(xm.shape, generator=g).to(xm)
            ym = F.one_hot(c.y[it].long(), data.num_classes).float().mean(0)
            meta = torch.tensor([cid, b, len(idx)], dtype=torch.float64)
            rows.append(torch.cat([xm.reshape(-1).double(), ym.reshape(-1).double(), meta]))
    table = torch.stack(rows)
    cids, batch, counts = table[:, -3].long(), table[:, -2].long(), table[:, -1].long()
    order = torch.argsort(cids * (int(batch.max()) + 1) + batch)
    table, cids, counts = table[order], cids[order], counts[order]
    xshape = (data.input_shape[0], data.num_classes) if text else tuple(data.input_shape)
    dx = int(np.prod(xshape))
    x = table[:, :dx].to(dtype).reshape((-1,) + xshape)
    y = table[:, dx:-3].to(dtype).reshape((len(table),) + ((xshape[0], -1) if text else (-1,)))
    md = MeanData(x, y, cids[:, None].clone(), counts)
    if opts.mean_server_avg > 1:
        m = opts.mean_server_avg
        g = torch.Generator().manual_seed(derive_seed(seed, "mean_group", refresh))
        perm = torch.randperm(len(md), generator=g)
        xs, ys, owners, cs = [], [], [], []
        for grp in (perm[i:i + m] for i in range(0, len(md), m)):
            w = md.counts[grp].to(torch.float64)
            wn = (w / w.sum()).to(md.x.dtype)
            xs.append(torch.tensordot(wn, md.x[grp], dims=1))
            ys.append(torch.tensordot(wn, md.y[grp], dims=1))
            own = torch.unique(md.owners[grp])
            owners.append(F.pad(own[own >= 0], (0, m - len(own[own >= 0])), value=-1))
            cs.append(md.counts[grp].sum())
        md = MeanData(torch.stack(xs), torch.stack(ys), torch.stack(owners), torch.stack(cs))
    return md


def old_external(md, cid):
    """What the server sent client cid before: a boolean mask over all entries and a copy."""
    keep = ~(md.owners == cid).any(dim=1)
    return md.select(keep.nonzero().flatten())


def text_data(clients=4, n=30, t=5, v=6):
    from fedhpc.data.base import ArrayFederatedData

    rng = np.random.default_rng(1)
    x = rng.integers(0, v, size=(n, t))
    parts = np.array_split(np.arange(n), clients)
    return ArrayFederatedData("toytext", x, np.roll(x, -1, axis=1), x[:2], x[:2], parts, num_classes=v,
                              client_test_fraction=0.0, task="next_char")


OPTION_SETS = [MeanDataOptions(), MeanDataOptions(mean_batch=4), MeanDataOptions(mean_batch=6, mean_noise=0.2),
               MeanDataOptions(mean_batch=3, mean_server_avg=4), MeanDataOptions(mean_batch=5, mean_cutoff=25),
               MeanDataOptions(mean_batch=1000)]  # M_k above every client: an empty table


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: f"mk{o.mean_batch}_cut{o.mean_cutoff}_m{o.mean_server_avg}")
def test_one_rank_equals_the_replaced_implementation_exactly(cfg_factory, opts):
    data = build(cfg_factory)
    for dtype in (torch.float32, torch.float64):
        new = exchange_means(data, OneRank(), opts, seed=3, refresh=1, dtype=dtype)
        if not len(new):
            assert all(n < opts.mean_batch for n in data.client_sizes())
            assert new.x.shape == (0, 1, 8, 8) and new.y.shape == (0, 10) and new.nbytes() == 0
            continue
        old = old_exchange_means(data, opts, seed=3, refresh=1, dtype=dtype)
        assert new.x.dtype == dtype and new.x.shape == old.x.shape and new.y.shape == old.y.shape
        assert torch.equal(new.x, old.x) and torch.equal(new.y, old.y)
        assert torch.equal(new.owners, old.owners) and torch.equal(new.counts, old.counts)
    text = text_data()
    assert torch.equal(exchange_means(text, OneRank(), MeanDataOptions(mean_batch=2), seed=0, refresh=0).x,
                       old_exchange_means(text, MeanDataOptions(mean_batch=2), seed=0, refresh=0).x)


def test_batch_counts_follow_from_client_sizes():
    """The layout every rank derives from n_k alone matches the split the client makes."""
    for opts in (MeanDataOptions(), MeanDataOptions(mean_batch=3), MeanDataOptions(mean_batch=7, mean_cutoff=10),
                 MeanDataOptions(mean_batch=1)):
        sizes = np.arange(0, 40)
        k = batches_per_client(sizes, opts)
        for n in sizes:
            split = mean_batches(int(n), opts, seed=0, refresh=0, cid=int(n))
            assert [len(b) for b in split] == [len(b) for b in old_mean_batches(int(n), opts, 0, 0, int(n))]
            assert k[n] == len(split)


def views_equal_copies(md, cids):
    g = torch.Generator().manual_seed(0)
    for cid in cids:
        view, ref = md.external(cid), old_external(md, cid)
        assert len(view) == len(ref) and view.nbytes() == ref.nbytes()
        got = view.materialize()  # entry by entry, in the same order
        assert torch.equal(got.x, ref.x) and torch.equal(got.y, ref.y) and torch.equal(got.owners, ref.owners)
        if len(ref):
            pick = torch.randint(len(view), (64,), generator=g)
            xs, ys = view.take(pick)
            assert torch.equal(xs, ref.x[pick]) and torch.equal(ys, ref.y[pick])
        own = md.own(cid)
        assert torch.equal(own.owners, md.select((md.owners == cid).any(1).nonzero().flatten()).owners)
        assert len(own) + len(view) == len(md)


def test_download_view_equals_mask_and_copy(cfg_factory):
    data = build(cfg_factory)
    sizes = data.client_sizes()
    md = exchange_means(data, OneRank(), MeanDataOptions(mean_batch=4, mean_cutoff=int(np.median(sizes))),
                        seed=3, refresh=0)
    empty = [c for c in range(data.num_clients) if not (md.owners == c).any()]
    assert empty and len(md) > data.num_clients  # clients without entries, clients with several
    views_equal_copies(md, list(range(data.num_clients)) + [99])  # 99: not a client of the table
    for c in empty:
        assert len(md.external(c)) == len(md)


def test_download_view_with_server_averaged_groups(cfg_factory):
    """App. J: an entry has several owners; a client is excluded from every group holding it."""
    data = build(cfg_factory)
    md = exchange_means(data, OneRank(), MeanDataOptions(mean_batch=3, mean_server_avg=5), seed=3, refresh=0)
    assert (md.owners >= 0).sum(1).max() > 1
    views_equal_copies(md, range(data.num_clients))
    # a hand-made table: duplicate owners in a row, owners in any order, a client in every entry
    owners = torch.tensor([[2, 0, -1], [1, 1, 2], [3, -1, -1], [0, 2, 3], [1, 2, -1]])
    hand = MeanData(torch.arange(5.0)[:, None], torch.arange(5.0)[:, None] * 10, owners,
                    torch.ones(5, dtype=torch.long))
    views_equal_copies(hand, range(6))  # 4, 5: in no entry
    assert len(hand.external(2)) == 1 and hand.external(2).materialize().x.flatten().tolist() == [2.0]


def test_a_client_never_draws_its_own_mean(cfg_factory):
    data = build(cfg_factory)
    md = exchange_means(data, OneRank(), MeanDataOptions(mean_batch=2, mean_server_avg=3), seed=3, refresh=0)
    g = torch.Generator().manual_seed(5)
    for cid in range(data.num_clients):
        view = md.external(cid)
        pick = torch.randint(len(view), (2000,), generator=g)
        pos = view.positions(pick)
        assert not (md.owners[pos] == cid).any()
        # and every external entry can be drawn: the draws cover the complement
        assert set(pos.tolist()) == set((~(md.owners == cid).any(1)).nonzero().flatten().tolist())


def test_exchange_download_books_what_the_client_receives(cfg_factory):
    data = build(cfg_factory)
    opts = MeanDataOptions(mean_batch=5)

    class Ledger:
        def __init__(self):
            self.booked = []

        def add(self, direction, kind, n):
            self.booked.append((direction, kind, n))

    algo = SimpleNamespace(data=data, comm=OneRank(), cfg=SimpleNamespace(seed=3), device=torch.device("cpu"),
                           flat=SimpleNamespace(flat=torch.zeros(1)), ledger=Ledger(),
                           training_clients=list(range(data.num_clients)))
    ex = MeanDataExchange(algo, opts)
    ex.round_begin(SimpleNamespace(index=0, sampled=[0, 5]))
    md, entry = ex.means, ex.means.entry_bytes()
    assert algo.ledger.booked == [("up", "mean_data", len(md) * entry)]
    for rnd in (0, 1):
        if rnd:  # the same clients again, no refresh: they mix with the copy they kept
            ex.round_begin(SimpleNamespace(index=1, sampled=[0, 5]))
        for cid in (0, 5):
            own = int((md.owners == cid).sum())
            for mix_with, received, rows in (("others", len(md) - own, len(md) - own), ("all", len(md), len(md)),
                                             ("own", None, own)):
                ctx = SimpleNamespace(cid=cid, ledger=Ledger())
                got = ex.download(ctx, mix_with)
                assert len(got) == rows
                booked = [] if received is None or rnd else [("down", "mean_data", received * entry)]
                assert ctx.ledger.booked == booked
                xs, _ = got.take(torch.arange(rows))
                is_own = (md.owners == cid).any(1)
                expect = md.x[is_own] if mix_with == "own" else md.x if mix_with == "all" else md.x[~is_own]
                assert torch.equal(xs, expect)


class Ledger:
    def __init__(self):
        self.down = 0

    def add(self, direction, kind, n):
        assert direction == "down" and kind == "mean_data"
        self.down += n


def download_ledger(data, opts, rounds, k, comm=None, seed=3, until=None, state=None):
    """Run the exchange over ``rounds`` with the engine's seeded sampling of ``k`` clients; every
    sampled client of this rank (cid % size, a stand-in for the engine's assignment) downloads.
    Returns (bytes booked per round, exchange). ``state``: resume from a state_dict, starting at
    round ``until[0]``; ``until=(first, last)``: the rounds run."""
    from fedhpc.engine import sample_clients

    comm = comm or OneRank()
    algo = SimpleNamespace(data=data, comm=comm, cfg=SimpleNamespace(seed=seed), device=torch.device("cpu"),
                           flat=SimpleNamespace(flat=torch.zeros(1)), ledger=SimpleNamespace(add=lambda *a: None),
                           training_clients=list(range(data.num_clients)))
    ex = MeanDataExchange(algo, opts)
    if state is not None:
        ex.load_state_dict(state)
    first, last = until or (0, rounds)
    per_round = []
    for t in range(first, last):
        sampled = sample_clients(seed, t, data.num_clients, k)
        ex.round_begin(SimpleNamespace(index=t, sampled=sampled))
        ledger = Ledger()
        for cid in sampled:
            if cid % comm.size == comm.rank:
                ex.download(SimpleNamespace(cid=cid, ledger=ledger))
        per_round.append(ledger.down)
    return per_round, ex


def brute_force_downloads(data, opts, rounds, k, seed=3):
    """Per round: the external bytes of every client sampled for the first time since the last
    refresh (once: round 0; every_round: every round), each from that round's table."""
    from fedhpc.engine import sample_clients

    per_round, have = [], set()
    md = None
    for t in range(rounds):
        if md is None or opts.mean_refresh == "every_round":
            md = exchange_means(data, OneRank(), opts, seed, 0 if opts.mean_refresh == "once" else t)
            have = set()  # a refresh: nobody holds the new table
        entry = md.x[0].numel() * 4 + md.y[0].numel() * 4  # float32 input and label means
        booked = 0
        for cid in sample_clients(seed, t, data.num_clients, k):
            if cid not in have:
                mine = sum(cid in row.tolist() for row in md.owners)  # entries holding its data
                booked += (len(md) - mine) * entry                    # it never receives those
                have.add(cid)
        per_round.append(booked)
    return per_round


@pytest.mark.parametrize("refresh", ["once", "every_round"])
@pytest.mark.parametrize("server_avg", [1, 3])
def test_a_client_downloads_the_means_once_per_refresh(cfg_factory, refresh, server_avg):
    """Alg. 1 sends (Xg, Yg) "if updated": the booked download equals the brute-force count of first
    samplings after each refresh, times each client's external bytes; one or two ranks, and a run
    resumed from the exchange's state_dict, book the same."""
    import io

    data = build(cfg_factory)
    opts = MeanDataOptions(mean_batch=5, mean_server_avg=server_avg, mean_refresh=refresh)
    rounds, k = 8, 4
    expect = brute_force_downloads(data, opts, rounds, k)
    got, ex = download_ledger(data, opts, rounds, k)
    assert got == expect
    if refresh == "once":
        assert expect[0] > 0 and 0 in expect and sum(b > 0 for b in expect) > 1  # later first samplings
    else:
        assert all(b > 0 for b in expect)
    # a resumed run (the state through torch.save, as the checkpoint stores it) books the same
    cut, done = 3, download_ledger(data, opts, rounds, k, until=(0, 3))[1]
    buf = io.BytesIO()
    torch.save(done.state_dict(), buf)
    buf.seek(0)
    rest, _ = download_ledger(data, opts, rounds, k, until=(cut, rounds), state=torch.load(buf))
    assert got[:cut] + rest == expect
    # 2 ranks: every rank keeps the same record, and the bytes summed over ranks are the same
    two = ThreadRanks(2).run(lambda comm: download_ledger(data, opts, rounds, k, comm=comm))
    assert [a + b for a, b in zip(two[0][0], two[1][0])] == expect
    assert torch.equal(two[0][1].kept.version, two[1][1].kept.version) and torch.equal(two[0][1].kept.version, ex.kept.version)


def test_client_sizes_that_disagree_with_the_clients_are_refused(cfg_factory):
    data = build(cfg_factory)
    true_sizes = data.client_sizes()
    lying = true_sizes.copy()
    lying[4] += 7
    data.client_sizes = lambda: lying
    with pytest.raises(DataError, match="client_sizes"):
        exchange_means(data, OneRank(), MeanDataOptions(mean_batch=3), seed=3, refresh=0)


def test_naivemix_draws_the_same_entries_as_the_copied_external_set(cfg_factory):
    """NaiveMix's loss, per-sample selection: each mixed xbar is the entry the old code drew, never the client's own."""
    from fedhpc.algorithms import ALGORITHMS, ClientContext, RoundInfo, load_algorithm_modules
    from fedhpc.config import RunConfig, build_options
    from fedhpc.flat import FlatModel
    from fedhpc.models import build_model

    load_algorithm_modules()
    data = build(cfg_factory)
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes, {})
    flat = FlatModel(model)
    cfg = RunConfig(algo="naivemix", seed=3)
    opts = build_options(ALGORITHMS.get("naivemix").Options, {"select": "sample", "mean_batch": 4,
                                                              "mean_server_avg": 3}, "naivemix")
    algo = ALGORITHMS.get("naivemix")(cfg, opts, model, flat, data, OneRank(), None)
    algo.global_state = flat.flat.detach().clone()
    algo.setup()
    rnd = RoundInfo(0, [0, 1], [0, 1], 0.1)
    algo.round_begin(rnd)
    md = algo.exchange.means
    seen = []
    algo.mix_loss = lambda f, x, y, xbar, ybar, lam: seen.append((xbar, ybar)) or f(x).sum() * 0
    for cid in (0, 7):
        ctx = ClientContext(algo, cid, data.client(cid), rnd)
        algo.download(ctx)
        old, g = old_external(md, cid), ctx.generator("mean_select")  # the same stream, replayed
        for _ in range(5):
            seen.clear()
            x = data.transform(data.client(cid).x[:20], False, None)
            algo.loss(model, x, data.client(cid).y[:20], ctx)
            pick = torch.randint(len(old), (20,), generator=g)
            xbar, ybar = seen[0]
            assert torch.equal(xbar, old.x[pick]) and torch.equal(ybar, old.y[pick])
            assert not (old.owners[pick] == cid).any()
