"""The SLURM array job of a sweep: one array task per point, each a multi-rank srun step.

Each submission writes its own script, ``SWEEP/slurm/array-<k>.sbatch``, listing the ids of the
points it runs: a requeued task of an earlier submission still finds its own point, whatever
was submitted since. The script's body is ``slurm/step.sh`` (rendezvous from the node list,
threads from SLURM_CPUS_PER_TASK, USR1 -> checkpoint -> requeue, --resume on every start).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List

from ..config import build_options
from ..errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_SCRIPT = os.path.join(REPO, "slurm", "step.sh")


@dataclass
class SlurmOptions:
    """The grid's ``slurm:`` section; ``ranks`` (top level) = nodes x ntasks_per_node."""

    nodes: int = 1
    ntasks_per_node: int = 0          # 0: ranks / nodes. On GPU nodes: GPUs per node
    gpus_per_node: int = 0            # GPUs per node, every rank seeing all of them (--gpu-bind=none):
                                      # the recommended GPU layout (slurm/run_gpu.sbatch says why)
    gpus_per_task: int = 0            # 1: one private GPU per rank (isolates ranks: NCCL may lose P2P)
    cpus_per_task: int = 1            # threads per rank
    time: str = "02:00:00"
    partition: str = ""
    account: str = ""
    qos: str = ""
    mem_per_cpu: str = ""
    job_name: str = ""                # default: fedhpc-<sweep name>
    max_parallel: int = 0             # array tasks running at once (%N); 0 = no limit
    signal_seconds: int = 120         # USR1 this long before the time limit
    python: str = ""                  # the Python on the nodes; default: the one running the sweep
    extra: List[str] = field(default_factory=list)   # more #SBATCH options, e.g. ["--constraint=a100"]
    setup: List[str] = field(default_factory=list)   # shell lines before the step, e.g. ["module load cuda"]

    def validate(self) -> None:
        for name in ("nodes", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"slurm.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ntasks_per_node", "gpus_per_node", "gpus_per_task", "max_parallel", "signal_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"slurm.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_node and self.gpus_per_task:
            raise ConfigError("slurm.gpus_per_node and slurm.gpus_per_task both set: give one (gpus_per_node, "
                              "the recommended layout, lets every rank of a node see its GPUs; slurm/run_gpu.sbatch)")
        for name in ("extra", "setup"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise ConfigError(f"slurm.{name} must be a list of strings, got {v!r}")

    def tasks_per_node(self, ranks: int) -> int:
        """Ranks per node for ``ranks`` ranks in all, refusing layouts SLURM would not give."""
        if self.ntasks_per_node:
            if self.nodes * self.ntasks_per_node != ranks:
                raise ConfigError(f"slurm.nodes ({self.nodes}) x slurm.ntasks_per_node ({self.ntasks_per_node}) "
                                  f"must equal ranks ({ranks}); change one of them")
            return self.ntasks_per_node
        if ranks % self.nodes:
            raise ConfigError(f"ranks ({ranks}) must be a multiple of slurm.nodes ({self.nodes}) "
                              f"so every node gets the same number of ranks")
        return ranks // self.nodes


def slurm_options(values: dict) -> SlurmOptions:
    return build_options(SlurmOptions, dict(values), "the grid's slurm section")


# Values written bare on an #SBATCH line; anything else is double-quoted by _sbatch_word.
_SBATCH_BARE = re.compile(r"[A-Za-z0-9_./:=+,@%-]+")


def _sbatch_word(value: str) -> str:
    """``value`` as one word of an ``#SBATCH`` line. sbatch splits those lines on unquoted blanks and
    ends them at an unquoted ``#``; inside double quotes a backslash escapes the next character."""
    value = str(value)
    if "\n" in value or "\r" in value:
        raise ConfigError(f"{value!r} cannot go on an #SBATCH line, which ends at a line break; remove the break")
    if _SBATCH_BARE.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_sweep_dir(sweep_dir: str) -> None:
    """Refuse a sweep folder the array script cannot name: an #SBATCH line ends at a line break, and
    SLURM drops every backslash of an --output path (and then expands none of its %x-%A_%a)."""
    bad = [c for c in ("\\", "\n", "\r") if c in sweep_dir]
    if bad:
        raise ConfigError(f"sweep folder {sweep_dir!r} holds {' and '.join(repr(c) for c in bad)}, which an "
                          f"sbatch script cannot write in its --output path; choose another out: (or --out)")


def render_array_script(name: str, ids: List[str], ranks: int, opts: SlurmOptions, sweep_dir: str,
                        workdir: str) -> str:
    """An sbatch script running point ``ids[SLURM_ARRAY_TASK_ID]`` of the sweep in ``sweep_dir``."""
    if not ids:
        raise ConfigError("no points to submit")
    if not os.path.exists(STEP_SCRIPT):
        raise ConfigError(f"{STEP_SCRIPT} is missing; run the sweep from a fedhpc source checkout")
    sweep_dir, workdir = os.path.abspath(sweep_dir), os.path.abspath(workdir)
    _check_sweep_dir(sweep_dir)
    per_node = opts.tasks_per_node(ranks)
    array = f"0-{len(ids) - 1}" + (f"%{opts.max_parallel}" if opts.max_parallel else "")
    lines = [
        "#!/bin/bash",
        f"# Sweep {name}: {len(ids)} point(s), one array task each; written by python -m fedhpc.sweep.",
        f"# Point settings: {sweep_dir}/points/<id>.yaml; run folders: {sweep_dir}/runs/<id>/.",
        f"#SBATCH --job-name={_sbatch_word(opts.job_name or 'fedhpc-' + name)}",
        f"#SBATCH --array={array}",
        f"#SBATCH --nodes={opts.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --cpus-per-task={opts.cpus_per_task}",
    ]
    if opts.gpus_per_node:  # every rank sees the node's GPUs and takes cuda:<local rank> (fedhpc/world.py)
        lines += [f"#SBATCH --gpus-per-node={opts.gpus_per_node}", "#SBATCH --gpu-bind=none"]
    if opts.gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={opts.gpus_per_task}")
    lines.append(f"#SBATCH --time={_sbatch_word(opts.time)}")
    for key in ("partition", "account", "qos", "mem_per_cpu"):
        if getattr(opts, key):
            lines.append(f"#SBATCH --{key.replace('_', '-')}={_sbatch_word(getattr(opts, key))}")
    # SLURM reads --output as a filename pattern: a '%' of the folder itself is written '%%'.
    log_pattern = sweep_dir.replace("%", "%%") + "/logs/%x-%A_%a.out"
    lines += [
        f"#SBATCH --signal=B:USR1@{opts.signal_seconds}",
        "#SBATCH --requeue",
        f"#SBATCH --output={_sbatch_word(log_pattern)}",
    ]
    lines += [f"#SBATCH {e}" for e in opts.extra]
    lines += ["", "set -uo pipefail", f"cd {shlex.quote(workdir)}", *opts.setup,
              "IDS=(" + " ".join(shlex.quote(i) for i in ids) + ")",
              'ID=${IDS[${SLURM_ARRAY_TASK_ID:?run this with sbatch --array}]}',
              f"export FEDHPC_PYTHON={shlex.quote(opts.python or sys.executable)}",
              f"export FEDHPC_SIGNAL_MARGIN_S={opts.signal_seconds}  # --signal's margin: fedhpc warns when a round outlasts it",
              f"SWEEP={shlex.quote(sweep_dir)}",
              # exec: SLURM's USR1 must reach step.sh's trap, not a shell waiting for it.
              f'exec bash {shlex.quote(STEP_SCRIPT)} "$SWEEP/runs/$ID" --config "$SWEEP/points/$ID.yaml"',
              ""]
    return "\n".join(lines)


def submit(script_path: str) -> str:
    """``sbatch --parsable SCRIPT``; returns the array job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("sbatch is not on PATH: submit from a SLURM login node, run the points here "
                          "with --local, or look at the plan with --dry-run")
    p = subprocess.run([sbatch, "--parsable", script_path], capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(f"sbatch refused {script_path} (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip().split(";")[0]
