"""``python -m fedhpc.ops [--json]``: which backend each native op uses here, and why.

Exit status 0 whatever the answer: the pure-PyTorch fallback is a supported configuration.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import _sources, backends, native


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedhpc.ops", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    nat = native()
    table = backends()
    cuda_reason = ("" if nat.module is None or nat.with_cuda
                   else "the extension was built without CUDA" + ("" if torch.cuda.is_available()
                                                                  else " (this torch has no usable CUDA)"))
    report = {
        "extension": nat.origin, "path": nat.path, "with_cuda": nat.with_cuda,
        "resolve_seconds": round(nat.seconds, 3), "notes": [n for n in nat.notes if n],
        "cuda_note": cuda_reason, "torch": torch.__version__, "sources": _sources.CSRC, "ops": table,
        "native_dtypes": ["float32", "float64"],
        # which vector path each CPU kernel takes on this processor (FEDHPC_NO_SIMD=1: the baseline)
        "cpu_isa": dict(nat.module.cpu_isa()) if nat.module is not None else {},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"fedhpc.ops: extension {nat.origin}" + (f" ({nat.path})" if nat.path else "") +
          f", found in {nat.seconds:.2f} s, torch {torch.__version__}")
    for note in report["notes"]:
        print(f"  note: {note}")
    if cuda_reason:
        print(f"  cuda: {cuda_reason}")
    print(f"{'op':<20} {'cpu':<20} {'cuda':<20}")
    for op, where in table.items():
        print(f"{op:<20} {where['cpu']:<20} {where['cuda']:<20}")
    if report["cpu_isa"]:
        print("cpu vector paths: " + ", ".join(f"{op} {isa}" for op, isa in sorted(report["cpu_isa"].items())) +
              (f" ({_sources.ENV_NO_SIMD} is set)" if _sources.env_flag(_sources.ENV_NO_SIMD) else ""))
    print("native kernels cover float32/float64; other dtypes run the pure-PyTorch reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
