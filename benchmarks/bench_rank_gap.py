"""Where the 2-rank gap goes: per-client training time and the all-reduce wait, per rank.

Workload (b) of bench_overhead.py (10 clients of ~143 samples, all sampled, MLP 64-128-10,
batch 5), 40 rounds without evaluation, the first 5 not counted. Prints one JSON line per
process: mean ms of one client's local_update, mean round ms, mean ms in the round's
all-reduce (for a rank: waiting for the other). Run it lone, as 2 ranks, and as two
independent processes at once, and compare:

    python benchmarks/bench_rank_gap.py lone
    mpiexec -n 2 python benchmarks/bench_rank_gap.py ranks
    python benchmarks/bench_rank_gap.py pairA & python benchmarks/bench_rank_gap.py pairB; wait

Two more isolate what being a rank adds, each an mpiexec pair that trains like two independent
processes (every process all 10 clients, no collective in the rounds):

    mpiexec -n 2 python benchmarks/bench_rank_gap.py mpi-indep    # MPI initialised, nothing else
    mpiexec -n 2 python benchmarks/bench_rank_gap.py gloo-indep   # + the gloo process group alive
"""
import json
import sys
import time

import torch
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World
args = ["--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=128", "--partition", "iid",
        "--num-clients", "10", "--clients-per-round", "10", "--local-epochs", "1", "--batch-size", "5",
        "--lr", "0.05", "--client-test-fraction", "0", "--rounds", "40", "--threads", "1", "--quiet",
        "--no-tensorboard", "--checkpoint-every", "0", "--eval-every", "1000"]
cfg, ao, do = parse_args(args)
tag = sys.argv[1] if len(sys.argv) > 1 else ""
if tag == "mpi-indep":  # MPI_Init has run (mpi4py), then the World sees a single process
    import os
    from mpi4py import MPI  # noqa: F401
    for k in [k for k in os.environ if k.startswith(("PMI_", "OMPI_COMM"))]:
        del os.environ[k]
world = World(threads=1)
group_size = world.size
if tag == "gloo-indep":  # the process group and its threads stay; the engine acts alone
    world.rank, world.size = 0, 1
eng = Engine(cfg, ao, do, world)
train, wait, rounds = [], [], []
lu = eng.algo.local_update
def timed(model, ctx):
    t0 = time.perf_counter(); lu(model, ctx); train.append(time.perf_counter() - t0)
eng.algo.local_update = timed
ar = world.all_reduce_sum_
def timed_ar(t):
    t0 = time.perf_counter(); r = ar(t); wait.append(time.perf_counter() - t0); return r
world.all_reduce_sum_ = timed_ar
for t in range(cfg.rounds):
    t0 = time.perf_counter(); eng.run_round(t); rounds.append(time.perf_counter() - t0)
skip = 5
n = len(train) // cfg.rounds
per_client = sum(train[skip * n:]) / len(train[skip * n:])
print(json.dumps({"tag": tag, "rank": world.rank, "size": world.size,
                  "per_client_ms": round(1e3 * per_client, 3), "clients_per_round": n,
                  "round_ms": round(1e3 * sum(rounds[skip:]) / len(rounds[skip:]), 3),
                  "allreduce_ms": round(1e3 * sum(wait[skip:]) / len(wait[skip:]), 3)}), flush=True)
world.size = group_size
world.close()
from fedhpc.launch import exit_now
exit_now(0)
