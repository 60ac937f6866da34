"""Cost of ReproducibleSum.add_ (the engine's rank-independent upload sum) against a plain float64 add.

One client's upload per call: float32 terms times a sample-count weight, into a sum of the same
size. Three ways, interleaved, median of --repeats samples of >= --min-ms each, one thread:
the native deposit (csrc/cpu/binned_cpu.cpp; with --device cuda the kernel of
csrc/cuda/mix_kernels.cu), its pure-PyTorch definition (fedhpc.ops.reference.binned_add_) and
``buf.add_(terms, alpha=w)`` on a float64 buffer (what the engine did before). The
engine-level figure is benchmarks/bench_overhead.py (a).

    python benchmarks/bench_reproducible_sum.py [--sizes 26000 1000000 4000000] [--repeats 9] [--device cuda]
    FEDHPC_NO_SIMD=1 python benchmarks/bench_reproducible_sum.py     # the CPU kernel's scalar loop
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedhpc import ops
from fedhpc.reproducible_sum import ReproducibleSum


def sample(fn, min_s: float, sync) -> float:
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n % 8 == 0:  # a GPU queues launches: wait for them before reading the clock
            sync()
            if time.perf_counter() - t0 >= min_s:
                return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[26_000, 1_000_000, 4_000_000])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--min-ms", type=float, default=50.0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    nat = ops.native()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "1 thread"
    if device.type == "cpu" and nat.module is not None:  # the kernel's vector path (FEDHPC_NO_SIMD=1: scalar)
        where += f", {nat.module.cpu_isa()['binned_add']} loop"
    print(f"torch {torch.__version__}, extension {nat.origin}, binned_add on {args.device}: "
          f"{ops.backends()['binned_add'][device.type]}; {where}, median of {args.repeats} interleaved samples")
    print(f"{'elements':>10} {'native ms':>10} {'torch ms':>10} {'plain ms':>10} {'native/plain':>13} {'torch/native':>13}")
    for size in args.sizes:
        terms = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(device)
        acc = ReproducibleSum(size, 1000, device=device)
        buf = torch.zeros(size, dtype=torch.float64, device=device)

        def native():
            acc.add_(terms, alpha=143.0)

        def reference():
            with ops.prefer("torch"):
                acc.add_(terms, alpha=143.0)

        def plain():
            buf.add_(terms, alpha=143.0)

        times = {"native": [], "torch": [], "plain": []}
        for _ in range(args.repeats):
            for name, fn in (("native", native), ("torch", reference), ("plain", plain)):
                acc.zero_()
                times[name].append(sample(fn, args.min_ms / 1e3, sync))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{size:>10} {med['native']:>10.3f} {med['torch']:>10.3f} {med['plain']:>10.3f} "
              f"{med['native'] / med['plain']:>13.2f} {med['torch'] / med['native']:>13.2f}")


if __name__ == "__main__":
    main()
