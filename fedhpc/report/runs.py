"""Find the runs under some folders and group them by everything but the seed.

A run is a folder holding config.yaml (written by the engine) or status.json (written by the
sweep's runners when an attempt ended before the engine wrote anything). Two finished runs
fall in the same group when their flattened configurations agree on every setting except
RUN_LOCAL: the seed, and the settings that say how or where a run executed, not what it
computed. Unknown settings (added by a later fedhpc) do separate groups: a report that keeps
two settings apart that could have been merged is safer than one that averages different
experiments.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..sweep.state import RunState, read_config, read_metrics, run_state

RUN_LOCAL = ("seed", "out", "resume", "threads", "device", "quiet", "tensorboard", "checkpoint_every",
             "collective_timeout", "client_state_budget_mb", "eval_batch_size", "data_dir", "reference")


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"algo_options": {"lam": 0.1}} -> {"algo_options.lam": 0.1}; an empty mapping disappears."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class Run:
    path: str
    config: Optional[Dict[str, Any]]
    records: List[Dict[str, Any]]
    state: RunState

    @property
    def seed(self) -> Any:
        return (self.config or {}).get("seed")

    @property
    def reference(self) -> Dict[str, Any]:
        ref = (self.config or {}).get("reference")
        return ref if isinstance(ref, dict) else {}

    def settings(self) -> Dict[str, Any]:
        """The flattened configuration that decides the group."""
        return flatten({k: v for k, v in (self.config or {}).items() if k not in RUN_LOCAL})


@dataclass
class Group:
    settings: Dict[str, Any]
    runs: List[Run] = field(default_factory=list)

    @property
    def reference(self) -> Dict[str, Any]:
        """The first run's reference (runs of one group come from one config, so they agree)."""
        return next((r.reference for r in self.runs if r.reference), {})


def _is_run(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.yaml")) or os.path.exists(os.path.join(path, "status.json"))


def find_runs(roots: List[str]) -> Tuple[List[Run], List[Dict[str, Any]]]:
    """Every run under ``roots`` (sorted by path), and the points of sweep manifests with no run yet."""
    runs: List[Run] = []
    not_started: List[Dict[str, Any]] = []
    for root in roots:
        for dirpath, dirnames, _ in os.walk(root):
            dirnames.sort()
            if _is_run(dirpath):
                dirnames[:] = []  # checkpoints/ and tensorboard/ belong to this run
                config = read_config(dirpath)
                records = read_metrics(dirpath)
                runs.append(Run(dirpath, config, records, run_state(dirpath, records=records)))
            manifest = os.path.join(dirpath, "sweep.json")
            if os.path.exists(manifest):
                with open(manifest) as f:
                    sweep = json.load(f)
                for p in sweep.get("points", []):
                    run_dir = os.path.join(dirpath, "runs", p["id"])
                    if not _is_run(run_dir):
                        not_started.append({"path": run_dir, "status": "not started", "id": p["id"]})
    runs.sort(key=lambda r: r.path)
    return runs, not_started


def group_runs(runs: List[Run]) -> List[Group]:
    """Finished runs grouped by their settings minus RUN_LOCAL, in order of first appearance."""
    groups: Dict[str, Group] = {}
    for r in runs:
        if r.state.status != "finished" or r.config is None:
            continue
        s = r.settings()
        key = json.dumps(s, sort_keys=True, default=str)
        groups.setdefault(key, Group(s)).runs.append(r)
    return list(groups.values())


def varying_settings(groups: List[Group]) -> List[str]:
    """The settings that tell the groups apart, in order of first appearance."""
    keys: List[str] = []
    for g in groups:
        for k in g.settings:
            if k not in keys and len({json.dumps(h.settings.get(k), default=str) for h in groups}) > 1:
                keys.append(k)
    return keys
