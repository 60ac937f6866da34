"""The reference column: FedAvg written as a plain PyTorch loop over the exported workload.

    python benchmarks/peers/run_plain.py WORKLOAD.npz RESULT.json

One model instance; per sampled client: load the global state dict, a fresh SGD, the
client's mini-batches in fedhpc's order, then add n_k * w_k to float64 sums; the new
global model is sum / sum n_k (FedAvg, McMahan et al. 2017, Alg. 1, weights n_k / n).
What a researcher would write by hand with no framework: the floor every framework is
measured against. Runs in any of the benchmark's venvs (only numpy and torch).
"""

from __future__ import annotations

import sys
import time

import torch
from torch.nn import functional as F

import peerlib


def fedavg_round(model, global_state, work: peerlib.Workload, t: int):
    """One FedAvg round on round ``t``'s cohort; returns the new global state dict."""
    sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}
    total = 0
    for cid in work.cohort(t):
        model.load_state_dict(global_state)
        opt = torch.optim.SGD(model.parameters(), lr=work.lr)
        for x, y in work.batches(t, cid):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        n = work.size(cid)
        for k, v in model.state_dict().items():
            sums[k].add_(v, alpha=n)
        total += n
    return {k: (s / total).to(global_state[k].dtype) for k, s in sums.items()}


def main(work_path: str, out_path: str) -> int:
    peerlib.set_threads(1)
    peerlib.warm_up_torch()
    work = peerlib.Workload(work_path)
    model = work.build_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rounds, evals, acc = [], peerlib.Stopwatch(), {}
    for t in range(work.rounds):
        t0 = time.perf_counter()
        state = fedavg_round(model, state, work, t)
        rounds.append(time.perf_counter() - t0)
        if work.is_eval_round(t):
            with evals:
                model.load_state_dict(state)
                acc[t + 1] = work.evaluate(model)[0]
    peerlib.write_result(out_path, "plain", rounds, evals.total, acc, state)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
