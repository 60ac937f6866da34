"""MAFL mean data at 1,000 and 10,000 clients: per-client download cost and exchange peak memory.

Synthetic CIFAR-shaped clients (3x32x32 uint8 images, 10 classes, ``--per-client``
samples each, generated on demand from a per-client seed, so 10,000 clients cost
nothing to hold). With the default one mean per client, a table entry is
(3072 + 10) float32 values, and 10,000 clients make a 117.6 MiB table.

Measured, in ONE invocation, for every number of clients:

(a) per-client download: what a sampled client does before training, i.e. get
    the entries holding none of its data, book their bytes, and draw one mean
    (``torch.randint`` then read that row), timed per client with
    ``time.perf_counter``, median over ``--timed`` clients (old) and 5x as many
    (new), 3 repetitions. ``old`` is the replaced path (boolean mask over all
    entries, then a copy of the external entries, :func:`old_external`); ``new`` is
    :meth:`MeanData.external` (a view through the inverted index). The paths run in
    alternating blocks of clients (see :func:`download_costs`). The one-off cost of
    building the inverted index (once per table) is shown apart.
    Targets: new 10k / new 1k ~ 1.0 (independent of N), and old / new.
(b) exchange peak memory: a fresh subprocess (``mpiexec -n 2`` for 2 ranks) builds
    the data, runs a small warm-up exchange, resets the kernel's resident-set
    high-water mark (``5 > /proc/self/clear_refs``), reads VmRSS, runs the
    exchange and reads VmHWM. Peak / table = (VmHWM - VmRSS before) / bytes of
    the final (x, y) table; the table itself is part of the peak, so 1.0 is the
    floor. glibc is told to serve allocations above 64 KiB with mmap
    (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set and the peak
    follows live memory. tracemalloc does not see torch's allocations, hence RSS.
    For 2 ranks the larger of the two ranks' ratios is shown. Target <= 2.
(c) results unchanged: the new table equals the replaced exchange's table
    (:func:`old_exchange_means`) bit for bit, on 1 and 2 ranks (SHA-256 of the
    tables printed by the memory subprocesses), and every timed client's drawn
    row is the same under both download paths.

Usage:  python benchmarks/bench_mean_data.py [--clients 1000 10000] [--per-client 5] [--timed 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fedhpc.data.base import ClientData, FederatedData  # noqa: E402
from fedhpc.exchanges.mean_data import (MeanData, MeanDataOptions, client_means,  # noqa: E402
                                        exchange_means)


class SyntheticCifar(FederatedData):
    """``n`` clients of ``per_client`` random 3x32x32 uint8 images each, made on demand from (seed, cid)."""

    name, num_classes, input_shape = "synthetic_cifar", 10, (3, 32, 32)

    def __init__(self, n: int, per_client: int, seed: int = 0):
        self.n, self.per_client, self.seed = n, per_client, seed

    @property
    def num_clients(self) -> int:
        return self.n

    def client_sizes(self) -> np.ndarray:
        return np.full(self.n, self.per_client, dtype=np.int64)

    def client(self, cid: int) -> ClientData:
        rng = np.random.default_rng([self.seed, cid])
        x = torch.from_numpy(rng.integers(0, 256, (self.per_client,) + self.input_shape, dtype=np.uint8))
        y = torch.from_numpy(rng.integers(0, self.num_classes, self.per_client))
        return ClientData(cid, x, y, x[:0], y[:0])

    def num_test(self) -> int:
        return 0

    def test_slice(self, start: int, stop: int):
        return torch.zeros((0,) + self.input_shape, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)


# --------------------------------------------------------------------------- the replaced code (reference)

def old_exchange_means(data, comm, opts: MeanDataOptions, seed: int, refresh: int, dtype=torch.float32) -> MeanData:
    """The exchange before issue 7 (no App. J here): float64 packed rows, all_gather, cat, filter, sort, cast."""
    xshape, dx = tuple(data.input_shape), int(np.prod(data.input_shape))
    rows = []
    for cid in range(comm.rank, data.num_clients, comm.size):
        xm, ym, batches = client_means(data, cid, opts, seed, refresh, torch.device("cpu"))
        for b, idx in enumerate(batches):
            meta = torch.tensor([cid, b, len(idx)], dtype=torch.float64)
            rows.append(torch.cat([xm[b].reshape(-1).double(), ym[b].reshape(-1).double(), meta]))
    local = torch.stack(rows) if rows else torch.zeros(1, dx + data.num_classes + 3, dtype=torch.float64)
    table = torch.cat(comm.all_gather(local))
    table = table[table[:, -1] > 0]
    cids, batch, counts = table[:, -3].long(), table[:, -2].long(), table[:, -1].long()
    order = torch.argsort(cids * (int(batch.max()) + 1) + batch)
    table, cids, counts = table[order], cids[order], counts[order]
    x = table[:, :dx].to(dtype).reshape((-1,) + xshape)
    y = table[:, dx:dx + data.num_classes].to(dtype)
    return MeanData(x, y, cids[:, None].clone(), counts)


def old_external(md: MeanData, cid: int) -> MeanData:
    """The download before issue 7: a boolean mask over every entry, then a copy of the external ones."""
    keep = ~(md.owners == cid).any(dim=1)
    return md.select(keep.nonzero().flatten())


# --------------------------------------------------------------------------- (a) per-client download

def _download(md: MeanData, cid: int, path: str):
    """One client's download: its external entries, the bytes booked, one drawn row (the mix pick)."""
    g = torch.Generator().manual_seed(cid)
    if path == "old":
        ext = old_external(md, cid)
        pick = torch.randint(len(ext), (1,), generator=g)
        return ext.nbytes(), (ext.x[pick], ext.y[pick])
    ext = md.external(cid)
    pick = torch.randint(len(ext), (1,), generator=g)
    return ext.nbytes(), ext.take(pick)


def download_costs(md: MeanData, timed: int, reps: int = 3, seed: int = 0) -> dict:
    """Median per-client time of each path, in blocks of clients that alternate path by path.

    Blocks, not client-by-client alternation: the old path copies the table each time,
    which evicts the caches and returns big mappings to the kernel; timing the new
    path right after each of those would charge it the old path's side effects.
    The new path runs over 5x more clients (it is cheap); both see every repetition.
    """
    rng = np.random.default_rng(seed)
    old_ids = rng.choice(len(md), size=min(timed, len(md)), replace=False).tolist()
    new_ids = rng.choice(len(md), size=min(5 * timed, len(md)), replace=False).tolist()
    t0 = time.perf_counter()
    md.positions_of(0)  # builds the inverted index, once per table
    index_s = time.perf_counter() - t0
    times = {"old": [], "new": []}
    for rep in range(reps):
        for path in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            for cid in (old_ids if path == "old" else new_ids):
                t0 = time.perf_counter()
                _download(md, cid, path)
                times[path].append(time.perf_counter() - t0)
    same = True
    for cid in old_ids:  # (c): same bytes booked, same drawn row
        (b_old, r_old), (b_new, r_new) = _download(md, cid, "old"), _download(md, cid, "new")
        same &= b_old == b_new and all(torch.equal(a, b) for a, b in zip(r_old, r_new))
    return {"old": statistics.median(times["old"]), "new": statistics.median(times["new"]),
            "index": index_s, "same": same}


# --------------------------------------------------------------------------- (b) exchange peak memory

from bench_fedmix import _status_kib  # noqa: E402  the same /proc/self/status reader


def child(n: int, per_client: int, impl: str) -> None:
    """Fresh process (or one rank of ``mpiexec -n 2``): resident-set peak of one exchange."""
    from fedhpc.world import World

    world = World("cpu", threads=1)
    fn = exchange_means if impl == "new" else old_exchange_means
    opts = MeanDataOptions()
    fn(SyntheticCifar(4 * world.size, per_client), world, opts, 0, 0)  # warm-up: code paths, gloo buffers
    data = SyntheticCifar(n, per_client)
    world.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    md = fn(data, world, opts, 0, 0)
    peak = _status_kib("VmHWM")
    table = md.x.numel() * md.x.element_size() + md.y.numel() * md.y.element_size()
    digest = hashlib.sha256(md.x.contiguous().numpy().tobytes() + md.y.contiguous().numpy().tobytes()
                            + md.owners.numpy().tobytes() + md.counts.numpy().tobytes()).hexdigest()[:16]
    res = world.all_gather_object({"peak_bytes": (peak - base) * 1024, "table_bytes": table, "digest": digest})
    if world.rank == 0:  # one printer: lines of two ranks could interleave on mpiexec's stdout
        print(json.dumps(res), flush=True)
    world.close()


def peak_ratio(n: int, per_client: int, impl: str, ranks: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "SLURM_", "PMIX_", "HYDRA_", "MPIR_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), str(per_client), impl]
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec"), "-n", str(ranks)] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    res = json.loads([line for line in out.stdout.splitlines() if line.startswith("[")][-1])
    assert len(res) == ranks and len({r["digest"] for r in res}) == 1, res
    return {"ratio": max(r["peak_bytes"] / r["table_bytes"] for r in res), "table": res[0]["table_bytes"],
            "digest": res[0]["digest"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--per-client", type=int, default=5)
    ap.add_argument("--timed", type=int, default=20,
                    help="clients timed on the old path per repetition (5x as many on the new)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts of the memory runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(int(args.child[0]), int(args.child[1]), args.child[2])
    torch.set_num_threads(args.threads)
    print(f"synthetic CIFAR clients (3x32x32 uint8, {args.per_client} samples each), one mean per client, "
          f"float32; {args.threads} thread(s), torch {torch.__version__}; download: median over "
          f"{3 * args.timed} (old) / {15 * args.timed} (new) client downloads\n")
    one_rank = type("OneRank", (), {"rank": 0, "size": 1, "all_gather": staticmethod(lambda t: [t])})()
    impls = [(impl, r) for r in args.ranks for impl in ("old", "new")]
    rows = []
    for n in args.clients:
        data = SyntheticCifar(n, args.per_client)
        md = exchange_means(data, one_rank, MeanDataOptions(), 0, 0)
        ref = old_exchange_means(data, one_rank, MeanDataOptions(), 0, 0)
        same = all(torch.equal(getattr(md, f), getattr(ref, f)) for f in ("x", "y", "owners", "counts"))
        del ref
        cost = download_costs(md, args.timed)
        mem = {key: peak_ratio(n, args.per_client, *key) for key in impls}
        same = same and cost["same"] and len({m["digest"] for m in mem.values()}) == 1
        rows.append((n, md.nbytes(), cost, mem, same))
        del md
    print(f"| clients | table MiB | download old ms | download new ms | old / new | new / new@{args.clients[0]} "
          "| index build ms (once) | " + " | ".join(f"peak/table {impl} {r}r" for impl, r in impls)
          + " | same table & picks |")
    print("|" + "---|" * (8 + len(impls)))
    first = rows[0][2]
    for n, nbytes, cost, mem, same in rows:
        print(f"| {n} | {nbytes / 2**20:.1f} | {1e3 * cost['old']:.3f} | {1e3 * cost['new']:.3f} | "
              f"{cost['old'] / cost['new']:.0f} | {cost['new'] / first['new']:.2f} | {1e3 * cost['index']:.1f} | "
              + " | ".join(f"{mem[key]['ratio']:.2f}" for key in impls) + f" | {'yes' if same else 'NO'} |")

if __name__ == "__main__":
    main()
