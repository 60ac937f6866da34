"""What one round launches and waits for: the plain loop, fedhpc sequential and fedhpc batched under torch.profiler.

Issue 41 asks why fedhpc's sequential round costs 1.5-2x the hand-written loop on an H200 when the two
take the same time on the CPU, and says to find it with the CUDA profiler rather than guess. This
profiles ``--rounds`` in-process rounds of each mode of bench_gpu.py's workloads (the same Engines
and plain loop as ``bench_gpu.py --in-process``, after ``--warmup`` unprofiled rounds) and counts,
per round:

* ``aten ops``: operators dispatched (``aten::`` events, nested ones included): what the host runs;
* ``kernels``: kernel launches (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaLaunchKernelExC``...);
* ``syncs``: host waits on the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``) and blocking copies (``cudaMemcpy`` without Async); an ``aten::item``
  (``_local_scalar_dense``) is one too;
* ``H2D`` / ``D2H``: the device's copies each way (``Memcpy HtoD`` / ``DtoH`` events);
* ``malloc`` / ``free``: ``cudaMalloc`` / ``cudaFree`` (the caching allocator missing; cudaFree syncs);
* ``host ms``: the round's wall time under the profiler; ``device ms``: the kernels' own time;
* ``warnings``: Python warnings a round issues (each counted, the distinct messages printed): an
  operator without a deterministic CUDA kernel warns on every call under the deterministic default
  (``use_deterministic_algorithms(True, warn_only=True)``), a host cost the profiler does not name.

Then, for seq against plain, the operators and kernels seq runs more (or less) of a round, and the
host functions with the largest self time in each mode. Last, ``sync sites``: one more round of each
mode in which every host wait is traced to the line that caused it (the innermost frame of fedhpc's or
the benchmark's code): on CUDA each synchronising operation torch reports under
``torch.cuda.set_sync_debug_mode("warn")`` (``item``, a blocking or pageable copy, ``nonzero``...); on
the CPU, where nothing waits, each ``aten::_local_scalar_dense`` (an ``item``) and ``tolist``, so that the
report can be read (and checked) before a GPU is lent. The CPU cannot tell the items a GPU run makes on device tensors
(waits: a client's loss, a norm) from those on host tensors (none: the round report the engine copies to
the host in one go, whose copy is the one wait there and no item). With ``--trace-dir`` every mode's Chrome
trace is written there (open in chrome://tracing or Perfetto). On ``--device cpu`` the counts of
operators and host time are what it gives (no kernels): there, fedhpc's sequential round
dispatches the plain loop's operators and a few per client.

    python benchmarks/profile_round.py [--device cuda] [--only cnn,lenet5] [--modes plain,seq,batched]
                                       [--rounds 3] [--warmup 3] [--trace-dir DIR] [--json OUT.json]

Nothing here runs in CI; ``benchmarks/gpu/checks.sh profile`` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the workloads, the plain loop, InProcessRounds)

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
        "cudaStreamWaitEvent")


def _self_device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)


def summarise(prof, rounds: int, wall_s: float) -> dict:
    """Per-round counts and times from one profile of ``rounds`` rounds."""
    ops, kernels, host_self = collections.Counter(), collections.Counter(), collections.Counter()
    kernel_us = collections.Counter()
    counts = collections.Counter()
    for e in prof.key_averages():
        name, n = e.key, e.count
        if name.startswith("aten::"):
            ops[name] += n
            host_self[name] += e.self_cpu_time_total
        if name in LAUNCH:
            counts["kernels"] += n
        elif name in SYNC:
            counts["syncs"] += n
        elif name == "cudaMalloc":
            counts["malloc"] += n
        elif name == "cudaFree":
            counts["free"] += n
        elif name.startswith("Memcpy HtoD"):
            counts["h2d"] += n
        elif name.startswith("Memcpy DtoH"):
            counts["d2h"] += n
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA") and _self_device_us(e):
            kernels[name] += n
            kernel_us[name] += _self_device_us(e)
        elif not name.startswith("aten::") and not name.startswith("cuda") and e.self_cpu_time_total > 0:
            host_self[name] += e.self_cpu_time_total
    counts["items"] = ops.get("aten::_local_scalar_dense", 0)
    per = lambda c: {k: v / rounds for k, v in c.items()}  # noqa: E731
    return {"host_ms": 1e3 * wall_s / rounds, "device_ms": sum(kernel_us.values()) / 1e3 / rounds,
            "aten_ops": sum(ops.values()) / rounds, **per(counts), "ops": per(ops), "kernels_by_name": per(kernels),
            "kernel_ms_by_name": {k: v / 1e3 / rounds for k, v in kernel_us.items()},
            "host_self_ms": {k: v / 1e3 / rounds for k, v in host_self.most_common(15)}}


def profile_mode(rounds_obj, mode: str, first: int, n: int, device: str, trace_dir: str, tag: str) -> dict:
    import time

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rounds_obj.sync()
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")  # every call counted, not the first of each place
        t0 = time.perf_counter()
        for t in range(first, first + n):
            rounds_obj.run(mode, t)
        rounds_obj.sync()
        wall = time.perf_counter() - t0
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"{tag}_{mode}.json"))
    res = summarise(prof, n, wall)
    res["warnings"] = len(caught) / n
    res["warning_messages"] = dict(collections.Counter(str(w.message)[:160] for w in caught).most_common(5))
    return res


def _call_site(frames) -> str:
    """The innermost frame of fedhpc's or the benchmarks' own code (this file's apart) in ``frames``."""
    ours = [f for f in frames if ("/fedhpc/" in f.filename or "/benchmarks/" in f.filename)
            and not f.filename.endswith("profile_round.py")]
    if not ours:
        return "(outside fedhpc and the benchmarks)"
    f = ours[-1]
    return f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"


def sync_sites(rounds_obj, mode: str, t: int, device: str) -> collections.Counter:
    """Round ``t`` of ``mode`` with every host wait counted by the line that caused it (see the module's
    docstring): on CUDA the synchronising operations ``set_sync_debug_mode("warn")`` reports, on the CPU
    each ``_local_scalar_dense`` (an ``item``) and ``tolist``."""
    import traceback

    sites = collections.Counter()
    rounds_obj.sync()
    if device == "cuda":
        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[_call_site(traceback.extract_stack()[:-1])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show  # restored by catch_warnings
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rounds_obj.run(mode, t)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    else:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Items(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket is torch.ops.aten._local_scalar_dense:
                    sites[_call_site(traceback.extract_stack()[:-1])] += 1
                return func(*args, **(kwargs or {}))

        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):  # a copy to the host too (no operator on the CPU)
            sites[_call_site(traceback.extract_stack()[:-1])] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        try:
            with Items():
                rounds_obj.run(mode, t)
        finally:
            torch.Tensor.tolist = tolist
    rounds_obj.sync()
    return sites


def diff_lines(a: dict, b: dict, label_a: str, label_b: str, top: int = 12) -> list:
    keys = set(a) | set(b)
    rows = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in keys), key=lambda r: -abs(r[0]))
    return [f"    {k}: {label_a} {a.get(k, 0):.1f}, {label_b} {b.get(k, 0):.1f} ({d:+.1f})" for d, k in rows[:top] if d]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--only", default="cnn,lenet5", help="comma-separated workloads of bench_gpu.py")
    ap.add_argument("--modes", type=bench_gpu.parse_modes, default=["plain", "seq", "batched"])
    ap.add_argument("--rounds", type=int, default=3, help="profiled rounds of each mode")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled rounds of each mode first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trace-dir", default="", help="write each mode's Chrome trace here")
    ap.add_argument("--json", default="", help="also write the summaries here")
    ap.add_argument("--no-sync-sites", action="store_true", help="skip the last round of each mode that traces "
                    "every host wait to its line")
    args = ap.parse_args()
    unknown = [n for n in args.only.split(",") if n not in bench_gpu.WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}: choose from {', '.join(bench_gpu.WORKLOADS)}")
    bad = [m for m in args.modes if m not in ("plain", "seq", "batched")]
    if bad:
        ap.error(f"profile_round.py runs plain, seq and batched, not {bad}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_round.py --device cuda needs a CUDA GPU (or --device cpu)")
    print(f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}, torch {torch.__version__}; "
          f"{args.rounds} profiled round(s) per mode after {args.warmup} warm-up round(s)", flush=True)
    args.rounds_total = args.warmup + args.rounds + (0 if args.no_sync_sites else 1)
    out = {}
    cols = ("host_ms", "device_ms", "aten_ops", "kernels", "syncs", "items", "h2d", "d2h", "malloc", "free", "warnings")
    print("\n| workload | mode | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for name in args.only.split(","):
        # InProcessRounds reads args.rounds as the runs' --rounds: give it every round this runs
        build_args = argparse.Namespace(device=args.device, threads=args.threads, rounds=args.rounds_total)
        rounds_obj = bench_gpu.InProcessRounds(name, args.modes, build_args)
        for mode in rounds_obj.order:
            for t in range(args.warmup):
                rounds_obj.run(mode, t)
        res = {m: profile_mode(rounds_obj, m, args.warmup, args.rounds, args.device, args.trace_dir, name)
               for m in rounds_obj.order}
        out[name] = res
        for m, r in res.items():
            print(f"| {name} | {m} | " + " | ".join(f"{r.get(c, 0):.1f}" for c in cols) + " |", flush=True)
        for m, ref in (("seq", "plain"), ("batched", "seq")):
            if m in res and ref in res:
                print(f"  {name}: {m} vs {ref}, operators a round:")
                print("\n".join(diff_lines(res[m]["ops"], res[ref]["ops"], m, ref)) or "    (the same)")
                if args.device == "cuda":
                    print(f"  {name}: {m} vs {ref}, kernels a round:")
                    print("\n".join(diff_lines(res[m]["kernels_by_name"], res[ref]["kernels_by_name"], m, ref))
                          or "    (the same)")
        for m, r in res.items():
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["host_self_ms"].items())[:8])
            print(f"  {name} {m}: largest host self times (ms a round): {top}")
            for message, count in r["warning_messages"].items():
                print(f"  {name} {m}: warned {count / args.rounds:.0f} times a round: {message}")
        if not args.no_sync_sites:
            for m in rounds_obj.order:
                sites = sync_sites(rounds_obj, m, args.warmup + args.rounds, args.device)
                res[m]["sync_sites"] = dict(sites.most_common())
                print(f"  {name} {m}: host waits of one round by the line that caused them "
                      f"({sum(sites.values())}{'' if args.device == 'cuda' else ' items and tolists: waits on a GPU if of device tensors'}): "
                      + (", ".join(f"{site} x{n}" for site, n in sites.most_common(12)) or "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
