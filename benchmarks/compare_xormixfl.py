"""XorMixFL paper (003) Table 2 and Table 3 at digits scale, from launch/xormixfl_digits*.yaml.

Table 2: XorMixFL, MixFL, standalone and vanilla FL (FedAvg, one round, from the same
initial model on the same devices) for every target-label column of the paper (one label
0..9, the pairs (0,2), (0,8), (2,4), (4,8), and the four labels 0,2,4,8), over 3 seeds:
total test accuracy and the target labels' accuracy (mean over the column's target labels
of ``test_accuracy_label<c>``), mean ± sample std, beside the paper's MNIST numbers.

Table 3: the privacy of the samples the server adds, XorMixFL (decoded) against MixFL
(mixed), for 1-3 dummy labels (drawn from labels 1, 2, 3, the reading of Table 4) and
M = 1..5 blended samples, target label 0: the minimum classical-MDS distance (2-D joint
embedding) and the minimum raw-pixel distance to the device samples behind each, in uint8
pixel units, mean / std. Only the encoding runs for it (no training).

Each run is a column's digits twin with ``--partition deficient:T:2:9 --data-opt
server_deficient=T``; runs go in-process one after another on one thread (about 2-4 s
each; the whole benchmark about 10 minutes on 2 cores) and a finished run (metrics.jsonl
present) is not repeated.

    python benchmarks/compare_xormixfl.py [--seeds 0 1 2] [--columns 0 0,2 0,2,4,8] [--out runs/compare_xormixfl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ALGOS = {"xormixfl": "xormixfl_digits.yaml", "mixfl": "xormixfl_digits_mixfl.yaml",
         "standalone": "xormixfl_digits_standalone.yaml", "fedavg": "xormixfl_digits_fedavg.yaml"}
NAMES = {"xormixfl": "XorMixFL", "mixfl": "MixFL", "fedavg": "Vanilla FL", "standalone": "Standalone"}
COLUMNS = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "0,2", "0,8", "2,4", "4,8", "0,2,4,8"]
#: Table 2 (MNIST, %): column -> (XorMixFL, MixFL, Vanilla FL, Standalone)
PAPER_T2 = {
    "0": (94.44, 96.85, 83.27, 89.12), "1": (95.83, 96.72, 84.83, 88.62), "2": (95.28, 95.59, 84.25, 89.34),
    "3": (93.99, 96.13, 83.49, 91.13), "4": (94.72, 95.82, 84.82, 89.83), "5": (94.17, 95.89, 83.82, 88.31),
    "6": (94.58, 95.52, 85.12, 89.28), "7": (93.43, 95.57, 83.31, 90.11), "8": (94.65, 95.56, 84.26, 91.22),
    "9": (91.54, 95.34, 82.94, 87.43), "0,2": (92.36, 95.52, 81.72, 86.41), "0,8": (91.03, 93.98, 81.23, 88.16),
    "2,4": (92.61, 94.87, 78.75, 87.19), "4,8": (91.28, 93.76, 79.23, 86.58), "0,2,4,8": (88.48, 91.93, 77.12, 84.82),
}
PAPER_ORDER = ["xormixfl", "mixfl", "fedavg", "standalone"]
#: Table 3 (MNIST, MDS mean / std): (algo, dummy labels) -> five (mean, std), M = 1..5
PAPER_T3 = {
    ("xormixfl", 1): [(2116.97, 335.85), (2335.78, 545.64), (2520.88, 687.77), (2674.01, 778.90), (2781.09, 838.49)],
    ("xormixfl", 2): [(2321.38, 352.65), (2409.72, 643.56), (2664.12, 814.13), (2821.37, 900.01), (2911.42, 947.06)],
    ("xormixfl", 3): [(2406.62, 365.61), (2519.44, 741.04), (2800.24, 895.33), (2949.51, 966.04), (3030.43, 1001.48)],
    ("mixfl", 1): [(1248.46, 156.20), (1342.34, 213.23), (1382.11, 311.44), (1402.53, 292.41), (1496.32, 349.25)],
    ("mixfl", 2): [(1462.75, 251.78), (1523.10, 320.13), (1611.42, 343.13), (1683.45, 391.39), (1820.43, 385.32)],
    ("mixfl", 3): [(1521.13, 225.39), (1621.47, 276.52), (1850.32, 403.72), (1999.01, 545.66), (2095.57, 634.79)],
}


def argv_for(algo, column, seed, out):
    return ["--config", os.path.join(REPO, "launch", ALGOS[algo]), "--partition", f"deficient:{column}:2:9",
            "--data-opt", f"server_deficient={column}", "--seed", str(seed), "--threads", "1", "--quiet",
            "--no-tensorboard", "--checkpoint-every", "0", "--out", out]


def run(argv):
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.run()


def final_row(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return rows[-1] if rows else None


def mean_std(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table2(args):
    results = {}
    for column in args.columns:
        targets = [int(t) for t in column.split(",")]
        for algo in ALGOS:
            for seed in args.seeds:
                out = os.path.join(args.out, "t2", f"{algo}-t{column.replace(',', '_')}-s{seed}")
                if final_row(out) is None:
                    run(argv_for(algo, column, seed, out))
                row = final_row(out)
                results.setdefault((column, algo), []).append(
                    (row["test_accuracy"], statistics.mean(row[f"test_accuracy_label{t}"] for t in targets)))
        print(f"column {column} done", file=sys.stderr, flush=True)
    return results


def privacy_point(algo, dummies, m, out):
    """Table 3's measure for one cell: the encoding and the server's set only, no training."""
    from fedhpc.algorithms.base import RoundInfo
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World

    argv = argv_for(algo, "0", 0, out) + ["--num-dummy", str(dummies), "--dummy-labels", "1,2,3",
                                          "--max-blend", str(m), "--privacy-samples", "200"]
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    clients = list(range(eng.data.num_clients))
    eng.algo.round_begin(RoundInfo(0, clients, clients, cfg.lr))
    mt = eng.algo.metrics
    return mt["privacy_mds_mean"], mt["privacy_mds_std"], mt["privacy_pixel_mean"], mt["privacy_pixel_std"]


def table3(args):
    cells = {}
    for algo in ("xormixfl", "mixfl"):
        for d in (1, 2, 3):
            for m in range(1, 6):
                cells[(algo, d, m)] = privacy_point(algo, d, m, os.path.join(args.out, "t3", f"{algo}-d{d}-m{m}"))
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--columns", nargs="+", default=COLUMNS)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "compare_xormixfl"))
    ap.add_argument("--skip-table3", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    res = table2(args)
    pct = lambda ms: f"{100 * ms[0]:.2f} ± {100 * ms[1]:.2f}"  # noqa: E731
    print(f"\n### Table 2 at digits scale: total test accuracy (%), mean ± std over seeds {args.seeds}; "
          f"paper (MNIST) in brackets\n")
    print("| method | " + " | ".join(f"({c})" if "," in c else c for c in args.columns) + " |")
    print("|---|" + "---|" * len(args.columns))
    for algo in PAPER_ORDER:
        cells = [f"{pct(mean_std([a for a, _ in res[(c, algo)]]))} [{PAPER_T2[c][PAPER_ORDER.index(algo)]}]"
                 for c in args.columns]
        print(f"| {NAMES[algo]} | " + " | ".join(cells) + " |")
    print("\n### Table 2 at digits scale: target-label accuracy (%, mean over the column's target labels; "
          "the paper plots it in Fig. 3, no printed numbers)\n")
    print("| method | " + " | ".join(f"({c})" if "," in c else c for c in args.columns) + " |")
    print("|---|" + "---|" * len(args.columns))
    for algo in PAPER_ORDER:
        cells = [pct(mean_std([t for _, t in res[(c, algo)]])) for c in args.columns]
        print(f"| {NAMES[algo]} | " + " | ".join(cells) + " |")
    summary = {"table2": {f"{algo}|{c}": v for (c, algo), v in res.items()}}

    if not args.skip_table3:
        t3 = table3(args)
        print("\n### Table 3 at digits scale: minimum distance of each added sample to the device samples behind "
              "it, uint8 pixel units, mean / std (target label 0, seed 0); MDS = 2-D classical MDS; "
              "paper (MNIST, MDS) in brackets\n")
        print("| method | dummy labels | measure | M=1 | M=2 | M=3 | M=4 | M=5 |")
        print("|---|---|---|---|---|---|---|---|")
        for algo in ("xormixfl", "mixfl"):
            for d in (1, 2, 3):
                paper = PAPER_T3[(algo, d)]
                mds = [f"{t3[(algo, d, m)][0]:.1f} / {t3[(algo, d, m)][1]:.1f} "
                       f"[{paper[m - 1][0]:.0f} / {paper[m - 1][1]:.0f}]" for m in range(1, 6)]
                pix = [f"{t3[(algo, d, m)][2]:.1f} / {t3[(algo, d, m)][3]:.1f}" for m in range(1, 6)]
                print(f"| {NAMES[algo]} | {d} | MDS | " + " | ".join(mds) + " |")
                print(f"| {NAMES[algo]} | {d} | pixel | " + " | ".join(pix) + " |")
        summary["table3"] = {f"{a}|d{d}|m{m}": v for (a, d, m), v in t3.items()}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
