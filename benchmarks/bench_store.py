"""Per-client HDF5 store vs in-memory clients: feeding speed and peak memory.

1. Throughput (one process): the same clients and the same mini-batches, 32x32x3
   uint8 images, fed from :class:`HDF5ClientStore` and from
   :class:`ArrayFederatedData` through the training transform (random crop +
   flip + normalisation). Reports samples/s of both and the ratio store/memory
   (target >= 0.9). The two paths alternate over several repetitions and the
   median is kept, so drift of the machine hits both alike. The store file was
   just written, so it is read from the page cache (the usual state after the
   first round on a node); a cold parallel file system is not measured here.

2. Peak memory: for each number of clients, a fresh subprocess opens a store
   of that many clients (16 images each) and trains-feeds 10 clients per round
   for a few rounds; its peak RSS (VmHWM) is reported, next to the same run
   with the in-memory path. Target: the store's peak does not grow with the
   number of clients.

Run:  python benchmarks/bench_store.py  [--clients 1000 10000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedhpc.data.augment import ImageTransform  # noqa: E402
from fedhpc.data.base import ArrayFederatedData  # noqa: E402
from fedhpc.data.partition import make_partition  # noqa: E402
from fedhpc.data.store import HDF5ClientStore, StreamedClients, build_store_from_arrays, write_store  # noqa: E402

SHAPE = (3, 32, 32)
TRANSFORM = ImageTransform(mean=(0.49, 0.48, 0.45), std=(0.25, 0.24, 0.26), crop_padding=4, flip=True)


def feed(data, clients, batch_size, seed, transform=True):
    """Load each client, shuffle, cut mini-batches, transform them; returns samples fed."""
    gen = torch.Generator().manual_seed(seed)
    fed = 0
    for k in clients:
        c = data.client(int(k))
        order = torch.randperm(c.num_train, generator=gen)
        for s in range(0, c.num_train, batch_size):
            idx = order[s:s + batch_size]
            xb = c.x.index_select(0, idx)
            if transform:
                xb = data.transform(xb, True, gen)
            fed += len(idx)
    return fed


def throughput(workdir, num_clients=200, per_client=250, rounds=20, per_round=10, batch_size=32, reps=7):
    rng = np.random.default_rng(0)
    n = num_clients * per_client
    x = rng.integers(0, 256, (n,) + SHAPE, dtype=np.uint8)
    y = rng.integers(0, 10, n)
    xt, yt = x[:1000], y[:1000]
    parts = make_partition("dirichlet:0.5", y, num_clients, seed=0, min_samples=2)
    mem = ArrayFederatedData("bench", x, y, xt, yt, parts, num_classes=10, client_test_fraction=0.2,
                             seed=0, transform=TRANSFORM)
    path = os.path.join(workdir, "throughput.h5")
    store = build_store_from_arrays(path, {"dataset": "bench"}, x, y, xt, yt, parts, name="bench",
                                    num_classes=10, client_test_fraction=0.2, seed=0, transform=TRANSFORM)
    schedule = [rng.choice(num_clients, per_round, replace=False) for _ in range(rounds)]
    clients = np.concatenate(schedule)
    results = {}
    for transform in (True, False):
        rates = {"memory": [], "hdf5": []}
        for rep in range(reps):
            for name, data in (("memory", mem), ("hdf5", store)) if rep % 2 == 0 else (("hdf5", store), ("memory", mem)):
                t0 = time.perf_counter()
                fed = feed(data, clients, batch_size, seed=rep, transform=transform)
                rates[name].append(fed / (time.perf_counter() - t0))
        results["with_transform" if transform else "load_and_batch_only"] = {
            "memory_samples_per_s": statistics.median(rates["memory"]),
            "hdf5_samples_per_s": statistics.median(rates["hdf5"]),
            "ratio_hdf5_over_memory": statistics.median(rates["hdf5"]) / statistics.median(rates["memory"]),
            "samples_per_pass": fed,
        }
    store.close()
    os.remove(path)
    return {"clients": num_clients, "samples_per_client": per_client, "rounds": rounds,
            "clients_per_round": per_round, "batch_size": batch_size, "repetitions": reps,
            "torch_threads": torch.get_num_threads(), **results}


# --------------------------------------------------------------------------- memory


def client_images(k, n):
    return np.random.default_rng(k).integers(0, 256, (n,) + SHAPE, dtype=np.uint8)


def build_synthetic_store(path, num_clients, per_client):
    """A store of ``num_clients`` clients written one client at a time (no pool in memory)."""
    clients = StreamedClients([per_client] * num_clients,
                              lambda k: (client_images(k, per_client), np.full(per_client, k % 10)), SHAPE, np.uint8)
    test = StreamedClients([100], lambda k: (client_images(10 ** 9, 100), np.zeros(100, np.int64)), SHAPE, np.uint8)
    write_store(path, clients, test, meta={"dataset": "bench", "clients": num_clients}, name="bench",
                num_classes=10, client_test_fraction=0.25, seed=0)


def peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args):
    """Runs in a fresh process: open the data, feed 10 clients per round, report peak RSS."""
    torch.set_num_threads(1)
    baseline = peak_rss_mb()
    if args.mode == "hdf5":
        data = HDF5ClientStore(args.path, TRANSFORM)
    else:
        n = args.num_clients * args.per_client
        x = np.empty((n,) + SHAPE, np.uint8)
        for k in range(args.num_clients):
            x[k * args.per_client:(k + 1) * args.per_client] = client_images(k, args.per_client)
        y = np.repeat(np.arange(args.num_clients) % 10, args.per_client)
        parts = [np.arange(k * args.per_client, (k + 1) * args.per_client) for k in range(args.num_clients)]
        data = ArrayFederatedData("bench", x, y, x[:100], y[:100], parts, num_classes=10,
                                  client_test_fraction=0.25, seed=0, transform=TRANSFORM)
        del x
    rng = np.random.default_rng(1)
    fed = 0
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        fed += feed(data, rng.choice(data.num_clients, 10, replace=False), 16, seed=0)
    print(json.dumps({"mode": args.mode, "clients": data.num_clients, "peak_rss_mb": round(peak_rss_mb(), 1),
                      "rss_after_imports_mb": round(baseline, 1), "samples_fed": fed,
                      "seconds": round(time.perf_counter() - t0, 3)}))


def memory(workdir, client_counts, per_client=16, rounds=5):
    rows = []
    for n in client_counts:
        path = os.path.join(workdir, f"mem_{n}.h5")
        t0 = time.perf_counter()
        build_synthetic_store(path, n, per_client)
        build_s = time.perf_counter() - t0
        size_mb = os.path.getsize(path) / 2 ** 20
        for mode in ("hdf5", "memory"):
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", mode, "--path", path,
                 "--num-clients", str(n), "--per-client", str(per_client), "--rounds", str(rounds)],
                check=True, capture_output=True, text=True,
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            row.update(store_file_mb=round(size_mb, 1), store_build_s=round(build_s, 2))
            rows.append(row)
        os.remove(path)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000], help="client counts for the memory test")
    ap.add_argument("--workdir", default="", help="scratch folder for the stores (default: a temp dir)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the throughput test (default 1: steadier on a shared machine)")
    ap.add_argument("--child", choices=["hdf5", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--per-client", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="fedhpc_bench_store_")
    os.makedirs(workdir, exist_ok=True)
    try:
        torch.set_num_threads(args.threads)
        report = {"cpu_count": os.cpu_count(), "torch": torch.__version__}
        if not args.skip_throughput:
            report["throughput"] = throughput(workdir)
            print(json.dumps(report["throughput"], indent=2), flush=True)
        report["peak_memory"] = memory(workdir, args.clients)
        for row in report["peak_memory"]:
            print(json.dumps(row), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
