"""PNG plots of a report: accuracy against rounds, communicated bytes and time (matplotlib, Agg).

One line per group: the mean over its seeds at the rounds every seed evaluated, with a band of
+- one standard deviation where there are several seeds. The x axis of the byte and time plots
is the mean over seeds too (with partial participation they differ slightly per seed).
Time is the simulated clock (sim_seconds_total, channel models) where every run has one,
otherwise wall-clock seconds estimated from round_seconds: metrics.jsonl holds only evaluated
rounds, so each logged round_seconds stands for the rounds since the previous evaluation.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..io import atomic_write_bytes
from .runs import Group
from .summary import _numeric

XAxis = Callable[[List[dict]], List[float]]


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


def curve(group: Group, metric: str, x: XAxis) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(x mean, metric mean, metric std) over the group's runs at the rounds all of them evaluated."""
    per_run = []
    for r in group.runs:
        recs = [rec for rec in r.records if _numeric(rec.get(metric))]  # a NaN would blank the mean
        per_run.append({int(rec["round"]): (xv, float(rec[metric])) for rec, xv in zip(recs, x(recs))})
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    if not common:
        return None
    xs = np.array([[d[t][0] for t in common] for d in per_run])
    ys = np.array([[d[t][1] for t in common] for d in per_run])
    std = ys.std(axis=0, ddof=1) if len(per_run) > 1 else np.zeros(len(common))
    return xs.mean(axis=0), ys.mean(axis=0), std


def _save(fig, path: str) -> None:
    atomic_write_bytes(path, lambda f: fig.savefig(f, format="png"))


def plot_groups(groups: List[Group], labels: List[str], out_dir: str) -> Dict[str, str]:
    """Write the plots into ``out_dir``; returns {name: file name}. Empty if matplotlib is missing."""
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
    written = {}
    for name, metric, x, xlabel in plots:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        drawn = False
        for g, label in zip(groups, labels):
            c = curve(g, metric, x)
            if c is None:
                continue
            xs, mean, std = c
            line, = ax.plot(xs, 100 * mean, marker="o", markersize=3, label=f"{label} (n={len(g.runs)})")
            if len(g.runs) > 1:
                ax.fill_between(xs, 100 * (mean - std), 100 * (mean + std), color=line.get_color(), alpha=0.2)
            drawn = True
        if drawn:
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{metric.replace('_', ' ')} (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            _save(fig, os.path.join(out_dir, name + ".png"))
            written[name] = name + ".png"
        plt.close(fig)
    return written
