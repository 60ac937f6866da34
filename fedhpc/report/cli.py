"""``python -m fedhpc.report RUNS_DIR [...]``: a Markdown + HTML report of finished runs, grouped over seeds.

    python -m fedhpc.report runs/sweeps/digits_demo                 # -> runs/sweeps/digits_demo/report/
    python -m fedhpc.report runs/a runs/b --out docs/ab --target 0.9
    python -m fedhpc.report runs/mix2fld --target 0.8 --target-metric reference_device_accuracy

Writes report.md, report.html, summary.json (every number, machine-readable) and PNG plots.
Unfinished and failed runs are listed, never averaged in.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..errors import FedHPCError
from .build import build_report
from .summary import can_be_reached


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedhpc.report", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("roots", nargs="+", metavar="RUNS_DIR", help="folders searched for runs (recursively)")
    p.add_argument("--out", help="where the report goes (default: FIRST_RUNS_DIR/report)")
    p.add_argument("--target", type=float, help="also report the round at which test accuracy first reaches this (0-1)")
    p.add_argument("--target-metric", default="test_accuracy",
                   help="the accuracy --target is of (default test_accuracy; e.g. reference_device_accuracy, "
                        "Mix2FLD's, or local_test_accuracy_mean, the personalised papers')")
    p.add_argument("--title", help="the report's title")
    args = p.parse_args(argv)
    if args.target is not None and not 0 < args.target <= 1:
        p.error(f"--target is an accuracy in (0, 1], got {args.target}")
    if not can_be_reached(args.target_metric):
        p.error(f"--target-metric names an accuracy metrics.jsonl logs (test_accuracy, reference_device_accuracy, "
                f"local_test_accuracy_mean, ...), got {args.target_metric!r}")
    out = args.out or os.path.join(args.roots[0], "report")
    try:
        summary = build_report(args.roots, out, args.target, args.title, args.target_metric)
    except FedHPCError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    skipped = f", {len(summary['skipped'])} skipped as unreadable" if summary["skipped"] else ""
    print(f"report of {len(summary['groups'])} group(s), {len(summary['excluded'])} run(s) not averaged in{skipped}: "
          f"{os.path.join(out, 'report.md')} (and report.html, summary.json, plots)")
    return 0
