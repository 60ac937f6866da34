"""Native ops (fedhpc.ops) against their pure-PyTorch reference and against the machine's copy bandwidth.

Per op and case, in ONE run, at 1 and 2 threads (CPU) and on the GPU when there is one:

* time: median over ``--repeats`` samples of the per-call time, each sample long enough
  (>= ``--min-ms``) to time reliably; native, reference and copy samples interleaved so that
  drifts of the machine hit them alike;
* ``torch/native``: reference time over native time (> 1: the extension is faster);
* ``GB/s``: bytes the op must move (every input read once, every output written once) over
  its time; ``copy GB/s``: ``dst.copy_(src)`` on a buffer the size of the op's largest
  output, counted as read + write; ``native/copy`` is the share of copy bandwidth reached;
* ``one-pass/native`` (segment_mix): time of torch's own single-pass kernel over the same
  bytes (``torch.add(a, b, alpha=w, out=out)``: one coefficient, b broadcast) over the native
  time. A copy reads one stream and writes one; the mix reads two. Where the states stay in
  cache that extra stream, not memory bandwidth, is the limit, and this column says how close
  the kernel comes to the cheapest pass torch itself can make (1.0: as fast).

Cases: segment_mix (pMixFed's layer-wise mixup of C client states against the global state,
out of place and in place, S segments); fedmix_l3 and mix_inputs_labels on CIFAR-shaped
batches, forward alone and forward + backward. With ``--fedmix-step``, also one FedMix SGD
step of a model with the ops native vs torch (what a run sees).

Allocator: glibc returns the top of its heap to the kernel once more than a (self-adjusting)
threshold is free, and the next allocation page-faults it back in: a few hundred microseconds
that land on whichever call happens to free and allocate in that order, native or torch (a
64-sample fwd+bwd measured 0.09 or 0.28 ms from one run to the next). The benchmark fixes the
thresholds (mallopt, as MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ would) so that it times
the ops, not that lottery; ``--glibc-default-malloc`` leaves them alone.

Usage:  python benchmarks/bench_ops.py [--threads 1 2] [--repeats 15] [--device cpu|cuda|all] [--fedmix-step]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fedhpc import ops  # noqa: E402
from fedhpc.ops import reference  # noqa: E402


def fix_malloc_thresholds():
    """Stop glibc trimming the heap and mmapping large blocks (see the module docstring)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # from glibc's malloc.h
    return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 1 << 30))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(fn, device, min_s):
    """Calls per sample so that one sample lasts at least min_s."""
    n = 1
    while True:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        if time.perf_counter() - t0 >= min_s or n >= 1 << 16:
            return n
        n *= 2


def interleaved_medians(fns, device, repeats, min_s):
    """Median per-call seconds of each function, samples taken round-robin."""
    for fn in fns.values():  # warm-up (allocator, caches, lazy init)
        fn()
    counts = {k: calibrate(fn, device, min_s) for k, fn in fns.items()}
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(counts[k]):
                fn()
            sync(device)
            samples[k].append((time.perf_counter() - t0) / counts[k])
    return {k: statistics.median(v) for k, v in samples.items()}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- cases

def segment_cases(device, dtype):
    gen = torch.Generator().manual_seed(0)
    sizes = [(100_000, 10, 20, False), (1_000_000, 16, 100, False), (1_000_000, 16, 100, True),
             (16_000_000, 1, 1000, True), (4_000_000, 8, 1000, False)]
    if device.type == "cuda":  # a GPU's L2 (50-60 MB on Hopper) holds the CPU cases: add ones far beyond it
        sizes += [(16_000_000, 16, 1000, False), (16_000_000, 16, 1000, True), (64_000_000, 1, 1000, True)]
    for p, c, s, inplace in sizes:
        weights = torch.rand(s, generator=gen, dtype=torch.float64) ** 3  # ragged, like layers of a model
        lengths = (weights / weights.sum() * p).long()
        lengths[-1] += p - int(lengths.sum())
        off = ops.segment_offsets(lengths.tolist())
        a = torch.rand((c, p), generator=gen, dtype=dtype).to(device)
        b = torch.rand(p, generator=gen, dtype=dtype).to(device)
        lam = torch.rand((c, s), generator=gen, dtype=dtype).to(device)
        out = a if inplace else torch.empty_like(a)
        moved = nbytes(a, b, lam) + nbytes(out)   # read a, b, lam; write out
        dev_off = off.to(device)
        # torch's own one-pass kernel over the same bytes (a + w b, b broadcast, into out): not
        # the same op (one coefficient), but what any single pass over these tensors costs
        one_pass = (lambda: a.add_(b, alpha=0.5)) if inplace else (lambda: torch.add(a, b, alpha=0.5, out=out))
        yield (f"segment_mix C={c} P={p/1e6:g}M S={s}{' in place' if inplace else ''}",
               lambda: ops.segment_mix(a, b, off, lam, out=out),
               lambda: reference.segment_mix(a, b, dev_off, lam, out=out),
               moved, nbytes(out), one_pass)


def fedmix_cases(device, dtype):
    gen = torch.Generator().manual_seed(1)
    for batch in (10, 64) + ((4096,) if device.type == "cuda" else ()):
        shape = (batch, 3, 32, 32)
        g = (torch.rand(shape, generator=gen, dtype=dtype) - 0.5).to(device)
        xbar = torch.rand((1,) + shape[1:], generator=gen, dtype=dtype).to(device)
        y = torch.nn.functional.one_hot(torch.randint(10, (batch,), generator=gen), 10).to(device, dtype)
        ybar = torch.softmax(torch.randn(1, 10, generator=gen, dtype=dtype), -1).to(device)
        go = torch.rand(batch, generator=gen, dtype=dtype).to(device)
        gl = g.clone().requires_grad_(True)
        lam = 0.05
        yield (f"fedmix_l3 fwd B={batch}", lambda: ops.fedmix_l3(g, xbar, lam),
               lambda: reference.fedmix_l3(g, xbar, lam), nbytes(g, xbar, go), nbytes(g), None)

        def l3_both(fn):
            def run():
                s = fn(gl, xbar, lam)
                torch.autograd.grad(s, gl, go)
            return run
        # forward (read g, xbar) + backward (read go, xbar; write grad_g)
        yield (f"fedmix_l3 fwd+bwd B={batch}", l3_both(ops.fedmix_l3), l3_both(reference.fedmix_l3),
               2 * nbytes(g, xbar) + nbytes(go), nbytes(g), None)
        yield (f"mix_inputs_labels fwd B={batch}", lambda: ops.mix_inputs_labels(g, y, ybar, lam),
               lambda: reference.mix_inputs_labels(g, y, ybar, lam), 2 * nbytes(g, y) + nbytes(ybar), nbytes(g), None)
        probe = torch.rand(shape, generator=gen, dtype=dtype).to(device)

        def mix_both(fn):
            def run():
                xm, _ = fn(gl, y, ybar, lam)
                torch.autograd.grad(xm, gl, probe)
            return run
        yield (f"mix_inputs_labels fwd+bwd B={batch}", mix_both(ops.mix_inputs_labels),
               mix_both(reference.mix_inputs_labels), 4 * nbytes(g) + 2 * nbytes(y) + nbytes(ybar), nbytes(g), None)


def fedmix_step_case(device, model_name, batch):
    from fedhpc.algorithms.mafl.mixing import fedmix_loss, one_hot
    from fedhpc.models import build_model

    shapes = {"vgg_fedmix": ((3, 32, 32), 10), "cnn": ((1, 8, 8), 10), "lenet5": ((1, 28, 28), 62)}
    shape, classes = shapes[model_name]
    torch.manual_seed(0)
    model = build_model(model_name, shape, classes).to(device)
    gen = torch.Generator().manual_seed(2)
    x = torch.rand((batch,) + shape, generator=gen).to(device)
    y = one_hot(torch.randint(classes, (batch,), generator=gen), classes).to(device)
    xbar = torch.rand((1,) + shape, generator=gen).to(device)
    ybar = torch.softmax(torch.randn(1, classes, generator=gen), -1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(backend):
        def run():
            with ops.prefer(backend):
                opt.zero_grad(set_to_none=True)
                fedmix_loss(model, x, y, xbar, ybar, 0.05).backward()
                opt.step()
        return run
    return step("native"), step("torch")


# --------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--min-ms", type=float, default=20.0, help="shortest timed sample")
    ap.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--fedmix-step", action="store_true", help="also time FedMix SGD steps native vs torch")
    ap.add_argument("--glibc-default-malloc", action="store_true",
                    help="leave glibc's trim / mmap thresholds self-adjusting (see the docstring)")
    args = ap.parse_args()
    fixed_malloc = False if args.glibc_default_malloc else fix_malloc_thresholds()
    dtype = getattr(torch, args.dtype)
    nat = ops.native()
    if nat.module is None:
        sys.exit("no native extension here (" + "; ".join(n for n in nat.notes if n) + "): nothing to compare")
    devices = [d for d in (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
               if args.device in (d, "all")]
    print(f"torch {torch.__version__}, extension {nat.origin} (cuda kernels: {nat.with_cuda}), {args.dtype}, "
          f"median of {args.repeats} samples >= {args.min_ms:g} ms each, interleaved, "
          f"glibc malloc thresholds {'fixed' if fixed_malloc else 'self-adjusting'}\n")
    print("| device | threads | case | native ms | torch ms | torch/native | native GB/s | copy GB/s | native/copy "
          "| one-pass/native |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for dev_name in devices:
        device = torch.device(dev_name)
        if device.type == "cuda" and not nat.with_cuda:
            print(f"| cuda | - | (extension built without CUDA kernels: skipped) | | | | | | |")
            continue
        for threads in (args.threads if device.type == "cpu" else [torch.get_num_threads()]):
            torch.set_num_threads(threads)
            # lazily: each case's closures use the tensors of that case only
            cases = itertools.chain(segment_cases(device, dtype), fedmix_cases(device, dtype))
            for name, native_fn, torch_fn, moved, copy_bytes, one_pass in cases:
                if args.only and args.only not in name:
                    continue
                src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
                dst = torch.empty_like(src)
                fns = {"native": native_fn, "torch": torch_fn, "copy": lambda: dst.copy_(src)}
                if one_pass is not None:
                    fns["one_pass"] = one_pass
                t = interleaved_medians(fns, device, args.repeats, args.min_ms / 1e3)
                bound = f"{t['one_pass'] / t['native']:.2f}" if one_pass is not None else ""
                gbs, copy_gbs = moved / t["native"] / 1e9, 2 * copy_bytes / t["copy"] / 1e9
                print(f"| {dev_name} | {threads if device.type == 'cpu' else '-'} | {name} | {1e3 * t['native']:.3f} | "
                      f"{1e3 * t['torch']:.3f} | {t['torch'] / t['native']:.2f} | {gbs:.1f} | {copy_gbs:.1f} | "
                      f"{gbs / copy_gbs:.2f} | {bound} |", flush=True)
            if args.fedmix_step:
                for model_name, batch in (("cnn", 10), ("vgg_fedmix", 10), ("vgg_fedmix", 64)):
                    native_step, torch_step = fedmix_step_case(device, model_name, batch)
                    t = interleaved_medians({"native": native_step, "torch": torch_step}, device,
                                            args.repeats, args.min_ms / 1e3)
                    print(f"| {dev_name} | {threads if device.type == 'cpu' else '-'} | FedMix SGD step {model_name} "
                          f"B={batch} | {1e3 * t['native']:.3f} | {1e3 * t['torch']:.3f} | "
                          f"{t['torch'] / t['native']:.2f} | | | | |", flush=True)


if __name__ == "__main__":
    main()
