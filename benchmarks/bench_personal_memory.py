"""Personal state at 1,000 and 10,000 clients: a rank's memory, and what fetching state costs.

FedPer with personal CNN heads: ``pmixfed_cnn_digits`` with 64 channels, whose head (a
256 -> 10 linear layer, 2,570 values, 10.3 KB) is the size of ``pmixfed_cnn``'s head on
CIFAR-10. Synthetic clients of ``--per-client`` 1x8x8 images (made on demand from (seed, cid),
so the data cost nothing to hold). Before the timed rounds every client is given a personal
head in the client-state store (as after a long run in which all have trained), so the store
holds N heads: 10.3 MB at 1,000 clients, 103 MB at 10,000, against a budget of
``--budget-mb`` per rank; what does not fit is spilled to ``<out>/client_state_spill``.

Each configuration runs in a fresh process (``mpiexec -n R`` for R ranks), 1 thread per rank:
``--rounds`` rounds of ``--per-round`` sampled clients (state migrates to the rank that trains
the client; on one rank nothing moves), then one evaluation of every client's own model on
its own test split (which reads every head once). glibc serves allocations above 64 KiB with
mmap (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set. Reported per rank
(largest over ranks): peak resident set (VmHWM) and its growth over the process's size after
start-up; the store's memory and spilled count; per round: time in ``ctx.load_state`` over the
rank's sampled clients (per client: mean), in the migration, and the whole round; the
all-clients evaluation's time.

    python benchmarks/bench_personal_memory.py [--clients 1000 10000] [--ranks 1 2] [--budget-mb 4]
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fedhpc.data.base import ClientData, FederatedData  # noqa: E402


class SyntheticDigits(FederatedData):
    """``n`` clients of ``per_client`` random 1x8x8 images (2 of them its test split)."""

    name, num_classes, input_shape = "synthetic_digits", 10, (1, 8, 8)

    def __init__(self, n: int, per_client: int, seed: int = 0):
        self.n, self.per_client, self.seed = n, per_client, seed
        self._sizes = np.full(n, per_client - 2, dtype=np.int64)

    @property
    def num_clients(self) -> int:
        return self.n

    def client_sizes(self) -> np.ndarray:
        return self._sizes

    def client(self, cid: int) -> ClientData:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + cid)
        x = torch.rand((self.per_client,) + self.input_shape, generator=g)
        y = torch.randint(0, self.num_classes, (self.per_client,), generator=g)
        return ClientData(cid, x[2:], y[2:], x[:2], y[:2])

    def num_test(self) -> int:
        return 200

    def test_slice(self, start: int, stop: int):
        g = torch.Generator().manual_seed(12345)
        x, y = torch.rand((200,) + self.input_shape, generator=g), torch.randint(0, 10, (200,), generator=g)
        return x[start:stop], y[start:stop]

    def default_model(self) -> str:
        return "pmixfed_cnn_digits"


def vm(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args) -> None:
    import fedhpc.engine as engine_mod
    from fedhpc.algorithms.base import ClientContext
    from fedhpc.config import parse_args
    from fedhpc.world import World

    world = World(threads=1)
    data = SyntheticDigits(args.child, args.per_client)
    engine_mod.build_dataset = lambda cfg, opts: data  # the engine's dataset hook, here only
    out = tempfile.mkdtemp(prefix=f"bench_pm_{args.child}_", dir=args.workdir) if world.rank == 0 else None
    out = world.broadcast_object(out, src=0)
    cfg, ao, do = parse_args([
        "--algo", "fedper", "--model", "pmixfed_cnn_digits", "--model-opt", "channels=64",
        "--num-clients", str(args.child), "--clients-per-round", str(args.per_round), "--rounds", str(args.rounds),
        "--local-epochs", "1", "--batch-size", "32", "--optimizer", "adam", "--lr", "0.001", "--seed", "0",
        "--client-state-budget-mb", str(args.budget_mb), "--threads", "1", "--quiet", "--no-tensorboard",
        "--out", out, "--checkpoint-every", "0"])
    eng = engine_mod.Engine(cfg, ao, do, world)
    algo, store = eng.algo, eng.client_state
    rss_start = vm("VmRSS")
    # every client has trained once: its own head in the store, on the rank that owns it
    head = algo.personal.numel
    g = torch.Generator().manual_seed(1)
    for cid in range(args.child):
        if cid % world.size == world.rank:
            store.put_slot(cid, "algo", torch.randn(head, generator=g))
    store.location.update({cid: cid % world.size for cid in range(args.child)})

    fetch = {"s": 0.0, "n": 0}
    load_state = ClientContext.load_state

    def timed_load_state(ctx, default=None):
        t0 = time.perf_counter()
        try:
            return load_state(ctx, default)
        finally:
            fetch["s"] += time.perf_counter() - t0
            fetch["n"] += 1

    ClientContext.load_state = timed_load_state
    migrate = store.migrate
    mig = {"s": 0.0, "moved": 0}

    def timed_migrate(assignment):
        t0 = time.perf_counter()
        moved = migrate(assignment)
        mig["s"] += time.perf_counter() - t0
        mig["moved"] += moved
        return moved

    store.migrate = timed_migrate
    rounds = []
    for t in range(args.rounds):
        f0, m0, n0 = fetch["s"], mig["s"], fetch["n"]
        t0 = time.perf_counter()
        eng.run_round(t)
        rounds.append({"round_s": time.perf_counter() - t0, "fetch_s": fetch["s"] - f0,
                       "fetch_n": fetch["n"] - n0, "migrate_s": mig["s"] - m0})
    t0 = time.perf_counter()
    with torch.no_grad():  # as Engine.evaluate runs it
        local = eng._evaluate_local()
    eval_s = time.perf_counter() - t0
    spill_files = len(os.listdir(store.spill_dir)) if os.path.isdir(store.spill_dir) else 0
    mine = {
        "rank": world.rank, "peak_rss": vm("VmHWM"), "rss_start": rss_start, "store_mem": store.memory_bytes,
        "spilled": spill_files, "held": len(store.held()), "head_bytes": head * 4,
        "fetch_per_round_ms": 1e3 * statistics.median(r["fetch_s"] for r in rounds[1:]),
        "fetch_per_client_ms": 1e3 * sum(r["fetch_s"] for r in rounds[1:]) / max(1, sum(r["fetch_n"] for r in rounds[1:])),
        "migrate_per_round_ms": 1e3 * statistics.median(r["migrate_s"] for r in rounds[1:]),
        "moved": mig["moved"], "round_ms": 1e3 * statistics.median(r["round_s"] for r in rounds[1:]),
        "eval_all_s": eval_s, "local_acc": local.get("local_test_accuracy_mean"),
    }
    parts = world.all_gather_object(mine)
    store.close()
    if world.rank == 0:
        print(json.dumps(parts))
        shutil.rmtree(out, ignore_errors=True)
    world.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", nargs="+", type=int, default=[1000, 10000])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--per-client", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--budget-mb", type=float, default=4.0)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "HYDRA_", "MPIR_"))}
    print(f"FedPer, pmixfed_cnn_digits (64 channels; head 2,570 values = 10.3 KB), {args.per_client} samples per "
          f"client, {args.per_round} clients per round, {args.rounds} rounds (first untimed), "
          f"--client-state-budget-mb {args.budget_mb:g} per rank, 1 thread per rank\n")
    print("| ranks | clients | heads held (all ranks) | peak RSS (max rank) | RSS growth after start-up | store in memory "
          "| spilled | state fetch per round (per client) | migration per round | round | evaluate all clients |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for n in args.clients:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), "--per-client", str(args.per_client),
                   "--per-round", str(args.per_round), "--rounds", str(args.rounds), "--budget-mb", str(args.budget_mb),
                   "--workdir", args.workdir]
            if ranks > 1:
                cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(p.stderr[-3000:])
            parts = json.loads(p.stdout.strip().splitlines()[-1])
            top = max(parts, key=lambda r: r["peak_rss"])
            mib = 2 ** 20
            print(f"| {ranks} | {n:,} | {sum(r['held'] for r in parts):,} | {top['peak_rss'] / mib:.1f} MiB "
                  f"| {(top['peak_rss'] - top['rss_start']) / mib:.1f} MiB "
                  f"| {max(r['store_mem'] for r in parts) / mib:.2f} MiB | {sum(r['spilled'] for r in parts):,} "
                  f"| {max(r['fetch_per_round_ms'] for r in parts):.1f} ms ({max(r['fetch_per_client_ms'] for r in parts):.3f} ms) "
                  f"| {max(r['migrate_per_round_ms'] for r in parts):.1f} ms | {max(r['round_ms'] for r in parts):.0f} ms "
                  f"| {max(r['eval_all_s'] for r in parts):.1f} s |", flush=True)


if __name__ == "__main__":
    main()
