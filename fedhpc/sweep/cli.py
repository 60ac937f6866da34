"""``python -m fedhpc.sweep GRID.yaml``: expand a grid, then submit it as a SLURM array or run it here.

    python -m fedhpc.sweep sweeps/digits_demo.yaml --dry-run      # the points, their state, what would run
    python -m fedhpc.sweep sweeps/digits_demo.yaml --local        # here, one point after another
    python -m fedhpc.sweep sweeps/digits_demo.yaml --max-parallel 8   # sbatch --array=0-N%8
    python -m fedhpc.sweep sweeps/mix2fld_fig2_mnist.yaml --data-dir ~/data   # datasets read from files

The sweep folder (the grid's ``out``) holds ``points/<id>.yaml`` (each point's launch settings),
``runs/<id>/`` (each run's --out), ``logs/``, ``slurm/array-<k>.sbatch`` and ``sweep.json``.
Running the same command again skips finished points and resumes the others; it must not be
re-submitted while an earlier array of the same sweep is still running (a point would run twice).
A point whose folder holds a run made with other identity settings than the point's (one the id
does not hash, such as ``nesterov``) stops the command before anything runs: restore the setting,
or write the changed grid to another folder (--out, or a new name:). So does a run, finished or
not, whose split was dealt under older partition rules (its identity.json, or for a run written
before that file its last checkpoint, says which; a run with neither is taken as today's): delete
its folder to run the point again, or write the sweep to another folder.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import sys
import time
from typing import List, Optional

from ..checkpoint import recorded_identity
from ..errors import CheckpointError, ConfigError, FedHPCError
from ..io import atomic_write_json, atomic_write_text
from .grid import PARTITION_RULES_DIFFER, Grid, expand, identity_differences, load_grid, point_yaml
from .local import launch_command, run_points
from .slurm import render_array_script, slurm_options, submit
from .state import RunState, read_config, read_exit_code, run_state


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedhpc.sweep", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="grid YAML file (see fedhpc/sweep/grid.py and sweeps/)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="run the points here, one after another")
    mode.add_argument("--no-submit", action="store_true", help="write the array script but do not call sbatch")
    p.add_argument("--dry-run", action="store_true", help="print what would be done; write and run nothing")
    p.add_argument("--ranks", type=int, help="ranks per point (overrides the grid's ranks)")
    p.add_argument("--max-parallel", type=int, help="array tasks running at once (sbatch --array=...%%N)")
    p.add_argument("--out", help="sweep folder (overrides the grid's out)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="folder holding the real datasets (mnist, cifar10, ...): every point's data_dir, over "
                        "the grid's; not part of the run ids")
    return p


def plan(grid: Grid, sweep_dir: str):
    """Expand and validate ``grid``; return [(Point, RunState)] for every point.

    A point whose folder already holds a run (its config.yaml) must be that run: the ids hash only
    some of the settings a run depends on (see grid.py), so the others are compared here and a
    sweep that would skip or resume a run made with other settings is refused, every such point
    named."""
    points = expand(grid)
    planned, differ, kinds = [], [], []
    for p in points:
        run_dir = os.path.join(sweep_dir, "runs", p.id)
        try:
            saved = read_config(run_dir)
            # config.yaml does not say the partition rules the run was dealt under: its recorded identity does
            recorded = recorded_identity(run_dir) if saved is not None else None
        except CheckpointError as e:  # its identity cannot be told: a person must look (see state.py)
            planned.append((p, RunState("damaged", 0, p.rounds, read_exit_code(run_dir), str(e))))
            continue
        diffs = identity_differences(p, saved, recorded) if saved is not None else []
        kinds += diffs
        if diffs:
            differ.append(f"  point {p.index} ({p.label}), {run_dir}: {'; '.join(diffs)}")
        planned.append((p, run_state(run_dir, p.rounds)))
    if differ:
        fixes = []
        if any(not d.startswith(PARTITION_RULES_DIFFER) for d in kinds):
            fixes.append("restore the setting(s) in the grid to continue those runs")
        if any(d.startswith(PARTITION_RULES_DIFFER) for d in kinds):
            # today's code cannot deal the old split again, so no grid setting makes the run this point's
            fixes.append("delete the folder of a run dealt under other partition rules to run its point again "
                         "(its split is not the one today's code deals)")
        raise ConfigError(
            f"grid {grid.path}: {len(differ)} point(s) would skip or resume a run made with other settings "
            f"(their ids hold only some of the settings, see fedhpc/sweep/grid.py); nothing was run or "
            f"submitted:\n" + "\n".join(differ) + f"\n{'; '.join(fixes)}, "
            "or write this sweep to another folder: --out DIR, or a new name: in the grid (when it sets no out:)")
    return planned


def write_sweep(grid: Grid, planned, sweep_dir: str) -> None:
    """points/<id>.yaml and the sweep.json manifest (the report lists points not started from it and
    reads their declared axes; each run declares its ``hparams``, every point's TensorBoard HParams
    column, so that the tab shows every swept setting whichever run it takes its columns from)."""
    for sub in ("points", "runs", "logs", "slurm"):
        os.makedirs(os.path.join(sweep_dir, sub), exist_ok=True)
    for p, _ in planned:
        atomic_write_text(os.path.join(sweep_dir, "points", f"{p.id}.yaml"), point_yaml(grid, p))
    atomic_write_json(os.path.join(sweep_dir, "sweep.json"), {
        "name": grid.name, "grid": os.path.abspath(grid.path), "ranks": grid.ranks, "written": time.time(),
        "points": [{"index": p.index, "id": p.id, "label": p.label, "axes": p.axes, "rounds": p.rounds}
                   for p, _ in planned],
        "hparams": _hparam_columns([p for p, _ in planned]),
    })


def _hparam_columns(points) -> dict:
    """The TensorBoard HParams columns of the points ({name: type}); {} where tensorboard's part of
    fedhpc cannot be imported (the runs then write no event files either)."""
    try:
        from ..report.tensorboard import sweep_hparam_types
    except ImportError:
        return {}
    return sweep_hparam_types(p.config for p in points if p.config is not None)


def _next_array_number(sweep_dir: str) -> int:
    """k of the next ``slurm/array-<k>.sbatch``: one past the highest written (script or its job record),
    so an earlier submission's files are never overwritten, even where one was deleted."""
    # escape: a sweep folder such as exp[1] must be matched as written, not read as a pattern
    found = glob.glob(os.path.join(glob.escape(os.path.join(sweep_dir, "slurm")), "array-*.*"))
    numbers = [int(m.group(1)) for m in (re.fullmatch(r"array-(\d+)\.(?:sbatch|json)", os.path.basename(f))
                                         for f in found) if m]
    return max(numbers, default=0) + 1


def _summary(planned) -> str:
    counts = {}
    for _, s in planned:
        counts[s.status] = counts.get(s.status, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        grid = load_grid(args.grid)
        if args.ranks is not None:
            grid.ranks = args.ranks
        if args.out:
            grid.out = args.out
        if args.data_dir:
            # absolute: the points run from this folder too, but their YAML files may be read from anywhere
            grid.data_dir = os.path.abspath(args.data_dir)
        opts = slurm_options(grid.slurm)
        if args.max_parallel is not None:
            opts.max_parallel = args.max_parallel
            opts.validate()
        opts.tasks_per_node(grid.ranks)  # refuse an impossible layout before anything runs
        sweep_dir = grid.out
        planned = plan(grid, sweep_dir)
        # conflict and damaged folders need a person: running them again could not make them whole
        todo = [(p, s) for p, s in planned if s.status not in ("finished", "conflict", "damaged")]
        print(f"sweep {grid.name}: {len(planned)} point(s) ({_summary(planned)}) in {sweep_dir}")
        for p, s in planned:
            action = {"finished": "skip", "conflict": "skip (see fedhpc/sweep/state.py)",
                      "damaged": "skip until repaired"}.get(s.status, "resume" if s.status != "not started" else "run")
            print(f"  [{p.index}] {p.id}: {s.describe()} -> {action}")
        if not todo:
            stuck = sum(s.status != "finished" for _, s in planned)
            print(f"nothing to run: {stuck} point(s) skipped until their folders are repaired (see above)" if stuck
                  else "nothing to do: every point is finished")
            return 0

        if args.local:
            if args.dry_run:
                for p, _ in todo:
                    cmd = launch_command(os.path.join(sweep_dir, "points", f"{p.id}.yaml"),
                                         os.path.join(sweep_dir, "runs", p.id), grid.ranks)
                    print("would run: " + " ".join(shlex.quote(c) for c in cmd))
                return 0
            write_sweep(grid, planned, sweep_dir)
            return run_points(todo, grid.ranks, sweep_dir)

        k = _next_array_number(sweep_dir)
        script_path = os.path.join(sweep_dir, "slurm", f"array-{k}.sbatch")
        script = render_array_script(grid.name, [p.id for p, _ in todo], grid.ranks, opts, sweep_dir, os.getcwd())
        if args.dry_run:
            print(f"would write {script_path} and submit it with sbatch --parsable:\n{script}")
            return 0
        write_sweep(grid, planned, sweep_dir)
        atomic_write_text(script_path, script)
        if args.no_submit:
            print(f"wrote {script_path}; submit it with: sbatch {script_path}")
            return 0
        job = submit(script_path)
        atomic_write_json(script_path[:-len(".sbatch")] + ".json",
                          {"job_id": job, "ids": [p.id for p, _ in todo], "submitted": time.time()})
        limit = f", at most {opts.max_parallel} at once" if opts.max_parallel else ""
        print(f"submitted array job {job}: {len(todo)} task(s){limit}; logs in {sweep_dir}/logs. "
              f"When it is done: python -m fedhpc.report {sweep_dir}")
        return 0
    except FedHPCError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
