"""Does FedMix drift with a BatchNorm model over long runs? Accuracy and loss over rounds.

FedMix's l3 = lambda <dL/dx', xbar> is linear in the input gradient, and BatchNorm lets the
weights before it scale that gradient without changing any output, so l3 is unbounded below
with BatchNorm (fedhpc warns; at --lam 0.5 digits collapsed within 2 rounds). The warning says
small lambdas trained well over the 100 rounds of launch/fedmix_digits.yaml; this runs the same
setting (2 classes per client, 5 of 20 clients per round, E=2, B=10) much longer, with the
``cnn`` model with and without BatchNorm (``norm=batch|none``), FedMix at two lambdas, and
FedAvg on the BatchNorm model as the reference, and prints test accuracy and training loss at
fixed rounds. A run that stops on a non-finite loss (the engine's guard) is reported as such,
with the round it reached.

    python benchmarks/bench_fedmix_batchnorm.py [--rounds 500] [--lams 0.05 0.2] [--seeds 0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_run import run_config  # noqa: E402  the comparisons' one way to run a config

BASE = os.path.join(REPO, "launch", "fedmix_digits.yaml")


def read_rows(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def run_one(algo, lam, norm, seed, args):
    cfg = yaml.safe_load(open(BASE))
    cfg.update(algo=algo, seed=seed, rounds=args.rounds, eval_every=args.eval_every, lr=args.lr or cfg["lr"],
               model_options={"norm": norm},
               algo_options={"lam": lam} if algo == "fedmix" else {})
    label = f"{algo} lam={lam} norm={norm} seed={seed}" if algo == "fedmix" else f"{algo} norm={norm} seed={seed}"
    out = os.path.join(args.out, label.replace(" ", "_").replace("=", ""))
    try:
        rows, wall = run_config(cfg, out, args.threads, label)
        stopped = ""
    except RuntimeError as e:  # the engine's non-finite guard (or any failure): keep what it logged
        rows, wall = read_rows(out), float("nan")
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        stopped = lines[-1][:160] if lines else "failed"
    return {"label": label, "algo": algo, "lam": lam, "norm": norm, "seed": seed, "rows": rows,
            "wall": wall, "stopped": stopped}


def at(rows, rnd, key):
    row = next((r for r in rows if r.get("round") == rnd and key in r), None)
    v = None if row is None else row[key]
    return "-" if v is None else ("nan" if isinstance(v, float) and not math.isfinite(v) else f"{v:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lams", type=float, nargs="+", default=[0.05, 0.2])
    ap.add_argument("--lr", type=float, default=None, help="the devices' learning rate (default: the file's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--jobs", type=int, default=2, help="runs at the same time (each with --threads)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_fedmix_batchnorm"))
    args = ap.parse_args()
    jobs = [("fedavg", 0.0, "batch", s) for s in args.seeds]
    jobs += [("fedmix", lam, norm, s) for s in args.seeds for lam in args.lams for norm in ("none", "batch")]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, args), jobs))
    total = time.perf_counter() - t0

    # the rounds the table shows: evaluated ones (multiples of --eval-every, and the last)
    marks = {m - m % args.eval_every for m in (100, args.rounds // 5, args.rounds // 2) if m <= args.rounds}
    marks = sorted(m for m in marks | {args.rounds} if m > 0)
    base = yaml.safe_load(open(BASE))
    print(f"digits, model cnn, {base['num_clients']} clients, partition {base['partition']}, "
          f"{base['clients_per_round']} per round, E={base['local_epochs']}, B={base['batch_size']}, "
          f"lr {args.lr or base['lr']} x{base['lr_decay']}/round, {args.rounds} rounds; {total:.0f} s in all "
          f"({args.jobs} runs at a time, {args.threads} thread each)\n")
    head = " | ".join(f"acc r{m}" for m in marks)
    print(f"| run | {head} | best acc (round) | train loss r{marks[0]} / r{marks[-1]} | ended |")
    print("|---|" + "---:|" * len(marks) + "---:|---:|---|")
    for r in results:
        rows = [x for x in r["rows"] if x.get("test_accuracy") is not None]
        best = max(rows, key=lambda x: x["test_accuracy"], default=None)
        best_s = f"{best['test_accuracy']:.3f} ({best['round']})" if best else "-"
        last = r["rows"][-1]["round"] if r["rows"] else 0
        ended = f"stopped at round {last}: {r['stopped']}" if r["stopped"] else f"round {last}"
        print(f"| {r['label']} | " + " | ".join(at(rows, m, "test_accuracy") for m in marks) +
              f" | {best_s} | {at(r['rows'], marks[0], 'train_loss')} / {at(r['rows'], marks[-1], 'train_loss')} "
              f"| {ended} |")


if __name__ == "__main__":
    main()
