"""Cost of one FedMix local step against one FedAvg step (and NaiveMix for context).

Same model, same initial weights, same mini-batch, one SGD step each:

* fedavg    L(f(x), y)
* naivemix  Eq. 1 with one received mean per batch
* fedmix    Eq. 5 with one received mean per batch (double backward for l3)

Measured, in ONE invocation of this script:

* time: median wall time of a step (forward, backward, SGD update) over
  ``--steps`` steps after ``--warmup`` steps, all modes interleaved step by step
  so that drifts of the machine hit them alike;
* memory, three honest views (none is tracemalloc, which does not see torch):
  - ``saved``: bytes of the distinct tensors autograd saves for backward during a
    step (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded. For
    FedMix this includes what the create_graph backward saves for the second
    backward. It is the activation memory a step must hold, deterministic.
  - ``rss``: peak resident memory of a fresh subprocess while it runs 3 steps,
    minus its resident memory after building the model and batch. glibc is told
    to serve every allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_),
    so freed tensors leave the resident set and the peak follows live memory.
  - ``cuda``: ``torch.cuda.max_memory_allocated`` during a step minus before
    it, when a GPU is present (``--device cuda``).

Usage:  python benchmarks/bench_fedmix.py [--model vgg_fedmix] [--batch 10 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fedhpc.algorithms.base import task_loss  # noqa: E402
from fedhpc.algorithms.mafl.mixing import fedmix_loss, naivemix_loss, one_hot  # noqa: E402
from fedhpc.models import build_model  # noqa: E402

MODES = ("fedavg", "naivemix", "fedmix")
SHAPES = {"vgg_fedmix": ((3, 32, 32), 10), "lenet5": ((1, 28, 28), 62), "cnn": ((1, 8, 8), 10)}


def setup(model_name: str, batch: int, device: str):
    shape, classes = SHAPES[model_name]
    torch.manual_seed(0)
    model = build_model(model_name, shape, classes).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.rand((batch,) + shape, generator=g).to(device)
    y = torch.randint(classes, (batch,), generator=g).to(device)
    xbar = torch.rand((1,) + shape, generator=g).to(device)        # one received mean per batch
    ybar = torch.softmax(torch.randn(1, classes, generator=g), -1).to(device)
    return model, x, y, xbar, ybar, classes


def make_step(model, x, y, xbar, ybar, classes, mode: str, lam: float = 0.05):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # small lr: the weights barely move between steps
    yh = one_hot(y, classes)

    def step():
        opt.zero_grad(set_to_none=True)
        if mode == "fedavg":
            loss = task_loss(model(x), y)
        elif mode == "naivemix":
            loss = naivemix_loss(model, x, yh, xbar, ybar, lam)
        else:
            loss = fedmix_loss(model, x, yh, xbar, ybar, lam)
        loss.backward()
        opt.step()
    return step


def saved_bytes(model, step) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(model_name: str, batch: int, mode: str) -> None:
    """Fresh process: peak resident-set growth of 3 steps over the built model and batch.

    The kernel's high-water mark (VmHWM) is reset after the set-up (``5 > clear_refs``,
    Linux >= 4.0), so the peak seen is the steps' own, not the import's.
    """
    torch.set_num_threads(1)
    model, x, y, xbar, ybar, classes = setup(model_name, batch, "cpu")
    step = make_step(model, x, y, xbar, ybar, classes, mode)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    for _ in range(3):
        step()
    peak = _status_kib("VmHWM")
    print(json.dumps({"rss_delta_bytes": (peak - base) * 1024}))


def rss_delta(model_name: str, batch: int, mode: str) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model_name, str(batch), mode],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_delta_bytes"]


def cuda_peak(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vgg_fedmix", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[10, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2])
    torch.set_num_threads(args.threads)
    print(f"model {args.model}, device {args.device}, {args.threads} thread(s), torch {torch.__version__}, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps\n")
    header = "| batch | mode | step time (ms, median) | time / FedAvg | autograd-saved MiB | saved / FedAvg | peak RSS growth MiB | RSS / FedAvg |"
    if args.device == "cuda":
        header += " CUDA peak MiB | CUDA / FedAvg |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for batch in args.batch:
        built = {m: setup(args.model, batch, args.device) for m in MODES}
        steps = {m: make_step(*built[m], m) for m in MODES}
        for _ in range(args.warmup):
            for m in MODES:
                steps[m]()
        times = {m: [] for m in MODES}
        for _ in range(args.steps):
            for m in MODES:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps[m]()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[m].append(time.perf_counter() - t0)
        res = {}
        for m in MODES:
            r = {"time": statistics.median(times[m]), "saved": saved_bytes(built[m][0], steps[m]),
                 "rss": rss_delta(args.model, batch, m) if args.device == "cpu" else None}
            if args.device == "cuda":
                r["cuda"] = cuda_peak(steps[m])
            res[m] = r
        base = res["fedavg"]
        for m in MODES:
            r = res[m]
            line = (f"| {batch} | {m} | {1e3 * r['time']:.2f} | {r['time'] / base['time']:.2f} | "
                    f"{r['saved'] / 2**20:.2f} | {r['saved'] / base['saved']:.2f} | ")
            line += (f"{r['rss'] / 2**20:.2f} | {r['rss'] / base['rss']:.2f} |" if r["rss"] is not None else "- | - |")
            if args.device == "cuda":
                line += f" {r['cuda'] / 2**20:.2f} | {r['cuda'] / base['cuda']:.2f} |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
