"""FedAlign's study on the digits: FedAvg, FedProx, MOON, Mixup, StochDepth, GradAug and FedAlign, over seeds.

Every run goes through the launcher (``python -m fedhpc.launch``) with the settings of
``launch/fedalign_digits.yaml`` (resnet_digits, Dir(0.1) over 16 clients all sampled,
10 rounds, E = 5) and each method's options as in the paper's Sec. 3.2 (MOON's
projection head scaled to the small model); FedAlign runs twice, with the authors'
code settings of the paper-table configs and with Eq. 5 as printed, and MOON once more
with mu = 0 (its projection-head network trained as FedAvg). The seed changes
the partition, the initial model and the batches. Prints a markdown table of the
final global test accuracy (mean +- sample std over seeds, and each seed), the best
round's accuracy, and the wall time per run.

    python benchmarks/compare_fedalign.py [--seeds 0 1 2] [--jobs 2] [--out runs/compare_fedalign]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_run import run_config  # noqa: E402  the comparisons' one way to run a config

BASE = os.path.join(REPO, "launch", "fedalign_digits.yaml")

#: row -> (algorithm, its options, extra model options)
METHODS = {
    "FedAvg": ("fedavg", {}, {}),
    "FedProx (mu 1e-4)": ("fedprox", {"mu": 1e-4}, {}),
    "MOON (mu 1, tau 0.5)": ("moon", {"mu": 1.0, "temperature": 0.5}, {"projection_dim": 32}),
    "MOON's network alone (mu 0)": ("moon", {"mu": 0.0}, {"projection_dim": 32}),
    "Mixup (gamma 0.1)": ("mixup", {"gamma": 0.1}, {}),
    "StochDepth (rho_L 0.9)": ("stochdepth", {"final_keep_prob": 0.9}, {}),
    "GradAug (n 2, omega_b 0.8, mu 1.75)": ("gradaug", {"mu": 1.75, "num_subnets": 2, "min_width": 0.8}, {}),
    "FedAlign (authors' code: rescaled, sliced)": (
        "fedalign", {"mu": 0.45, "width": 0.25, "lip_rescale": True, "student_input": "sliced"}, {}),
    "FedAlign (Eq. 5 as printed)": ("fedalign", {"mu": 0.45, "width": 0.25}, {}),
}


def run_one(row, seed, args):
    algo, options, model_options = METHODS[row]
    cfg = yaml.safe_load(open(BASE))
    cfg.update(algo=algo, algo_options=options, seed=seed, rounds=args.rounds)
    cfg["model_options"] = {**cfg.get("model_options", {}), **model_options}
    tag = f"{list(METHODS).index(row)}_{algo}_seed{seed}"
    rows, wall = run_config(cfg, os.path.join(args.out, tag), args.threads, f"{row} seed {seed}")
    return {"row": row, "seed": seed, "final": rows[-1]["test_accuracy"],
            "best": max(r["test_accuracy"] for r in rows), "wall": wall}


def fmt(values):
    mean = 100 * statistics.mean(values)
    sd = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {sd:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2, help="runs at the same time (each with --threads)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "compare_fedalign"))
    ap.add_argument("--rows", nargs="+", type=int, help="indices of METHODS to run (default: all)")
    args = ap.parse_args()
    rows = [r for i, r in enumerate(METHODS) if args.rows is None or i in args.rows]
    t0 = time.perf_counter()
    jobs = [(r, s) for s in args.seeds for r in rows]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, args), jobs))
    print(f"\nFedAlign study on digits ({os.path.relpath(BASE, REPO)}, {args.rounds} rounds), "
          f"seeds {args.seeds}; {time.perf_counter() - t0:.0f} s in all\n")
    print("| method | final acc (%) | best acc (%) | per seed (final) | s / run |")
    print("|---|---|---|---|---|")
    for row in rows:
        rs = [r for r in results if r["row"] == row]
        per_seed = ", ".join(f"{100 * r['final']:.1f}" for r in sorted(rs, key=lambda r: r["seed"]))
        print(f"| {row} | {fmt([r['final'] for r in rs])} | {fmt([r['best'] for r in rs])} | {per_seed} | "
              f"{statistics.mean(r['wall'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
