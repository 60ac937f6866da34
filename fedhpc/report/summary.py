"""Numbers of a report: per group, each metric's mean and standard deviation over seeds.

Conventions (the papers differ; these are the readings chosen):
  * final = the metric at the run's last evaluated round (= the configured last round);
    best = the highest value over the evaluated rounds (accuracies and the clients' mean
    accuracy only; ``best`` picks a
    round with the test set, as the papers that report it do); the clients' local accuracies
    only over rounds that evaluated every client, not a --local-eval-clients sample (a maximum
    over noisy samples is biased up);
  * std is the sample standard deviation over seeds (ddof = 1); with one seed it is undefined
    and shown as such, never as 0;
  * time to target: the first evaluated round whose test accuracy reaches ``target``, and the
    cumulative bytes and simulated time at that round; averaged over the runs that reach it.
Every numeric field of metrics.jsonl is summarised, whatever family wrote it; KNOWN_METRICS
only decides which come first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # runs.load_runs imports this module: Group is a type hint here only
    from .runs import Group

# Shown first, in this order; everything else numeric follows alphabetically.
KNOWN_METRICS = (
    "test_accuracy", "local_test_accuracy", "cold_start_accuracy", "test_loss", "local_test_loss",
    "train_loss", "bytes_up_total", "bytes_down_total", "sim_seconds_total",
)
# Bookkeeping, not results.
SKIPPED = ("round", "clients", "local_eval_clients")


@dataclass
class Stat:
    values: List[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def std(self) -> Optional[float]:
        return float(np.std(self.values, ddof=1)) if self.n > 1 else None

    def as_dict(self) -> Dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n, "values": list(self.values)}


def is_accuracy(metric: str) -> bool:
    """Accuracies (and their spreads and tails) are shown in percent."""
    return "accuracy" in metric


def can_be_reached(metric: str) -> bool:
    """An accuracy a run can reach (a target's metric): not a spread across clients (``_std``)."""
    return is_accuracy(metric) and not metric.endswith("_std")


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _readable_round(v: Any) -> bool:
    """A record's round as seeds share it: a finite whole number."""
    return _numeric(v) and float(v).is_integer()


def metric_names(groups: List[Group]) -> List[str]:
    names = {k for g in groups for r in g.runs for rec in r.records for k, v in rec.items()
             if _numeric(v) and k not in SKIPPED}
    # A known metric stays even when no run has a usable value of it, so its column reads "–"
    # (and the runs are named) instead of disappearing from the table.
    names |= {k for g in groups for r in g.runs for rec in r.records for k in rec if k in KNOWN_METRICS}
    return [m for m in KNOWN_METRICS if m in names] + sorted(names - set(KNOWN_METRICS))


def final_stats(group: Group, names: List[str]) -> Dict[str, Stat]:
    """Each metric at every run's last record (runs lacking the metric there are left out of it;
    :func:`no_final_value` names them)."""
    out = {}
    for m in names:
        vals = [float(r.records[-1][m]) for r in group.runs if _numeric(r.records[-1].get(m))]
        if vals:
            out[m] = Stat(vals)
    return out


def no_final_value(group: Group, names: List[str]) -> Dict[str, List[Tuple[str, str]]]:
    """Per metric, the runs of ``group`` left out of its final mean: [(run path, what the last record
    holds)]. Those whose last record holds something other than a finite number (NaN, "high"), and
    those lacking it there while another run of the group has a value (a metric no run logs at the
    last round is no run's fault and is not listed). The table says over how many runs the mean is."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for m in names:
        others_have = any(_numeric(r.records[-1].get(m)) for r in group.runs)
        bad = [(r.path, json.dumps(r.records[-1][m], default=str) if m in r.records[-1] else "no value")
               for r in group.runs if not _numeric(r.records[-1].get(m)) and (m in r.records[-1] or others_have)]
        if bad:
            out[m] = bad
    return out


def is_sampled(metric: str, rec: dict) -> bool:
    """Whether ``rec``'s value of ``metric`` is over a seeded sample of the clients (--local-eval-clients):
    an estimate, whose maximum or first crossing of a target is biased by the noise."""
    return metric.startswith("local_test_accuracy") and "local_eval_clients" in rec


def best_stats(group: Group, names: List[str]) -> Dict[str, Stat]:
    out = {}
    for m in names:
        # accuracies and the clients' mean of theirs (pMixFed's metric, whose FedAlt / FedSim rows
        # the paper gives at their best round), not their spreads (local_test_accuracy_std) or tails
        if not m.endswith(("accuracy", "accuracy_mean")):
            continue
        vals = []
        for r in group.runs:
            seen = [float(rec[m]) for rec in r.records if _numeric(rec.get(m)) and not is_sampled(m, rec)]
            if seen:
                vals.append(max(seen))
        if vals:
            out[m] = Stat(vals)
    return out


def time_to_target(group: Group, target: float, metric: str = "test_accuracy") -> Dict[str, Any]:
    """Round, cumulative bytes (up + down) and simulated seconds at which ``metric`` first reaches ``target``.

    A run whose first record at the target has no whole-number round (a hand-edited file) is
    listed under ``unreadable`` and left out of the statistics: taking its next readable record
    instead would report a later round than the run reached it in. Records over a sample of the
    clients do not count (as for ``best``); ``logged`` says whether any run of the group logs the
    metric at all (FD, for one, has no test_accuracy: its target is not "never" reached)."""
    rounds, bytes_, sims, unreadable = [], [], [], []
    for r in group.runs:
        hit = next((rec for rec in r.records if _numeric(rec.get(metric)) and rec[metric] >= target
                    and not is_sampled(metric, rec)), None)
        if hit is None:
            continue
        if not _readable_round(hit.get("round")):
            unreadable.append(r.path)
            continue
        rounds.append(float(hit["round"]))
        traffic = [hit.get(k, 0.0) for k in ("bytes_up_total", "bytes_down_total")]
        if all(_numeric(v) for v in traffic):
            bytes_.append(float(sum(traffic)))
        if _numeric(hit.get("sim_seconds_total")):
            sims.append(float(hit["sim_seconds_total"]))
    logged = any(metric in rec for r in group.runs for rec in r.records)
    return {"metric": metric, "logged": logged, "reached": len(rounds), "of": len(group.runs) - len(unreadable),
            "unreadable": unreadable,
            "round": Stat(rounds) if rounds else None, "bytes": Stat(bytes_) if bytes_ else None,
            "sim_seconds": Stat(sims) if sims else None}


def reference_comparison(group: Group, finals: Dict[str, Stat], bests: Dict[str, Stat]) -> Optional[Dict[str, Any]]:
    """Our number on the reference's metric, in the paper's unit, beside the paper's value.

    Schema of ``reference`` (a RunConfig field, free-form; these keys are read):
      paper, table, row: where the number is printed; value: the number as printed;
      metric: a metrics.jsonl key (default test_accuracy); stat: final | best (default final);
      unit: "%" (the paper prints percent, ours are fractions: multiplied by 100) or "" (same
      unit as metrics.jsonl); default "%" for metrics whose name holds "accuracy".
    """
    ref = group.reference
    if not ref or "value" not in ref:
        return None
    metric = str(ref.get("metric", "test_accuracy"))
    stat = str(ref.get("stat", "final"))
    unit = str(ref.get("unit", "%" if "accuracy" in metric else ""))
    ours = (bests if stat == "best" else finals).get(metric)
    scale = 100.0 if unit == "%" else 1.0
    source = ", ".join(str(ref[k]) for k in ("paper", "table", "row") if ref.get(k))
    out = {"paper_value": ref["value"], "metric": metric, "stat": stat, "unit": unit, "source": source,
           "ours_mean": None, "ours_std": None}
    if ours is not None:
        out["ours_mean"] = ours.mean * scale
        out["ours_std"] = ours.std * scale if ours.std is not None else None
    return out
