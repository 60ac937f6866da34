"""Cost of one local step of each method of FedAlign's study against FedAvg, beside the paper's Table 5.

ResNet-56 (the FedML bottleneck variant, 0.61 M parameters) on CIFAR-100-shaped input
(3x32x32, 100 classes), batch 64, SGD lr 0.01 momentum 0.9 weight decay 1e-4: the paper's
setting. Each method runs in its own process (so peak memory is its own), through the
algorithm's real ``local_update`` on random data:

* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over the method's training
  forward (its ``loss``: every network it runs, frozen ones included) and over the whole
  step (forward + backward), per sample, as multiply-accumulates (FLOPs / 2: the
  paper's "MFLOPs" are MACs, e.g. 87.3 M for ResNet-56's forward). FedAlign's
  transmitting matrices and power iterations (batched matrix products, which the
  paper's network count leaves out) are also shown on their own. Random methods
  (StochDepth's drops, GradAug's widths and resolutions) are averaged over 16 batches.
* Stored parameters: the networks a method holds while training (FedProx the global
  copy; MOON the global and previous networks, each with its projection head).
* Time per step: every method's ``local_update`` on one batch, the methods interleaved
  round-robin in one process, median of ``--steps`` after a warm-up; CPU time of the
  process on the CPU (the machine may be shared), wall time with ``--device cuda``.
* Peak memory: the method's own process, resident set on the CPU (model, activations
  and the interpreter), the GPU's peak allocation with ``--device cuda``.

    python benchmarks/bench_fedalign_cost.py [--steps 5] [--threads 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: row -> (algorithm, options, model options)
METHODS = {
    "FedAvg": ("fedavg", {}, {}),
    "FedProx": ("fedprox", {"mu": 1e-4}, {}),
    "MOON": ("moon", {"mu": 1.0, "temperature": 0.5}, {"projection_dim": 256}),
    "Mixup": ("mixup", {"gamma": 0.1}, {}),
    "StochDepth": ("stochdepth", {"final_keep_prob": 0.9}, {}),
    "GradAug (n=1)": ("gradaug", {"mu": 2.0, "num_subnets": 1, "min_width": 0.8}, {}),
    "GradAug (n=2)": ("gradaug", {"mu": 1.75, "num_subnets": 2, "min_width": 0.8}, {}),
    "FedAlign": ("fedalign", {"mu": 0.45, "width": 0.25, "lip_rescale": True, "student_input": "sliced"}, {}),
}
#: FedAlign Table 5 (CIFAR-100, ResNet-56): forward MFLOPs, stored parameters (M), seconds per round on 4 GPUs
PAPER = {"FedAvg": (87.3, 0.61, 137.2), "FedProx": (87.3, 1.21, 161.9), "MOON": (262.2, 2.21, 414.2),
         "Mixup": (87.3, 0.61, 137.8), "StochDepth": (82.4, 0.61, 136.7), "GradAug (n=1)": (133.9, 0.61, 229.2),
         "GradAug (n=2)": (170.7, 0.61, 323.9), "FedAlign": (89.1, 0.61, 166.2)}
BATCH = 64


class Setup:
    """One method ready to train: its algorithm around its own ResNet-56, a client context, 16 batches."""

    def __init__(self, row: str, world):
        from fedhpc.algorithms import ALGORITHMS, ClientContext, RoundInfo, load_algorithm_modules
        from fedhpc.client_state import ClientStateStore
        from fedhpc.config import RunConfig, build_options
        from fedhpc.data import ClientData
        from fedhpc.flat import FlatModel
        from fedhpc.models import build_model

        self.row = row
        self.algo_name, options, model_options = METHODS[row]
        dev = self.device = world.device
        torch.manual_seed(0)
        self.model = build_model("resnet56", (3, 32, 32), 100, model_options).to(dev)
        flat = FlatModel(self.model)
        cfg = RunConfig(algo=self.algo_name, lr=0.01, momentum=0.9, weight_decay=1e-4, batch_size=BATCH,
                        local_epochs=1, rounds=1, num_clients=1, clients_per_round=1)
        load_algorithm_modules()
        cls = ALGORITHMS.get(self.algo_name)
        data = SimpleNamespace(task="classification", num_classes=100, augments=False, transform=None)
        store = ClientStateStore(world, 2**32, tempfile.mkdtemp(prefix="fedalign-cost-"))
        self.algo = algo = cls(cfg, build_options(cls.Options, options, self.algo_name), self.model, flat, data,
                               world, store)
        algo.setup()
        algo.global_state = flat.flat.detach().clone()
        store.put_slot(0, "algo", flat.flat)  # MOON: a previous model, so its contrastive term runs
        rnd = RoundInfo(0, [0], [0], cfg.lr)
        algo.round_begin(rnd)
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randn(BATCH, 3, 32, 32, generator=g).to(dev),
                         torch.randint(0, 100, (BATCH,), generator=g).to(dev)) for _ in range(16)]
        empty = torch.empty(0)
        self.ctx = ClientContext(algo, 0, ClientData(0, self.batches[0][0], self.batches[0][1], empty, empty), rnd)
        flat.load_(algo.global_state)
        algo.download(self.ctx)
        self.model.train()
        self.steps = 0

    def step(self) -> float:
        """One step through the algorithm's own local_update; seconds (CPU time of this process on
        the CPU, so other processes on the machine do not count; wall time with a sync on a GPU)."""
        batch = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.ctx.batches = lambda epoch, batch_size=None: iter([batch])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.algo.local_update(self.model, self.ctx)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.process_time()
        self.algo.local_update(self.model, self.ctx)
        return time.process_time() - t0

    def stored_params(self) -> int:
        n = sum(p.numel() for p in self.model.parameters())
        extra = n if self.algo_name == "fedprox" else 0  # the global copy of the proximal term
        if self.algo_name == "moon":
            extra = sum(p.numel() for net, _ in self.algo.frozen.values() for p in net.parameters())
        return n + extra


def measure(row: str, device: str, threads: int) -> dict:
    """FLOPs, stored parameters and peak memory of one method, in a process of its own."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedhpc.world import World

    world = World(device, threads)
    s = Setup(row, world)
    algo, model, ctx = s.algo, s.model, s.ctx
    fwd, lip, step = [], [], []
    for x, y in s.batches:
        with FlopCounterMode(display=False) as c:
            algo.loss(model, x, y, ctx)
        fwd.append(c.get_total_flops())
        # batched matrix products: FedAlign's transmitting matrices and power iteration, not the network
        lip.append(sum(v for k, v in c.get_flop_counts()["Global"].items() if "bmm" in str(k)))
        with FlopCounterMode(display=False) as c:
            algo.loss(model, x, y, ctx).backward()
        step.append(c.get_total_flops())
        model.zero_grad(set_to_none=True)
        if s.algo_name not in ("stochdepth", "gradaug"):
            break
    for _ in range(2):  # the peak of real steps
        s.step()
    peak = (torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    mmac = lambda v: statistics.mean(v) / 2 / BATCH / 1e6  # noqa: E731  FLOPs -> M multiply-adds per sample
    return {"row": row, "fwd_mmac": mmac(fwd), "lip_mmac": mmac(lip), "step_mmac": mmac(step),
            "params_m": s.stored_params() / 1e6, "peak_mb": peak / 2**20, "device": str(s.device)}


def time_steps(steps: int, device: str, threads: int) -> dict:
    """Seconds per step of every method, interleaved round-robin in one process (so drifts in
    the machine's load hit every method alike); median over ``steps`` after one warm-up each."""
    from fedhpc.world import World

    world = World(device, threads)
    setups = [Setup(row, world) for row in METHODS]
    times = {row: [] for row in METHODS}
    for i in range(steps + 1):
        for s in setups:
            t = s.step()
            if i > 0:
                times[s.row].append(t)
    return {row: statistics.median(v) for row, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one row and print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.device, args.threads)))
        return
    results = []
    for row in METHODS:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", row,
                            "--threads", str(args.threads), "--device", args.device], cwd=REPO, capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{row} failed:\n{p.stderr[-3000:]}")
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"{row}: {results[-1]}", file=sys.stderr, flush=True)
    seconds = time_steps(args.steps, args.device, args.threads)
    print(f"step seconds: {seconds}", file=sys.stderr, flush=True)
    base = results[0]
    clock = "CPU seconds" if args.device == "cpu" else "seconds"
    print(f"\nResNet-56, CIFAR-100 shapes, batch {BATCH}, {results[0]['device']}, {args.threads} thread(s); "
          f"{clock} per step: median of {args.steps}, methods interleaved\n")
    print("| method | fwd MMAC/sample (paper MFLOPs) | x FedAvg (paper) | of which Lipschitz estimate | "
          "step MMAC/sample | stored params M (paper) | s/step | x FedAvg (paper s/round ratio) | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    pb = PAPER["FedAvg"]
    for r in results:
        p = PAPER[r["row"]]
        t, t0 = seconds[r["row"]], seconds["FedAvg"]
        print(f"| {r['row']} | {r['fwd_mmac']:.1f} ({p[0]}) | {r['fwd_mmac'] / base['fwd_mmac']:.2f} ({p[0] / pb[0]:.2f}) "
              f"| {r['lip_mmac']:.2f} | {r['step_mmac']:.1f} | {r['params_m']:.2f} ({p[1]}) | {t:.2f} | "
              f"{t / t0:.2f} ({p[2] / pb[2]:.2f}) | {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    main()
