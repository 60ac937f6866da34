"""PNG plots of a report: accuracy against rounds, communicated bytes and time (matplotlib, Agg);
the clients' own models against rounds, and the reference device's against time (Mix2FLD's Fig. 2).

One line per group: the mean over its seeds at the rounds every seed evaluated, with a band of
+- one standard deviation where there are several seeds. The x axis of the byte and time plots
is the mean over seeds too (with partial participation they differ slightly per seed).
Time is the simulated clock (sim_seconds_total, channel models) where every run has one,
otherwise wall-clock seconds estimated from round_seconds: metrics.jsonl holds only evaluated
rounds, so each logged round_seconds stands for the rounds since the previous evaluation.
In the clients' plot, rounds that evaluated a seeded sample of them (--local-eval-clients) are
hollow markers: estimates, noisier than the rounds covering every client.
A record whose round, plotted metric or x-axis field holds something other than a finite number
(a hand edit, another tool's file) is left out of that plot, and the report names the run and field.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ..io import atomic_write_bytes
from .runs import Group
from .summary import _numeric, _readable_round, is_sampled

XAxis = Callable[[List[dict]], List[float]]
#: (run path, field, the value as JSON, record index): a record left out of a plot
LeftOut = Set[Tuple[str, str, str, int]]


def _rounds(records: List[dict]) -> List[float]:
    return [float(r["round"]) for r in records]


def _mib(records: List[dict]) -> List[float]:
    return [(float(r.get("bytes_up_total", 0)) + float(r.get("bytes_down_total", 0))) / 2**20 for r in records]


def _sim_seconds(records: List[dict]) -> List[float]:
    return [float(r["sim_seconds_total"]) for r in records]


def _wall_seconds(records: List[dict]) -> List[float]:
    out, total, prev = [], 0.0, 0
    for r in records:
        total += float(r.get("round_seconds", 0.0)) * (int(r["round"]) - prev)
        prev = int(r["round"])
        out.append(total)
    return out


# The fields each x axis reads besides "round"; the optional ones count as 0 when absent.
_X_FIELDS = {_mib: ("bytes_up_total", "bytes_down_total"), _sim_seconds: ("sim_seconds_total",),
             _wall_seconds: ("round_seconds",)}


def _usable(field: str, value: Any) -> bool:
    return _readable_round(value) if field == "round" else _numeric(value)


def curve(group: Group, metric: str, x: XAxis, left_out: Optional[LeftOut] = None
          ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(x mean, metric mean, metric std) over the group's runs at the rounds all of them evaluated.

    Records lacking the metric are not plotted; those whose round, metric or x field holds something
    other than a finite number are left out too, and added to ``left_out`` when it is given."""
    per_run = []
    for r in group.runs:
        recs = []
        for i, rec in enumerate(r.records):
            bad = [k for k in ("round", metric) + _X_FIELDS.get(x, ()) if k in rec and not _usable(k, rec[k])]
            if bad and left_out is not None:
                left_out.update((r.path, k, json.dumps(rec[k], default=str), i) for k in bad)
            if not bad and metric in rec:
                recs.append(rec)
        per_run.append({int(rec["round"]): (xv, float(rec[metric])) for rec, xv in zip(recs, x(recs))})
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    if not common:
        return None
    xs = np.array([[d[t][0] for t in common] for d in per_run])
    ys = np.array([[d[t][1] for t in common] for d in per_run])
    std = ys.std(axis=0, ddof=1) if len(per_run) > 1 else np.zeros(len(common))
    return xs.mean(axis=0), ys.mean(axis=0), std


def sampled_rounds(group: Group, metric: str) -> List[float]:
    """Rounds at which some run of the group logged ``metric`` over a sample of the clients
    (--local-eval-clients): an unbiased but noisier estimate than the rounds covering every client."""
    return sorted({float(rec["round"]) for r in group.runs for rec in r.records
                   if is_sampled(metric, rec) and _readable_round(rec.get("round"))})


def _save(fig, path: str) -> None:
    atomic_write_bytes(path, lambda f: fig.savefig(f, format="png"))


def left_out_rows(left_out: LeftOut) -> List[Dict[str, Any]]:
    """One row per run and field left out of the plots: what it held (three values at most) and in
    how many records."""
    rows: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for path, field, value, _ in sorted(left_out):
        row = rows.setdefault((path, field), {"path": path, "field": field, "holds": [], "records": 0})
        if value not in row["holds"]:
            row["holds"].append(value)
        row["records"] += 1
    for row in rows.values():
        more = len(row["holds"]) - 3
        row["holds"] = ", ".join(row["holds"][:3]) + (f" and {more} more" if more > 0 else "")
    return list(rows.values())


def plot_groups(groups: List[Group], labels: List[str], out_dir: str,
                left_out: Optional[LeftOut] = None) -> Dict[str, str]:
    """Write the plots into ``out_dir``; returns {name: file name}. Empty if matplotlib is missing.
    Records left out of a plot (see :func:`curve`) are added to ``left_out`` when it is given."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed, so the report has no plots (pip install matplotlib)")
        return {}
    has = lambda key: all(key in rec for g in groups for r in g.runs for rec in r.records)  # noqa: E731
    time_axis, time_label = ((_sim_seconds, "simulated time (s)") if has("sim_seconds_total")
                             else (_wall_seconds, "wall-clock time (s, from round_seconds)"))
    plots = [("accuracy_vs_round", "test_accuracy", _rounds, "round"),
             ("accuracy_vs_bytes", "test_accuracy", _mib, "communicated MiB (up + down, cumulative)"),
             ("accuracy_vs_time", "test_accuracy", time_axis, time_label)]
    if any("local_test_accuracy" in rec for g in groups for r in g.runs for rec in r.records):
        plots.append(("personalized_accuracy_vs_round", "local_test_accuracy", _rounds, "round"))
    if any("reference_device_accuracy" in rec for g in groups for r in g.runs for rec in r.records):
        # Mix2FLD's Fig. 2: one device's own model against the (simulated) clock; FD has no other
        plots.append(("reference_device_accuracy_vs_time", "reference_device_accuracy", time_axis, time_label))
    written = {}
    for name, metric, x, xlabel in plots:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        drawn = sampled = False
        for g, label in zip(groups, labels):
            c = curve(g, metric, x, left_out)
            if c is None:
                continue
            xs, mean, std = c
            line, = ax.plot(xs, 100 * mean, marker="o", markersize=3, label=f"{label} (n={len(g.runs)})")
            if len(g.runs) > 1:
                ax.fill_between(xs, 100 * (mean - std), 100 * (mean + std), color=line.get_color(), alpha=0.2)
            if x is _rounds:
                hollow = np.isin(xs, sampled_rounds(g, metric))
                if hollow.any():
                    ax.plot(xs[hollow], 100 * mean[hollow], linestyle="none", marker="o", markersize=5,
                            markerfacecolor="white", color=line.get_color())
                    sampled = True
            drawn = True
        if drawn:
            if sampled:
                ax.set_title("hollow: a seeded sample of the clients (--local-eval-clients)", fontsize=8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{metric.replace('_', ' ')} (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            _save(fig, os.path.join(out_dir, name + ".png"))
            written[name] = name + ".png"
        plt.close(fig)
    return written
