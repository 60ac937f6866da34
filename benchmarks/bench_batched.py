"""Clients trained at once (``--clients-at-once K``) against one after another and a plain loop.

Workload (a) of bench_overhead.py (issue 7's cross-device shape): digits, 100 IID clients of
~15 samples, 10 per round, 1 epoch, batch 5, SGD 0.05, MLP 64-128-10. Three loops run in
this one process, interleaved round by round so that machine noise hits them alike:

* fedhpc, sequential (``clients_at_once`` 1): ``Engine.run_round``;
* fedhpc, batched (``clients_at_once`` K): the same engine round with the rank's clients
  trained K at a time (fedhpc/batched.py);
* the plain PyTorch loop of bench_round.py (state-dict loads, a fresh SGD per client).

Only ``run_round`` (or the plain round) is timed, as in bench_overhead.py; the final weights
of the three are compared to show the work was the same (batched vs sequential within
float32 rounding). Ratios are taken within each repeat, then the median over repeats.

    python benchmarks/bench_batched.py [--rounds 50] [--repeats 3] [--k 10] [--model mlp] [--device cpu]
                                       [--clients-per-round 10]

``--model cnn --device cuda`` is the GPU check of the issue (batched >= 5x sequential on the
digits CNN); the plain loop (bench_round.py's, CPU tensors) runs on ``--device cpu`` only.
``--clients-per-round`` > 10 leaves workload (a) (more clients to batch per rank); the
header says which workload ran.

If the engine has no ``clients_at_once`` yet, the batched round is this file's stand-in
for the engine dispatch (the same calls: fedhpc.batched.train_in_groups, then the uploads
weighted into a float64 sum and ``algo.aggregate``), and the output says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import WORKLOAD_A  # noqa: E402
from bench_round import plain_round  # noqa: E402

from fedhpc.algorithms import RoundInfo  # noqa: E402
from fedhpc.algorithms.base import derive_seed  # noqa: E402
from fedhpc.config import RunConfig  # noqa: E402
from fedhpc.engine import Engine, sample_clients  # noqa: E402
from fedhpc.models import build_model  # noqa: E402
from fedhpc.world import World  # noqa: E402

HAS_DISPATCH = "clients_at_once" in RunConfig.__dataclass_fields__


def standin_round(eng: Engine, t: int, k: int) -> None:
    """One FedAvg round through fedhpc.batched, for an engine without the dispatch (1 rank)."""
    from fedhpc.batched import train_in_groups

    cfg, algo = eng.cfg, eng.algo
    sampled = sample_clients(cfg.seed, t, eng.data.num_clients, cfg.clients_per_round)
    rnd = RoundInfo(t, sampled, sampled, cfg.lr * cfg.lr_decay ** t)
    algo.global_state = eng.global_state
    algo.ledger.reset()
    algo.round_begin(rnd)
    eng.model.train()
    total = eng.round_buffer[:eng.flat.numel]
    total.zero_()
    weight = 0.0
    for cid, ctx, _, _ in train_in_groups(eng, rnd, sampled, k):
        float(ctx.loss_sum)  # the engine's one sync per client
        w = algo.client_weight(ctx)
        total.add_(algo.upload(eng.model, ctx)["params"], alpha=w)
        weight += w
    eng.global_state = algo.aggregate(eng.global_state, {"params": total}, weight, rnd).to(eng.flat.flat.dtype).clone()


def one_repeat(args, k: int):
    kw = dict(WORKLOAD_A)
    kw.update(model=args.model, device=args.device, rounds=args.rounds + args.warmup,
              clients_per_round=args.clients_per_round)
    if args.model != "mlp":
        kw.pop("model_options")
    cfg_seq = RunConfig(**kw)
    cfg_bat = RunConfig(**kw, **({"clients_at_once": k} if HAS_DISPATCH else {}))
    for c in (cfg_seq, cfg_bat):
        c.validate()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the lazy torch._dynamo import, untimed
    seq = Engine(cfg_seq, None, None, World(args.device, threads=1))
    bat = Engine(cfg_bat, None, None, World(args.device, threads=1))
    plain = seq.world.device.type == "cpu"  # bench_round's plain loop indexes CPU tensors
    torch.manual_seed(derive_seed(cfg_seq.seed, "init"))
    model = build_model(cfg_seq.model, seq.data.input_shape, seq.data.num_classes, cfg_seq.model_options)
    global_sd = {n: v.clone() for n, v in model.state_dict().items()}
    times = {"sequential": [], "batched": [], "plain": []}
    sync = torch.cuda.synchronize if seq.world.device.type == "cuda" else (lambda: None)
    for t in range(cfg_seq.rounds):
        t0 = time.perf_counter()
        seq.run_round(t)
        sync()
        t1 = time.perf_counter()
        if HAS_DISPATCH:
            bat.run_round(t)
        else:
            standin_round(bat, t, k)
        sync()
        t2 = time.perf_counter()
        if plain:
            global_sd = plain_round(model, global_sd, seq.data, cfg_seq, t)
        t3 = time.perf_counter()
        if t >= args.warmup:
            times["sequential"].append(t1 - t0)
            times["batched"].append(t2 - t1)
            times["plain"].append(t3 - t2)
    sums = {name: sum(v) for name, v in times.items()}
    diff_batched = float((seq.global_state - bat.global_state).abs().max())
    seq_sd = seq.flat.state_dict_from(seq.global_state)
    diff_plain = (max(float((seq_sd[n].double() - global_sd[n].double()).abs().max()) for n in global_sd)
                  if plain else float("nan"))
    return sums, diff_batched, diff_plain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[10], help="clients at once (one row each)")
    ap.add_argument("--model", default="mlp", help="mlp (workload a: 64-128-10) or cnn (the digits CNN)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--clients-per-round", type=int, default=WORKLOAD_A["clients_per_round"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    workload = "(a)" if a.clients_per_round == WORKLOAD_A["clients_per_round"] else "(a) except clients per round"
    print(f"workload {workload}: digits, {WORKLOAD_A['num_clients']} IID clients x ~15 samples, "
          f"{a.clients_per_round} per round, 1 epoch, batch {WORKLOAD_A['batch_size']}, SGD "
          f"{WORKLOAD_A['lr']}, model {a.model}, {a.rounds} timed rounds (run_round only), 1 thread, {a.device}; "
          f"{a.repeats} repeats, the three loops interleaved round by round")
    if not HAS_DISPATCH:
        print("note: RunConfig has no clients_at_once: the batched round is this file's stand-in for the "
              "engine dispatch (fedhpc.batched.train_in_groups + weighted sum + aggregate)")
    for k in a.k:
        runs = [one_repeat(a, k) for _ in range(a.repeats)]
        print(f"K = {k}")
        for name in ("sequential", "batched", "plain")[:3 if a.device == "cpu" else 2]:
            secs = [r[0][name] for r in runs]
            print(f"    {name:10s} {statistics.median(secs):7.3f} s   (runs: {', '.join(f'{s:.3f}' for s in secs)})")
        r_seq = [r[0]["sequential"] / r[0]["batched"] for r in runs]
        print(f"    speed-up batched vs sequential fedhpc: {statistics.median(r_seq):.2f}x "
              f"(runs: {', '.join(f'{x:.2f}' for x in r_seq)})")
        if a.device == "cpu":
            r_plain = [r[0]["plain"] / r[0]["batched"] for r in runs]
            print(f"    speed-up batched vs plain loop:        {statistics.median(r_plain):.2f}x "
                  f"(runs: {', '.join(f'{x:.2f}' for x in r_plain)})   (target > 1)")
        print(f"    max |batched - sequential| weights {max(r[1] for r in runs):.1e}; "
              f"max |plain - sequential| {max(r[2] for r in runs):.1e}")
        if max(r[1] for r in runs) > 1e-4:
            print("error: batched and sequential diverged; the comparison is not like for like", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
