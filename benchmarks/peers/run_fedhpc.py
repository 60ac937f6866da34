"""The fedhpc column: ``python -m fedhpc.launch`` with a listener that keeps every round's time.

    python benchmarks/peers/run_fedhpc.py WORKLOAD.npz RESULT.json -- LAUNCH FLAGS...
    mpiexec -n 2 python benchmarks/peers/run_fedhpc.py ...         # 2 ranks

It calls ``fedhpc.launch.main`` with the flags given (the same code path as
``python -m fedhpc.launch``). The loop time is the sum of ``round_seconds`` over all
rounds: ``Engine.run_round``'s own clock on rank 0 (sampling, local training, the
all-reduce that waits for the other ranks, the server update), evaluation excluded.
metrics.jsonl only holds the evaluated rounds (every 10th), so the per-round values are
read where the engine logs them (``Engine._log``, called every round on every rank);
the listener adds one list append per round. The engine's evaluation is timed the same
way. Accuracies come from metrics.jsonl, the final weights from final_model.pt. Like
every runner, it builds one throwaway optimizer first (``peerlib.warm_up_torch``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import peerlib


def main(argv) -> int:
    work_path, out_path = argv[0], argv[1]
    flags = argv[3:] if argv[2:3] == ["--"] else argv[2:]
    from fedhpc import engine as fedhpc_engine
    from fedhpc import launch

    round_seconds, eval_seconds = [], [0.0]
    log, evaluate = fedhpc_engine.Engine._log, fedhpc_engine.Engine.evaluate

    def logging_listener(self, metrics):
        round_seconds.append(metrics["round_seconds"])
        return log(self, metrics)

    def timed_evaluate(self):
        t0 = time.perf_counter()
        try:
            return evaluate(self)
        finally:
            eval_seconds[0] += time.perf_counter() - t0

    fedhpc_engine.Engine._log = logging_listener
    fedhpc_engine.Engine.evaluate = timed_evaluate
    peerlib.warm_up_torch()
    code = launch.main(flags)
    if code != 0:
        return code
    rank = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))
    if rank != 0:
        return 0
    out = flags[flags.index("--out") + 1]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    accuracies = {r["round"]: r["test_accuracy"] for r in records if "test_accuracy" in r}  # evaluated rounds
    # The listener must have seen exactly what the engine wrote for the evaluated rounds.
    logged = {r["round"]: r["round_seconds"] for r in records}
    assert len(round_seconds) == peerlib.Workload(work_path).rounds, len(round_seconds)
    assert all(abs(round_seconds[k - 1] - v) < 1e-12 for k, v in logged.items()), "round_seconds mismatch"
    state = torch.load(os.path.join(out, "final_model.pt"))
    ranks = int(os.environ.get("PMI_SIZE", os.environ.get("WORLD_SIZE", "1")))
    peerlib.write_result(out_path, f"fedhpc ({ranks} rank{'s' if ranks > 1 else ''})", round_seconds,
                         eval_seconds[0], accuracies, state, ranks=ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
