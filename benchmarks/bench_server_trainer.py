"""Server-trainer throughput (samples/s of ServerTrainer.fit) on 1 and 2 ranks (mpiexec), 1 thread per rank.

Two models: the digits CNN on 8x8 inputs (``cnn``) and Mix2FLD's CNN on 28x28
inputs (``mix2fld_cnn``, 12,544 weights), trained on synthetic data of the same
shapes. Every launch runs a warm-up fit and then --fits timed fits and keeps
their median (a fit's time is the slowest rank's); launches of 1 and 2 ranks are
interleaved --repeats times and the median launch is reported, because a shared
machine is noisy. Besides wall-clock samples/s it reports samples per CPU second
of the busiest rank (process CPU time, gloo's threads included): on an
oversubscribed machine, where ranks wait for a core, that is the figure that
shows how the work divides; on idle cores the two agree.

    python benchmarks/bench_server_trainer.py [--steps 40] [--batch-size 64] [--micro-batch 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODELS = {"cnn": (1, 8, 8), "mix2fld_cnn": (1, 28, 28)}


def worker(a) -> None:
    import torch

    from fedhpc.flat import FlatModel
    from fedhpc.models import build_model
    from fedhpc.server.trainer import ServerTrainConfig, ServerTrainer
    from fedhpc.world import World

    world = World(a.device, threads=1)
    try:
        cfg = ServerTrainConfig(steps=a.steps, batch_size=a.batch_size, micro_batch=a.micro_batch, lr=0.01,
                                momentum=0.9)
        out = {}
        for name, shape in MODELS.items():
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(a.samples, *shape, generator=g), torch.randint(0, 10, (a.samples,), generator=g)
            torch.manual_seed(0)
            model = build_model(name, shape, 10).to(world.device)
            trainer = ServerTrainer(world, model, FlatModel(model))
            wall, cpu = [], []
            for k in range(a.fits + 1):  # fit 0 warms up
                cpu0 = time.process_time()
                res = trainer.fit(x, y, cfg, seed=k)
                seconds, cpu_seconds = (max(v) for v in zip(*world.all_gather_object(
                    (res["seconds"], time.process_time() - cpu0))))
                if k:
                    wall.append(res["samples"] / seconds)
                    cpu.append(res["samples"] / cpu_seconds)
            out[name] = statistics.median(wall)
            out[name + "/cpu"] = statistics.median(cpu)
        if world.rank == 0:
            with open(a.json, "w") as f:
                json.dump(out, f)
    finally:
        world.close()


def launch(ranks: int, a, path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--json", path, "--device", a.device,
           "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--micro-batch", str(a.micro_batch),
           "--samples", str(a.samples), "--fits", str(a.fits)]
    if ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "PMIX_", "HYDRA_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--fits", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="fedhpc-bench-st-") as tmp:
        for rep in range(a.repeats):
            for ranks in runs:
                runs[ranks].append(launch(ranks, a, os.path.join(tmp, f"r{ranks}-{rep}.json")))
    print(f"config: {a.steps} steps, batch {a.batch_size}, micro-batch {a.micro_batch}, {a.samples} samples, "
          f"1 thread per rank, {len(os.sched_getaffinity(0))} cores, device {a.device}; "
          f"median of {a.fits} fits per launch, median of {a.repeats} launches")
    for name in [n + suffix for n in MODELS for suffix in ("", "/cpu")]:
        one = statistics.median(r[name] for r in runs[1])
        two = statistics.median(r[name] for r in runs[2])
        print(f"{name:16s} 1 rank: {one:9.0f} samples/s   2 ranks: {two:9.0f} samples/s   "
              f"ratio {two / one:.2f}x   (launches 1: {', '.join(f'{r[name]:.0f}' for r in runs[1])}; "
              f"2: {', '.join(f'{r[name]:.0f}' for r in runs[2])})")


if __name__ == "__main__":
    main()
