"""A bare ``python -m fedhpc.launch --algo X`` for every registered method: wall time and accuracy.

The brief's promise (and issue 40 s.0): every method runs on the embedded data with nothing but
``--algo``, in seconds to a minute, and learns. This runs exactly that command (plus ``--dataset``
for mnist5k, ``--threads`` and a scratch ``--out``), one method after another, and reports per
method the command's wall time (start-up included, as a user waits for it), the rounds run, the
accuracy the method reports (its global model's test accuracy; for methods without a global model
the better of the clients' mean own-model accuracy and the reference device's), and what
``auto`` resolved to. Nothing is stored but the table it prints (and ``--json``).

    python benchmarks/bench_bare.py [--dataset digits|mnist5k] [--threads 1] [--algos fedavg fedmix ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fedhpc.registry import ALGORITHMS, load_algorithm_modules  # noqa: E402

KEYS = ("test_accuracy", "local_test_accuracy_mean", "reference_device_accuracy")


def reported_accuracy(algo: str, final: dict) -> float:
    keys = KEYS if ALGORITHMS.get(algo).has_global_model else KEYS[1:]
    return max(final[k] for k in keys if k in final)


def run_bare(algo: str, dataset: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fedhpc.launch", "--algo", algo, "--dataset", dataset,
               "--threads", str(threads), "--out", os.path.join(out, "run"), "--no-tensorboard"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"algo": algo, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:], "wall_s": wall}
        records = [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]
        evaluated = [r for r in records if any(k in r for k in KEYS)]
        auto = next((line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                     if line.startswith("auto:")), "")
        return {"algo": algo, "wall_s": round(wall, 1), "rounds": records[-1]["round"],
                "accuracy": round(reported_accuracy(algo, evaluated[-1]), 4), "auto": auto}


def main(argv=None) -> int:
    load_algorithm_modules()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="digits", choices=["digits", "mnist5k"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--algos", nargs="+", default=ALGORITHMS.names())
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"| method | wall s | rounds | accuracy | auto resolved |\n|---|---:|---:|---:|---|", flush=True)
    for algo in args.algos:
        r = run_bare(algo, args.dataset, args.threads)
        rows.append(r)
        if "error" in r:
            print(f"| {algo} | {r['wall_s']:.1f} | - | FAILED: {r['error']} | |", flush=True)
        else:
            print(f"| {algo} | {r['wall_s']:.1f} | {r['rounds']} | {r['accuracy']:.3f} | "
                  f"{r['auto'][len('auto:'):].strip()} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
