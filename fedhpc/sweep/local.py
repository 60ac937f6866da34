"""Run a sweep's points here, one after another, each as ``mpiexec -n R`` (a plain process for R = 1).

Every point is started with --resume: a checkpoint left by an interrupted attempt is continued,
an empty folder starts fresh. A failed point does not stop the sweep (the others still run and
the failure is recorded in its status.json); a signal or Ctrl-C does, and the same command
continues where it stopped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Callable, List, Optional

from ..errors import ConfigError
from ..run_log import duration
from .state import INTERRUPTED_CODES, read_metrics, write_status

# Launcher variables of the sweep's own environment (an salloc shell, an mpiexec): a point run
# here must decide its ranks from its own launcher, not inherit these.
_LAUNCHER_PREFIXES = ("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPIR_", "SLURM_STEP_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "SLURM_PROCID", "SLURM_LOCALID")


def mpiexec_path() -> str:
    """mpiexec next to this Python (the venv's mpich) first, then PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = here if os.path.exists(here) else shutil.which("mpiexec")
    if path is None:
        raise ConfigError("mpiexec is not installed: run with ranks 1 (--ranks 1), or install mpich "
                          "(pip install mpich mpi4py)")
    return path


def launch_command(point_yaml: str, run_dir: str, ranks: int) -> List[str]:
    cmd = [sys.executable, "-m", "fedhpc.launch", "--config", point_yaml, "--out", run_dir, "--resume"]
    return [mpiexec_path(), "-n", str(ranks)] + cmd if ranks > 1 else cmd


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_point(cmd: List[str], run_dir: str, log_path: str, waiting: Optional[Callable[[], None]] = None,
              every: float = 30.0) -> int:
    """Run one point to its end, its output appended to ``log_path``; returns the exit code.
    ``waiting()`` is called every ``every`` seconds while it runs (the sweep's progress line)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        try:
            while True:
                try:
                    code = proc.wait(timeout=every if waiting is not None else None)
                    break
                except subprocess.TimeoutExpired:
                    waiting()
        except KeyboardInterrupt:
            # Ctrl-C reached the child too (same process group): let it finish its exit.
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            os.makedirs(run_dir, exist_ok=True)
            write_status(run_dir, 130 if code in (0, None) else code, "local")
            raise
    os.makedirs(run_dir, exist_ok=True)
    write_status(run_dir, code, "local")
    return code


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path) as f:
            lines = [l.rstrip() for l in f if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _point_progress(run_dir: str, rounds: int, t0: float, say: Callable[[str], None], last: List[int]) -> None:
    """The running point's latest round from its metrics.jsonl (said when it moved since ``last[0]``)."""
    recs = read_metrics(run_dir)
    now = recs[-1].get("round", 0) if recs else 0
    if isinstance(now, int) and now != last[0]:
        last[0] = now
        say(f"      round {now}/{rounds or '?'}, {duration(time.perf_counter() - t0)} on this point")


def run_points(todo, ranks: int, sweep_dir: str, say: Callable[[str], None] = print, every: float = 30.0) -> int:
    """Run ``todo`` (a list of (Point, RunState)) in order. Returns 0, 1 (some failed) or the
    interrupting exit code (the sweep stopped; run it again to continue).

    Says when each point starts and ends, how many of the points are done and an estimate of the time
    the others take (the mean time of the points run so far), and every ``every`` seconds the round a
    running point has reached."""
    failed = []
    started = time.perf_counter()
    for n, (p, state) in enumerate(todo, 1):
        run_dir = os.path.join(sweep_dir, "runs", p.id)
        log = os.path.join(sweep_dir, "logs", f"{p.id}.log")
        how = f"resuming after round {state.last_round}" if state.last_round else "starting"
        say(f"[{n}/{len(todo)}] {p.id}: {how} ({ranks} rank(s)); log {log}")
        t0 = time.perf_counter()
        last = [state.last_round or 0]
        try:
            code = run_point(launch_command(os.path.join(sweep_dir, "points", f"{p.id}.yaml"), run_dir, ranks),
                             run_dir, log, lambda: _point_progress(run_dir, p.rounds, t0, say, last), every)
        except KeyboardInterrupt:
            say("interrupted: run the same command again to resume")
            return 130
        took = time.perf_counter() - t0
        elapsed = time.perf_counter() - started
        left = len(todo) - n
        progress = f"; {n}/{len(todo)} points done" + (f", ETA {duration(elapsed / n * left)}" if left else
                                                        f" in {duration(elapsed)}")
        if code == 0:
            recs = read_metrics(run_dir)
            # the global model's accuracy and the clients' own models' mean, whichever the run has (FD
            # has no global model; a partial personal method's global model has initial personal layers)
            acc = "".join(f"{k} {recs[-1][k]:.4f}, " for k in ("test_accuracy", "local_test_accuracy_mean")
                          if recs and k in recs[-1])
            say(f"      done: {acc}{took:.1f} s{progress}")
        elif code in INTERRUPTED_CODES:
            say(f"      stopped by a signal (exit {code}) after {took:.1f} s: run the same command again to resume")
            return code
        else:
            failed.append(p.id)
            say(f"      FAILED (exit {code}): {_tail(log)}")
            say(f"     {progress[1:]}")
    if failed:
        say(f"{len(failed)} point(s) failed: {', '.join(failed)} (their logs are under {sweep_dir}/logs; "
            f"a re-run retries them)")
        return 1
    return 0
