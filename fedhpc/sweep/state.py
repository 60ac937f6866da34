"""Where a run stands, read from its --out folder alone (so a re-submitted sweep and the report agree).

finished     final_model.pt exists and metrics.jsonl's last round equals the configured rounds,
             or is the round where --stop-epsilon ended the run (its record says "converged")
failed       not finished, and the last attempt exited with an error (status.json, written by
             the sweep's runners: slurm/step.sh and the local runner)
interrupted  not finished, and started (metrics, a checkpoint, or an attempt that was stopped
             by a signal / pre-empted): the next attempt resumes it
conflict     metrics.jsonl runs past the configured rounds (the grid lowered ``rounds`` after the
             run): neither resumable nor comparable; delete the folder or restore ``rounds``
damaged      config.yaml cannot be read or its ``rounds`` is not an integer, or metrics.jsonl's last
             record has no integer ``round`` (a hand edit, another tool's file): the state cannot be
             told; ``problem`` names the file and the fix (repair it, or delete the folder to re-run)
not started  nothing there yet
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import yaml

from ..errors import CheckpointError
from ..io import atomic_write_json

STATUS_FILE = "status.json"
# Exit codes that mean "stopped, run again": 75 = checkpointed after SIGTERM/SIGUSR1 (engine),
# 130 / 143 = killed by SIGINT / SIGTERM before it could checkpoint (negative: Popen's form).
INTERRUPTED_CODES = (75, 130, 143, -2, -15)


@dataclass
class RunState:
    status: str
    last_round: int = 0
    rounds: Optional[int] = None
    exit_code: Optional[int] = None
    #: what is wrong with a "damaged" run's files, and the fix
    problem: Optional[str] = None

    def describe(self) -> str:
        where = f"round {self.last_round}/{self.rounds if self.rounds is not None else '?'}"
        if self.status == "failed":
            return f"failed (exit {self.exit_code}, {where})"
        if self.status == "damaged":
            return f"damaged ({self.problem})"
        if self.status in ("interrupted", "finished", "conflict"):
            return f"{self.status} ({where})"
        return self.status


def read_metrics(run_dir: str) -> List[Dict[str, Any]]:
    """metrics.jsonl's records in order; a torn last line (a crash mid-write) is skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "round" in rec:
                    records.append(rec)
    return records


def read_config(run_dir: str) -> Optional[Dict[str, Any]]:
    """config.yaml as a mapping; None when there is none. A torn or hand-broken file raises
    CheckpointError naming it (callers over many runs, the report, skip that run and say so)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        problem = " ".join(str(e).split())  # yaml's messages span lines
        raise CheckpointError(f"{path} cannot be read as YAML ({problem}); the engine writes it at the start "
                              f"of a run: restore it from the run's launch config, or delete the run folder")
    return data if isinstance(data, dict) else None


def read_exit_code(run_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            return int(json.load(f)["exit_code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_status(run_dir: str, exit_code: int, where: str) -> None:
    """Record how an attempt ended (the runners call this; the engine does not need to)."""
    atomic_write_json(os.path.join(run_dir, STATUS_FILE),
                      {"exit_code": int(exit_code), "where": where, "ended": time.time()})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run_state(run_dir: str, rounds: Optional[int] = None,
              records: Optional[List[Dict[str, Any]]] = None) -> RunState:
    """The state of the run in ``run_dir``; ``rounds`` defaults to its config.yaml's.

    Never raises for the run's own files: one damaged run must not stop a status or a report
    over many, so it is returned as "damaged" with the problem and the fix."""
    code = read_exit_code(run_dir)
    if rounds is None:
        try:
            cfg = read_config(run_dir) or {}
        except CheckpointError as e:
            return RunState("damaged", 0, None, code, str(e))
        rounds = cfg.get("rounds")
    if rounds is not None and not _is_int(rounds):
        # the report passes config.yaml's value; a grid's rounds is validated before it gets here
        return RunState("damaged", 0, None, code,
                        f"{os.path.join(run_dir, 'config.yaml')} says rounds: {rounds!r}, not a whole number; "
                        f"set it to the run's --rounds, or delete {run_dir} to run it again")
    records = read_metrics(run_dir) if records is None else records
    last = records[-1].get("round") if records else 0
    if not _is_int(last):
        return RunState("damaged", 0, rounds, code,
                        f"the last record of {os.path.join(run_dir, 'metrics.jsonl')} has round {last!r}, not a "
                        f"whole number (the engine writes one per record); repair that line, or delete {run_dir} "
                        f"to run it again")
    has_final = os.path.exists(os.path.join(run_dir, "final_model.pt"))
    started = bool(records) or has_final or os.path.exists(os.path.join(run_dir, "checkpoints", "LATEST"))
    if rounds is not None and last > rounds:
        return RunState("conflict", last, rounds, code)
    converged = bool(records) and records[-1].get("converged") is True
    if has_final and rounds is not None and (last == rounds or converged):
        return RunState("finished", last, rounds, code)
    if code is not None and code != 0 and code not in INTERRUPTED_CODES:
        return RunState("failed", last, rounds, code)
    if started or code is not None:
        return RunState("interrupted", last, rounds, code)
    return RunState("not started", 0, rounds, None)
