"""Batched clients for the families opted in with issue 41 (s.3-4), against their sequential path.

Each row is one method's run built from launcher flags (``fedhpc.config.parse_args``), twice:
``--clients-at-once 1`` and ``--clients-at-once K``, two engines in this one process whose rounds
are interleaved (sequential, batched, sequential, ...) so that machine noise hits both alike; only
``Engine.run_round`` is timed. A ratio is the median over the timed rounds of sequential /
batched. The weights are compared after the last round (batched within float32 rounding of
sequential, growing with the rounds), so the speed is that of the same work.

The rows: the main job (``launch/mix2fld_digits.yaml``: 10 devices, an MLP, the channel model, K_s
server steps a round that are not batched) and the same with the server's conversion cut to one step
(``--server-steps 1``: the devices' share of the round), FD on its own models; the personal methods
that opted in (FedBABU, FedAlt, Ditto, Per-FedAvg HF), GlobalMix (partners from the raw pool) and StochDepth / GradAug /
MOON / FedAlign on their small models.

    python benchmarks/bench_batched_families.py [--rounds 8] [--warmup 2] [--k 10] [--only mix2fld,fd,...]
                                                [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fedhpc.config import parse_args  # noqa: E402
from fedhpc.engine import Engine  # noqa: E402
from fedhpc.world import World  # noqa: E402

#: 50 clients of digits, 10 a round (a group of 10 on one rank), 1 local epoch, batch 10
SMALL = ["--dataset", "digits", "--num-clients", "50", "--clients-per-round", "10", "--local-epochs", "1",
         "--batch-size", "10", "--lr", "0.05", "--momentum", "0.5", "--partition", "dirichlet:0.5"]
CNN = ["--model", "cnn", "--model-opt", "width=8", "--model-opt", "hidden=32"]
RESNET = ["--model", "resnet_digits", "--model-opt", "width=8"]
ROWS = {
    "mix2fld": ["--config", os.path.join(REPO, "launch", "mix2fld_digits.yaml")],
    "mix2fld_devices": ["--config", os.path.join(REPO, "launch", "mix2fld_digits.yaml"), "--server-steps", "1"],
    "fd": ["--algo", "fd", *SMALL, *CNN],
    "fedbabu": ["--algo", "fedbabu", *SMALL, *CNN],
    "fedalt": ["--algo", "fedalt", *SMALL, *CNN],
    "ditto": ["--algo", "ditto", *SMALL, *CNN],
    "per_fedavg": ["--algo", "per_fedavg", *SMALL, *CNN, "--variant", "hf"],
    "globalmix": ["--algo", "globalmix", *SMALL, *CNN, "--mix-alpha", "0.5"],
    "stochdepth": ["--algo", "stochdepth", *SMALL, *RESNET, "--final-keep-prob", "0.5"],
    "gradaug": ["--algo", "gradaug", *SMALL, *RESNET],
    "moon": ["--algo", "moon", *SMALL, *RESNET, "--model-opt", "projection_dim=32"],
    "fedalign": ["--algo", "fedalign", *SMALL, *RESNET],
}


def engine(argv, k, device, rounds):
    cfg, algo_opts, data_opts = parse_args(argv + ["--clients-at-once", str(k), "--rounds", str(rounds),
                                                   "--device", device, "--threads", "1", "--quiet",
                                                   "--no-tensorboard", "--eval-every", str(10 ** 6)])
    return Engine(cfg, algo_opts, data_opts, World(device, threads=1))


def one_row(name, argv, args):
    rounds = args.rounds + args.warmup
    seq, bat = engine(argv, 1, args.device, rounds), engine(argv, args.k, args.device, rounds)
    sync = torch.cuda.synchronize if seq.world.device.type == "cuda" else (lambda: None)
    times = {"sequential": [], "batched": []}
    for t in range(rounds):
        order = [("sequential", seq), ("batched", bat)] if t % 2 == 0 else [("batched", bat), ("sequential", seq)]
        for mode, eng in order:
            sync()
            t0 = time.perf_counter()
            eng.run_round(t)
            sync()
            if t >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    ratios = [s / b for s, b in zip(times["sequential"], times["batched"])]
    own = [(seq.algo.client_model(c), bat.algo.client_model(c)) for c in range(seq.data.num_clients)]
    own = [(a, b) for a, b in own if a is not None and b is not None]
    diff = max([float((seq.global_state.double() - bat.global_state.double()).abs().max())]
               + [float((a.double() - b.double()).abs().max()) for a, b in own])
    return {"method": name, "k": args.k, "sequential_ms": 1e3 * statistics.median(times["sequential"]),
            "batched_ms": 1e3 * statistics.median(times["batched"]), "speedup": statistics.median(ratios),
            "max_abs_weight_diff": diff, "rounds": args.rounds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--k", type=int, default=10, help="clients at once")
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"device {args.device}, torch {torch.__version__}, {args.rounds} timed rounds after {args.warmup}, "
          f"K = {args.k}")
    print("| method | sequential ms | batched ms | sequential / batched | max abs w_seq - w_batched |")
    print("|---|---:|---:|---:|---:|")
    for name in args.only.split(","):
        row = one_row(name, ROWS[name], args)
        rows.append(row)
        print(f"| {name} | {row['sequential_ms']:.1f} | {row['batched_ms']:.1f} | {row['speedup']:.2f} | "
              f"{row['max_abs_weight_diff']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
