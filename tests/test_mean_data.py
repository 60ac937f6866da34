"""The MAFL mean-data exchange (fedhpc/mean_data.py): values, options, rank independence.

Expected values come from direct computations on the client data here, not from
the functions under test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import REPO, clean_env, mpiexec
from fedhpc.mean_data import MeanDataOptions, audit_traffic, exchange_means


class OneRank:
    """The single-process World's collectives (identities)."""

    rank, size = 0, 1

    def all_gather(self, t):
        return [t]


class FakeRanks:
    """Run exchange_means as rank r of `size` in one process, to emulate the gather."""

    def __init__(self, rank, size, parts):
        self.rank, self.size, self.parts = rank, size, parts

    def all_gather(self, t):
        self.parts[self.rank] = t
        return [self.parts[r] for r in range(self.size) if r in self.parts]


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
        ext = md.external(cid)
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
        ext = md.external(c)
        assert len(ext) == 3 and not (ext.owners == c).any()


def test_emulated_ranks_give_identical_tables(cfg_factory):
    data = build(cfg_factory)
    opts = MeanDataOptions(mean_batch=5, mean_noise=0.1, mean_server_avg=2)
    ref = exchange_means(data, OneRank(), opts, seed=3, refresh=2)
    for size in (2, 3, 5):
        parts = {}
        for r in range(size):  # fill every rank's part first, then gather on the last one
            exchange_means(data, FakeRanks(r, size, parts), opts, seed=3, refresh=2)
        out = exchange_means(data, FakeRanks(size - 1, size, parts), opts, seed=3, refresh=2)
        assert torch.equal(out.x, ref.x) and torch.equal(out.y, ref.y)
        assert torch.equal(out.owners, ref.owners) and torch.equal(out.counts, ref.counts)


MPI_SCRIPT = textwrap.dedent("""
    import sys, torch
    from fedhpc.config import RunConfig
    from fedhpc.data import build_dataset
    from fedhpc.mean_data import MeanDataOptions, exchange_means
    from fedhpc.world import World

    world = World("cpu", threads=1)
    assert world.size == 2, world.size
    cfg = RunConfig(dataset="digits", num_clients=12, partition="dirichlet:0.3", seed=3)
    data = build_dataset(cfg)
    out = {}
    for name, opts in {"plain": MeanDataOptions(),
                       "mk_noise_avg": MeanDataOptions(mean_batch=5, mean_noise=0.1, mean_server_avg=2)}.items():
        md = exchange_means(data, world, opts, seed=3, refresh=1)
        out[name] = (md.x, md.y, md.owners, md.counts)
    if world.rank == 0:
        torch.save(out, sys.argv[1])
    world.close()
""")


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec")
def test_two_mpi_ranks_match_single_process(cfg_factory, tmp_path):
    script = tmp_path / "means.py"
    script.write_text(MPI_SCRIPT)
    result_file = tmp_path / "means.pt"
    env = clean_env(PYTHONPATH=REPO)
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(result_file)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result_file)
    data = build(cfg_factory)
    for name, opts in {"plain": MeanDataOptions(),
                       "mk_noise_avg": MeanDataOptions(mean_batch=5, mean_noise=0.1, mean_server_avg=2)}.items():
        md = exchange_means(data, OneRank(), opts, seed=3, refresh=1)
        x, y, owners, counts = got[name]
        assert torch.allclose(x, md.x, atol=1e-6, rtol=0) and torch.allclose(y, md.y, atol=1e-7, rtol=0)
        assert torch.equal(owners, md.owners) and torch.equal(counts, md.counts)
    # and the 2-rank table is not trivially empty
    assert len(got["plain"][0]) == 12
