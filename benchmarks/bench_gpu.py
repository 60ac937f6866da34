"""Rounds/s and GPU utilisation of FedAvg on one GPU: sequential vs batched clients, and ranks sharing the GPU.

Issue 14's GPU part. Each row is a real launcher run (``python -m fedhpc.launch``, under
``torch.distributed.run`` for several ranks) on the GPU in hand; this script watches it from
outside:

* rounds/s = 1 / median(round_seconds) over the rounds after ``--warmup`` (round_seconds is
  the engine's own per-round time; it excludes start-up and the final evaluation);
* GPU utilisation = mean of NVML's "utilization.gpu" (share of time a kernel ran), sampled
  every 20 ms while the timed rounds run (the window opens when metrics.jsonl has ``warmup``
  lines and closes at the second-to-last; it includes each round's small evaluation);
* GPU memory = the most NVML saw in use on the device during the window (all processes);
* |w - w_seq| = largest weight difference from the sequential 1-rank run of the same
  workload, the check that every row did the same work (batched clients equal the
  sequential path within float rounding; ranks sharing a GPU equal one rank).

Workloads (FedAvg, SGD lr 0.05, 1 local epoch, IID; the global test set is evaluated every round, outside round_seconds, on 1000 or fewer samples):

* ``cnn``: the digits CNN on digits (8x8), 100 clients x ~15 samples, batch 5, 10 per round
  (workload (a) of bench_overhead.py with the CNN), and ``cnn50``: 50 per round;
* ``lenet5``: LeNet-5 on synthetic 1x28x28 (MNIST's shape), 200 clients x 60, batch 10, 20 per round;
* ``resnet18``: ResNet-18 on synthetic 3x64x64 (ImageNet-200's shape, 200 classes), 40 clients
  x 100, batch 32, 10 per round; BatchNorm for the sequential row ``resnet18_bn``, ``norm=none``
  (what batched clients need) for the others.

Modes: ``seq`` (1 rank, one client after another), ``batched`` (1 rank, ``--clients-at-once``
= clients per round), ``ranks2`` / ``ranks4`` (2 / 4 ranks on the one GPU, sequential clients;
their collectives go over gloo through host memory, see fedhpc/world.py agree_backend).

    python benchmarks/bench_gpu.py [--rounds 20] [--warmup 3] [--only cnn,lenet5] [--json OUT.json]

Needs a CUDA GPU (exits otherwise); nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

COMMON = ["--algo", "fedavg", "--lr", "0.05", "--local-epochs", "1", "--partition", "iid", "--quiet",
          "--no-tensorboard", "--checkpoint-every", "0", "--client-test-fraction", "0", "--no-local-eval"]

WORKLOADS = {
    "cnn": dict(args=["--dataset", "digits", "--model", "cnn", "--num-clients", "100", "--batch-size", "5"],
                per_round=10),
    "cnn50": dict(args=["--dataset", "digits", "--model", "cnn", "--num-clients", "100", "--batch-size", "5"],
                  per_round=50),
    "lenet5": dict(args=["--dataset", "synthetic", "--data-opt", "shape=1x28x28", "--data-opt", "train_samples=12000",
                         "--data-opt", "test_samples=1000", "--model", "lenet5", "--num-clients", "200",
                         "--batch-size", "10"], per_round=20),
    "resnet18": dict(args=["--dataset", "synthetic", "--data-opt", "shape=3x64x64", "--data-opt", "classes=200",
                           "--data-opt", "train_samples=4000", "--data-opt", "test_samples=400", "--model", "resnet18",
                           "--model-opt", "norm=none", "--num-clients", "40", "--batch-size", "32"], per_round=10),
    "resnet18_bn": dict(args=["--dataset", "synthetic", "--data-opt", "shape=3x64x64", "--data-opt", "classes=200",
                              "--data-opt", "train_samples=4000", "--data-opt", "test_samples=400", "--model",
                              "resnet18", "--num-clients", "40", "--batch-size", "32"], per_round=10, modes=("seq",)),
}
MODES = ("seq", "batched", "ranks2", "ranks4")


class GpuWatch:
    """NVML utilisation and memory samples of GPU 0 while ``active`` is set."""

    def __init__(self, period=0.02):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period
        self.active, self.stop = threading.Event(), threading.Event()
        self.util, self.mem = [], []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            if self.active.is_set():
                self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
                self.mem.append(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            time.sleep(self.period)

    def close(self):
        self.stop.set()
        self.thread.join()


def clean_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("PMI_", "OMPI_COMM", "SLURM_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def run_one(name, mode, args, tmp):
    w = WORKLOADS[name]
    out = os.path.join(tmp, f"{name}-{mode}")
    cmd = [sys.executable, "-m", "fedhpc.launch", *COMMON, "--device", args.device, *w["args"], "--clients-per-round", str(w["per_round"]),
           "--rounds", str(args.rounds), "--eval-every", "1", "--out", out]
    if mode == "batched":
        cmd += ["--clients-at-once", str(w["per_round"])]
    if mode.startswith("ranks"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", mode[5:],
               "--master-port", str(port)] + cmd[1:]
    watch = GpuWatch() if args.nvml else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_path = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None:  # open the window after the warm-up rounds, close it before the last
        n = len(lines(metrics_path))
        if watch is not None:
            if args.warmup <= n < args.rounds - 1:
                watch.active.set()
            else:
                watch.active.clear()
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    _, err = proc.communicate()
    if watch is not None:
        watch.close()
    if proc.returncode != 0:
        return {"workload": name, "mode": mode, "error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    rows = lines(metrics_path)
    secs = [r["round_seconds"] for r in rows[args.warmup:]]
    res = {"workload": name, "mode": mode, "rounds_per_s": 1.0 / statistics.median(secs),
           "round_ms": 1e3 * statistics.median(secs), "process_s": wall,
           "test_accuracy": rows[-1].get("test_accuracy"), "out": out}
    if watch is not None and watch.util:
        res["gpu_util"] = statistics.mean(watch.util)
        res["gpu_mem_gib"] = max(watch.mem) / 2 ** 30
    res["note"] = next((l[len("note: "):] for l in err.splitlines() if l.startswith("note: ")), "")
    return res


def weights_diff(a_dir, b_dir):
    import torch

    a = torch.load(os.path.join(a_dir, "final_model.pt"), map_location="cpu")
    b = torch.load(os.path.join(b_dir, "final_model.pt"), map_location="cpu")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default="", help="also write every row here")
    ap.add_argument("--no-nvml", dest="nvml", action="store_false", help="no utilisation sampling")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (with --no-nvml)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU")
    names = [n for n in WORKLOADS if not args.only or n in args.only.split(",")]
    modes = args.modes.split(",")
    print(f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU smoke test'}, torch {torch.__version__}; FedAvg, {args.rounds} rounds, "
          f"median round time after {args.warmup} warm-up rounds", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            seq_out = None
            for mode in WORKLOADS[name].get("modes", modes):
                if mode not in modes:
                    continue
                r = run_one(name, mode, args, tmp)
                if "error" not in r:
                    if mode == "seq":
                        seq_out = r["out"]
                    r["max_diff_vs_seq"] = weights_diff(seq_out, r["out"]) if seq_out else float("nan")
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "out"}), flush=True)
    print("\n| workload | mode | rounds/s | round ms | x seq | GPU util % | GPU mem GiB | max abs w - w_seq | test acc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    seq = {r["workload"]: r for r in results if r["mode"] == "seq" and "error" not in r}
    for r in results:
        if "error" in r:
            print(f"| {r['workload']} | {r['mode']} | error: {r['error']} | | | | | | |")
            continue
        base = seq.get(r["workload"])
        speed = r["rounds_per_s"] / base["rounds_per_s"] if base else float("nan")
        print(f"| {r['workload']} | {r['mode']} | {r['rounds_per_s']:.2f} | {r['round_ms']:.1f} | {speed:.2f} | "
              f"{r.get('gpu_util', float('nan')):.0f} | {r.get('gpu_mem_gib', float('nan')):.2f} | "
              f"{r['max_diff_vs_seq']:.1e} | {r['test_accuracy']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "out"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
