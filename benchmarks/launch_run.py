"""One fresh launcher run of a config dict, for the comparison scripts (compare_*.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_config(cfg: Dict, out: str, threads: int, label: str) -> Tuple[List[Dict], float]:
    """Write ``cfg`` to ``out/run.yaml`` (``out`` emptied first), run ``python -m fedhpc.launch``
    on it and return (metrics.jsonl rows, wall seconds); a failed run raises with its stderr."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    path = os.path.join(out, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    cmd = [sys.executable, "-m", "fedhpc.launch", "--config", path, "--out", out, "--quiet",
           "--threads", str(threads), "--no-tensorboard"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))], wall
