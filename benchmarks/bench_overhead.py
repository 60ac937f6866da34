"""Per-client overhead: fedhpc's round loop against a plain PyTorch loop, and 1 vs 2 ranks.

(a) The cross-device shape (issue 7): digits, 100 IID clients of ~15 samples, 10 per
    round, 1 epoch, batch 5, SGD 0.05, MLP 64-128-10. fedhpc's ``run_round`` and a
    plain loop doing the same client work (same clients, same batch order, state-dict
    loads, a fresh SGD per client, float64 averaging) run interleaved, round by round,
    in this process; the final weights are compared to prove the work was the same.
    ``torch._dynamo``'s lazy import (triggered by the first optimizer) happens before
    timing, for both. Target: fedhpc / plain <= 1.05.
(b) Clients 10x larger (10 clients of ~143 samples, all sampled each round, same
    model and batch): the whole run on 1 rank and under ``mpiexec -n 2``, 1 thread per
    rank, interleaved repeats; the figure is the round loop's time (the sum of
    ``round_seconds`` in metrics.jsonl: training and the all-reduce, not start-up).
    Target: 2 ranks >= 1.8x one rank.
(c) The machine's own ceiling for (b): two independent 1-rank runs started together
    against a lone one (no communication at all), so (b) can be read as a share of what
    two processes can gain on this machine.

    python benchmarks/bench_overhead.py [--rounds 50] [--repeats 3]
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_round import plain_round  # noqa: E402  the same hand-written loop as the engine benchmark
WORKLOAD_A = dict(dataset="digits", model="mlp", model_options={"hidden": 128, "depth": 2}, partition="iid",
                  num_clients=100, clients_per_round=10, local_epochs=1, batch_size=5, lr=0.05,
                  client_test_fraction=0.0, eval_every=10, quiet=True, tensorboard=False, threads=1)


def bench_loop(rounds: int, warmup: int = 3):
    from fedhpc.algorithms.base import derive_seed
    from fedhpc.config import RunConfig
    from fedhpc.engine import Engine
    from fedhpc.models import build_model
    from fedhpc.world import World

    cfg = RunConfig(rounds=rounds + warmup, **WORKLOAD_A)
    cfg.validate()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the lazy torch._dynamo import, untimed
    eng = Engine(cfg, None, None, World(threads=1))
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    model = build_model(cfg.model, eng.data.input_shape, eng.data.num_classes, cfg.model_options)
    global_sd = {k: v.clone() for k, v in model.state_dict().items()}
    t_fed, t_plain = [], []
    for t in range(cfg.rounds):
        t0 = time.perf_counter(); eng.run_round(t); t1 = time.perf_counter()
        global_sd = plain_round(model, global_sd, eng.data, cfg, t); t2 = time.perf_counter()
        if t >= warmup:
            t_fed.append(t1 - t0); t_plain.append(t2 - t1)
    fed_sd = eng.flat.state_dict_from(eng.global_state)
    diff = max(float((fed_sd[k].double() - global_sd[k].double()).abs().max()) for k in global_sd)
    return sum(t_fed), sum(t_plain), statistics.median(t_fed), statistics.median(t_plain), diff


def launcher_cmd(ranks: int, rounds: int, out: str):
    args = ["--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=128", "--partition", "iid",
            "--num-clients", "10", "--clients-per-round", "10", "--local-epochs", "1", "--batch-size", "5",
            "--lr", "0.05", "--client-test-fraction", "0", "--rounds", str(rounds), "--eval-every", "1",
            "--threads", "1", "--quiet", "--no-tensorboard", "--checkpoint-every", "0", "--out", out]
    cmd = [sys.executable, "-m", "fedhpc.launch", *args]
    if ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    return cmd, env


def round_loop_seconds(out: str) -> float:
    # round_seconds times run_round on rank 0 (its clients, then the all-reduce that waits for
    # the other rank), not start-up or evaluation: the sum is the round loop's time.
    return sum(json.loads(line)["round_seconds"] for line in open(os.path.join(out, "metrics.jsonl")))


def launcher_run(ranks: int, rounds: int, out: str) -> float:
    cmd, env = launcher_cmd(ranks, rounds, out)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return round_loop_seconds(out)


def concurrent_pair(rounds: int, d: str) -> float:
    """Two independent 1-rank runs started together: mean round-loop seconds of the two.

    Nothing is shared between them, so 2 x (a lone run) / (this) is the most two processes
    can gain on this machine (cores, caches, memory bandwidth, the hypervisor): the ceiling
    for any 2-rank speed-up here."""
    procs = []
    for i in range(2):
        cmd, env = launcher_cmd(1, rounds, os.path.join(d, f"pair{i}"))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(p.stderr.read().decode())
    return statistics.mean(round_loop_seconds(os.path.join(d, f"pair{i}")) for i in range(2))


def bench_ranks(rounds: int, repeats: int):
    """Round-loop seconds of whole launcher runs on 1 and 2 ranks, interleaved."""
    times = {1: [], 2: [], "pair": []}
    for rep in range(repeats):
        for ranks in (1, 2, "pair"):
            d = tempfile.mkdtemp(prefix="fedhpc-bench-")
            try:
                times[ranks].append(concurrent_pair(rounds, d) if ranks == "pair"
                                    else launcher_run(ranks, rounds, os.path.join(d, "run")))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank-rounds", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)

    sums = []
    for _ in range(a.repeats):
        sums.append(bench_loop(a.rounds))
    fed = statistics.median(s[0] for s in sums)
    plain = statistics.median(s[1] for s in sums)
    print(f"(a) cross-device workload, {a.rounds} timed rounds x {a.repeats} repeats (interleaved per round)")
    print(f"    fedhpc round loop   {fed:.3f} s   (runs: {', '.join(f'{s[0]:.3f}' for s in sums)})")
    print(f"    plain PyTorch loop  {plain:.3f} s   (runs: {', '.join(f'{s[1]:.3f}' for s in sums)})")
    print(f"    ratio fedhpc / plain = {fed / plain:.3f}   (target <= 1.05); "
          f"max |weights difference| {max(s[4] for s in sums):.1e}")

    times = bench_ranks(a.rank_rounds, a.repeats)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"(b) 10 clients of ~143 samples, {a.rank_rounds} rounds, round-loop seconds, {a.repeats} repeats")
    print(f"    1 rank   {one:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times[1])})")
    print(f"    2 ranks  {two:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times[2])})")
    print(f"    speed-up 2 ranks / 1 rank = {one / two:.2f}x   (target >= 1.8x)")
    pair = statistics.median(times["pair"])
    ceiling = 2 * one / pair
    print(f"(c) the machine's ceiling: two independent 1-rank runs at once, {pair:.2f} s each "
          f"(runs: {', '.join(f'{t:.2f}' for t in times['pair'])})")
    print(f"    2 x lone / concurrent = {ceiling:.2f}x: the most 2 processes gain here; "
          f"fedhpc's 2 ranks reach {one / two / ceiling:.1%} of it")


if __name__ == "__main__":
    main()
