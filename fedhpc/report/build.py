"""Assemble a report: find runs, group them, summarise, plot, write report.md / report.html / summary.json."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ConfigError
from ..io import atomic_write_json, atomic_write_text, probe_write
from .plots import LeftOut, left_out_rows, plot_groups
from .render import Document, fmt_stat, fmt_value, unit_of
from .runs import Group, Run, _warn, find_runs, group_runs, shown_settings
from .summary import (best_stats, can_be_reached, final_stats, metric_names, no_final_value, reference_comparison,
                      time_to_target)


def _label(group: Group, keys: List[str]) -> str:
    """``algo=fedprox, algo_options.mu=0.01``: the row's value of each of ``keys`` it has (an option
    at its default included: :meth:`Group.display`)."""
    shown = group.display
    return ", ".join(f"{k}={shown[k]}" for k in keys if k in shown) or "all runs"


def _default_title(roots: List[str]) -> str:
    """The roots, each once (a folder given twice, with or without a trailing slash, is one), and at
    most three named: a sweep of many roots would otherwise make a title of a paragraph."""
    seen, unique = set(), []
    for root in roots:
        if os.path.normpath(root) not in seen:
            seen.add(os.path.normpath(root))
            unique.append(root)
    more = f" and {len(unique) - 3} more" if len(unique) > 3 else ""
    return f"fedhpc report: {', '.join(unique[:3])}{more}"


def _check_out_dir(out_dir: str) -> None:
    """Make sure the report can be written to ``out_dir`` before reading any run: create it and
    write (then remove) a probe file, which catches a file in the way, a read-only folder or file
    system and a missing permission alike (os.access says yes to root on a read-only mount)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe_write(out_dir)
    except OSError as e:
        why = "it is a file" if os.path.isfile(out_dir) else (e.strerror or str(e))
        raise ConfigError(f"cannot write the report to {out_dir}: {why}; pass --out a folder you can write "
                          f"to (it is created if missing)")


def build_report(roots: List[str], out_dir: str, target: Optional[float] = None,
                 title: Optional[str] = None, target_metric: str = "test_accuracy") -> Dict[str, Any]:
    """Write the report of the runs under ``roots`` into ``out_dir``; returns summary.json's content.
    ``target``: also the round at which ``target_metric`` first reaches it."""
    for root in roots:
        if not os.path.isdir(root):
            raise ConfigError(f"{root} is not a folder; pass folders holding runs (each with config.yaml "
                              f"and metrics.jsonl), e.g. a sweep's folder")
    _check_out_dir(out_dir)
    skipped: List[Dict[str, Any]] = []
    runs, not_started = find_runs(roots, skipped)
    if not runs and not not_started:
        extra = f" ({len(skipped)} skipped as unreadable, named above)" if skipped else ""
        raise ConfigError(f"no runs under {', '.join(roots)}{extra}: a run folder holds config.yaml and metrics.jsonl "
                          f"(python -m fedhpc.launch --out DIR writes them)")
    duplicates: List[Tuple[Run, Run]] = []
    groups = group_runs(runs, duplicates)
    varying = shown_settings(groups)
    # The table always names the algorithm and dataset; plot legends only what tells rows apart.
    keys = ["algo", "dataset"] + [k for k in varying if k not in ("algo", "dataset")]
    labels = [_label(g, varying or ["algo"]) for g in groups]
    names = metric_names(groups)
    if target is not None and target_metric not in names:
        accuracies = ", ".join(m for m in names if can_be_reached(m)) or "none"
        raise ConfigError(f"--target-metric {target_metric}: no run here logs it; accuracies they log: {accuracies}")

    summaries = []
    for i, (g, label) in enumerate(zip(groups, labels), 1):
        finals, bests = final_stats(g, names), best_stats(g, names)
        summaries.append({
            "row": i, "label": label, "settings": g.settings, "n": len(g.runs),
            "seeds": [r.seed for r in g.runs], "runs": [r.path for r in g.runs],
            "final": {m: s.as_dict() for m, s in finals.items()},
            "best": {m: s.as_dict() for m, s in bests.items()},
            "target": None, "reference": g.reference or None,
            "comparison": reference_comparison(g, finals, bests),
            "no_final_value": no_final_value(g, names),
            "code_versions": g.code_versions() or None,
            "shown": {k: g.display.get(k) for k in keys if k in g.display},
            "_finals": finals, "_bests": bests,
        })
        if g.code_versions():
            _warn(f"row #{i} ({label}) averages runs of different fedhpc code: " + "; ".join(
                f"{path} ran {' then '.join(v)}" for path, v in g.code_versions().items()))
        if target is not None:
            summaries[-1]["target"] = time_to_target(g, target, target_metric)

    doc = Document(title or _default_title(roots))
    n_fin = sum(len(g.runs) for g in groups)
    excluded = [r for r in runs if r.state.status != "finished" or r.config is None]
    repeated = [{"path": r.path, "status": f"duplicate of {kept.path} (same settings, seed and metrics)"}
                for r, kept in duplicates]
    doc.para(f"{len(runs)} run(s) found, {n_fin} finished in {len(groups)} group(s) (runs that differ only "
             f"in their seed); {len(excluded) + len(not_started) + len(repeated)} not averaged in, "
             f"{len(skipped)} skipped as unreadable (listed at the end). "
             f"Mean ± sample standard deviation over seeds; accuracies in %, bytes in MiB.")
    left_out_of_plots: List[Dict[str, Any]] = []
    if groups:
        doc.heading("Results")
        doc.table(_main_table(summaries, keys, names, target, target_metric))
        refs = [f"#{s['row']}: {s['comparison']['source']} ({s['comparison']['stat']} {s['comparison']['metric']}"
                f"{' in %' if s['comparison']['unit'] == '%' else ''})" for s in summaries if s["comparison"]]
        if refs:
            doc.para("Paper numbers:")
            doc.items(refs)
        mixed = [s for s in summaries if s["code_versions"]]
        if mixed:
            doc.para("Warning: these rows average runs of different fedhpc code (version, git commit, or a "
                     "dirty tree and its changes, from each run's run.json), so their spread may be the code's:")
            doc.table([["row", "run", "code"]] + [[f"#{s['row']}", path, " then ".join(v)]
                                                  for s in mixed for path, v in s["code_versions"].items()])
        shared = {k: v for k, v in groups[0].settings.items() if k not in keys
                  and all(json.dumps(g.settings.get(k), default=str) == json.dumps(v, default=str) for g in groups)}
        if shared:
            doc.para("Settings shared by every row: " + ", ".join(f"{k}={v}" for k, v in shared.items()))
        doc.heading("All metrics at the final round")
        doc.table([["metric"] + [f"#{s['row']}" for s in summaries]] +
                  [[m + unit_of(m)] + [_over(s["_finals"].get(m), m, s) for s in summaries] for m in names])
        left_out: LeftOut = set()
        plots = plot_groups(groups, labels, out_dir, left_out)
        if plots:
            doc.heading("Plots")
            for name, path in plots.items():
                doc.image(path, name.replace("_", " "))
        left_out_of_plots = left_out_rows(left_out)
        if left_out_of_plots:
            doc.para("Records left out of the plots (the field holds something other than a finite number; "
                     "the run's other records are plotted):")
            doc.table([["run", "field", "holds", "records"]] +
                      [[r["path"], r["field"], r["holds"], str(r["records"])] for r in left_out_of_plots])
    unusable = [[f"#{s['row']}", m, path, value] for s in summaries for m, missing in s["no_final_value"].items()
                for path, value in missing]
    if unusable:
        doc.heading("Runs without a usable final value")
        doc.para("Each row's mean of that metric is over its other runs (the cell says over how many).")
        doc.table([["row", "metric", "run", "last record holds"]] + unusable)
    if excluded or not_started or repeated or skipped:
        doc.heading("Not averaged in")
        doc.table([["run", "status"]] + [[r.path, r.state.describe()] for r in excluded] +
                  [[p["path"], p["status"]] for p in not_started + repeated] +
                  [[p["path"], f"skipped: {p['problem']}"] for p in skipped])

    atomic_write_text(os.path.join(out_dir, "report.md"), doc.markdown())
    atomic_write_text(os.path.join(out_dir, "report.html"), doc.html())
    summary = {
        "roots": roots, "groups": [{k: v for k, v in s.items() if not k.startswith("_")} for s in summaries],
        "excluded": [{"path": r.path, "status": r.state.status, "last_round": r.state.last_round,
                      "rounds": r.state.rounds, "exit_code": r.state.exit_code, "problem": r.state.problem}
                     for r in excluded]
                    + not_started + repeated,
        "skipped": skipped,
        "left_out_of_plots": left_out_of_plots,
    }
    for s in summary["groups"]:
        if s["target"]:
            s["target"] = {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in s["target"].items()}
    atomic_write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary


def _over(stat, metric: str, summary: Dict[str, Any]) -> str:
    """A table cell; says over how many runs when some of the row's runs had no usable value of
    the metric (the seeds column counts them all, and the mean must not pass for one over every seed)."""
    cell = fmt_stat(stat, metric)
    have = stat.n if stat is not None else 0
    if metric not in summary["no_final_value"] or have == summary["n"]:
        return cell
    return f"{cell} (over {have} of {summary['n']} runs)"


def _main_table(summaries, keys: List[str], names: List[str], target: Optional[float],
                target_metric: str = "test_accuracy"):
    accs = [m for m in ("test_accuracy", "local_test_accuracy") if m in names]
    header = ["#"] + keys + ["seeds"]
    for m in accs:
        what = "personalized acc" if m == "local_test_accuracy" else "acc"
        header += [f"final {what} (%)", f"best {what} (%)"]
    header.append("MiB up+down")
    sim = "sim_seconds_total" in names
    if sim:
        header.append("sim. time (s)")
    if target is not None:
        header.append(f"round to {100 * target:g}%" + ("" if target_metric == "test_accuracy" else f" {target_metric}"))
    refs = any(s["comparison"] for s in summaries)
    if refs:
        header += ["paper", "ours (paper's metric)"]
    table = [header]
    for s in summaries:
        f, b = s["_finals"], s["_bests"]
        row = [f"{s['row']}"] + [str(s["shown"].get(k, "-")) for k in keys] + [str(s["n"])]
        for m in accs:
            row += [_over(f.get(m), m, s), _over(b.get(m), m, s)]
        up, down = f.get("bytes_up_total"), f.get("bytes_down_total")
        row.append(fmt_value(up.mean + down.mean, "bytes") if up and down else "–")
        if sim:
            row.append(fmt_stat(f.get("sim_seconds_total"), "sim_seconds_total"))
        if target is not None:
            t = s["target"]
            unreadable = f", {len(t['unreadable'])} unreadable" if t["unreadable"] else ""
            row.append("– (not logged)" if not t["logged"] else
                       (fmt_stat(t["round"], "round") if t["round"] else "never") +
                       f" ({t['reached']}/{t['of']}{unreadable})")
        if refs:
            c = s["comparison"]
            if c:
                ours = "–" if c["ours_mean"] is None else (
                    f"{c['ours_mean']:.2f}" + (f" ± {c['ours_std']:.2f}" if c["ours_std"] is not None else ""))
                row += [f"{c['paper_value']}", ours]
            else:
                row += ["", ""]
        table.append(row)
    return table
