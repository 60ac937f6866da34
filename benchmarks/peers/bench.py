"""Side by side: the same FedAvg work in fedhpc, a plain PyTorch loop, pfl-research and Flower.

    .venv/bin/python benchmarks/peers/bench.py [--repeats 3] [--workloads a b] [--frameworks ...]

(``bash benchmarks/peers/run.sh`` makes the venvs and the workloads first, then runs this.)

Every repeat runs every framework once on every workload, each in a fresh process, in
an order rotated from one repeat to the next, so that load from other jobs on the
machine falls on all of them alike; the table gives medians over the repeats:

* loop: the round loop, evaluation excluded (each runner's own clock; see its docstring),
* rounds 2+: the same without round 1, which carries each framework's warm-up,
* process: the whole process, from the launcher's start to its exit (interpreter and
  imports, data loading, ray / torch.distributed start-up, evaluation, output),
* ratios to the plain loop, the final test accuracy, and the largest difference of any
  final weight from fedhpc's on one rank: the proof that the work was the same.

Runners whose venv is missing (``setup_venvs.sh`` failed) are left out with a note.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROJECT_PY = os.path.join(REPO, ".venv", "bin", "python")
VENVS = os.path.join(HERE, ".venvs")

#: label -> (venv it needs or None for the project's, description)
FRAMEWORKS = {
    "plain": (None, "plain PyTorch loop, 1 process"),
    "fedhpc-1": (None, "fedhpc, python -m fedhpc.launch, 1 rank"),
    "fedhpc-2": (None, "fedhpc, mpiexec -n 2, 2 ranks"),
    "pfl-1": ("pfl", "pfl 0.6.0, 1 process"),
    "pfl-2": ("pfl", "pfl 0.6.0, torchrun, 2 processes"),
    "flower": ("flwr", "Flower simulation (ray), 2 actors"),
}


def command(fw: str, work: str, result: str, tmp: str, flower_actors: int) -> List[str]:
    """The command line of one run of framework ``fw`` on workload file ``work``."""
    if fw == "plain":
        return [PROJECT_PY, os.path.join(HERE, "run_plain.py"), work, result]
    if fw.startswith("fedhpc"):
        with np.load(work) as z:  # the flags the workload was exported with
            flags = json.loads(str(z["meta"]))["launch_args"]
        flags = flags + ["--threads", "1", "--quiet", "--no-tensorboard", "--checkpoint-every", "0",
                         "--out", os.path.join(tmp, "fedhpc-out")]
        cmd = [PROJECT_PY, os.path.join(HERE, "run_fedhpc.py"), work, result, "--", *flags]
        if fw == "fedhpc-2":
            mpiexec = os.path.join(REPO, ".venv", "bin", "mpiexec")
            cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2"] + cmd
        return cmd
    if fw == "pfl-1":
        return [os.path.join(VENVS, "pfl", "bin", "python"), os.path.join(HERE, "run_pfl.py"), work, result]
    if fw == "pfl-2":
        return [os.path.join(VENVS, "pfl", "bin", "torchrun"), "--standalone", "--nproc-per-node", "2",
                os.path.join(HERE, "run_pfl.py"), work, result]
    if fw == "flower":
        return [os.path.join(VENVS, "flwr", "bin", "python"), os.path.join(HERE, "run_flower.py"), work, result,
                "--actors", str(flower_actors)]
    raise KeyError(fw)


def clean_env(fw: str) -> Dict[str, str]:
    """No launcher variables from outside; one thread per process; fedhpc importable for its runner."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "SLURM_", "PMIX_", "HYDRA_", "MPIR_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                         "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_DISABLE_USAGE_STATS="1",
               FLWR_TELEMETRY_ENABLED="0", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    if fw.startswith("fedhpc"):
        env["PYTHONPATH"] = REPO
    return env


def available(fw: str) -> Optional[str]:
    """None when ``fw`` can run, else why not."""
    venv = FRAMEWORKS[fw][0]
    if venv is None:
        return None if os.path.exists(PROJECT_PY) else f"{PROJECT_PY} missing (bash scripts/setup_env.sh)"
    if not os.path.exists(os.path.join(VENVS, venv, ".ok")):
        log = os.path.join(VENVS, f"{venv}.log")
        return f"venv .venvs/{venv} not set up" + (f" (see {log})" if os.path.exists(log) else "")
    return None


def run_once(fw: str, work: str, flower_actors: int, timeout: float) -> Dict:
    tmp = tempfile.mkdtemp(prefix=f"peers-{fw}-")
    result = os.path.join(tmp, "result.json")
    try:
        t0 = time.perf_counter()
        p = subprocess.run(command(fw, work, result, tmp, flower_actors), cwd=HERE, env=clean_env(fw),
                           capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if p.returncode != 0 or not os.path.exists(result):
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
            return {"error": f"exit {p.returncode}:\n{tail}"}
        with open(result) as f:
            out = json.load(f)
        with np.load(result + ".weights.npz") as z:
            out["weights"] = {k: z[k].astype(np.float64) for k in z.files}
        out["process_seconds"] = wall
        return out
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def max_diff(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    if a.keys() != b.keys():
        return float("nan")
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def table(workload: str, runs: Dict[str, List[Dict]], order: List[str]) -> List[str]:
    """The markdown rows of one workload: medians over the repeats."""
    ok = {fw: [r for r in rs if "error" not in r] for fw, rs in runs.items()}
    ref_runs = ok.get("fedhpc-1") or ok.get("plain") or []
    ref_name = "fedhpc 1 rank" if ok.get("fedhpc-1") else "plain"
    ref = ref_runs[0]["weights"] if ref_runs else None
    med = {fw: {k: statistics.median(r[k] for r in rs) for k in ("loop_seconds", "steady_seconds", "process_seconds")}
           for fw, rs in ok.items() if rs}
    plain = med.get("plain")
    lines = [f"| framework | loop s | rounds 2+ s | process s | loop / plain | rounds 2+ / plain | "
             f"process / plain | final acc | max abs dw vs {ref_name} | loop s per repeat |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for fw in order:
        rs = ok.get(fw) or []
        if not rs:
            err = next((r["error"].splitlines()[0] for r in runs.get(fw, []) if "error" in r), "not run")
            lines.append(f"| {FRAMEWORKS[fw][1]} | {err} | | | | | | | | |")
            continue
        m = med[fw]

        def ratio(key):
            return f"{m[key] / plain[key]:.2f}" if plain else "-"

        accs = sorted({round(r["final_accuracy"], 4) for r in rs})
        dw = max(max_diff(r["weights"], ref) for r in rs) if ref is not None else float("nan")
        lines.append(f"| {rs[0]['framework']} | {m['loop_seconds']:.2f} | {m['steady_seconds']:.2f} | "
                     f"{m['process_seconds']:.2f} | {ratio('loop_seconds')} | {ratio('steady_seconds')} | "
                     f"{ratio('process_seconds')} | {', '.join(f'{a:.4f}' for a in accs)} | {dw:.1e} | "
                     f"{', '.join('%.2f' % r['loop_seconds'] for r in rs)} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["a", "b"])
    ap.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    ap.add_argument("--flower-actors", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--work", default=os.path.join(HERE, ".work"), help="folder of the exported <workload>.npz")
    ap.add_argument("--save", default=None, help="also write the report (markdown) here")
    a = ap.parse_args(argv)

    skipped = {fw: why for fw in a.frameworks if (why := available(fw))}
    frameworks = [fw for fw in a.frameworks if fw not in skipped]
    works = {w: os.path.join(a.work, f"{w}.npz") for w in a.workloads}
    for w, path in works.items():
        if not os.path.exists(path):
            print(f"error: {path} missing: run {PROJECT_PY} {HERE}/export_workload.py", file=sys.stderr)
            return 2

    load_before = os.getloadavg()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    runs: Dict[str, Dict[str, List[Dict]]] = {w: {fw: [] for fw in frameworks} for w in works}
    for rep in range(a.repeats):
        order = frameworks[rep % len(frameworks):] + frameworks[:rep % len(frameworks)] if frameworks else []
        for w, path in works.items():
            for fw in order:
                r = run_once(fw, path, a.flower_actors, a.timeout)
                runs[w][fw].append(r)
                shown = r["error"].splitlines()[0] if "error" in r else (
                    f"loop {r['loop_seconds']:.2f} s, process {r['process_seconds']:.2f} s, "
                    f"acc {r['final_accuracy']:.4f}")
                print(f"[repeat {rep + 1}/{a.repeats}] workload {w} {fw:9s} {shown}  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    load_after = os.getloadavg()

    out = [f"Peers benchmark, {started}: {machine()}; {a.repeats} interleaved repeats, medians.",
           f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; "
           f"after: {' '.join(f'{x:.2f}' for x in load_after)}"
           + ("  (busy machine: figures are noisy)" if max(load_before[0], load_after[0]) > 1.5 else "")]
    versions = {}
    for w in works:
        for fw, rs in runs[w].items():
            for r in rs:
                for k in ("torch", "pfl_version", "flwr_version", "ray_version"):
                    if k in r:
                        versions[k] = r[k]
    out.append("Versions: " + ", ".join(f"{k.replace('_version', '')} {v}" for k, v in sorted(versions.items())))
    titles = {"a": "(a) cross-device: digits, 100 IID clients x 14-15 samples, 10 per round, 50 rounds, 1 epoch, "
                   "batch 5, SGD 0.05, MLP 64-128-10, eval every 10 rounds",
              "b": "(b) compute-bound: digits CNN, 10 IID clients x 143-144 samples, all 10 per round, 20 rounds, "
                   "1 epoch, batch 10, SGD 0.05, eval every 10 rounds"}
    for w in works:
        out += ["", titles.get(w, w), ""] + table(w, runs[w], frameworks)
    for fw, why in skipped.items():
        out.append(f"\nleft out: {FRAMEWORKS[fw][1]}: {why}")
    for w in works:
        for fw, rs in runs[w].items():
            for r in rs:
                if "error" in r:
                    out.append(f"\nworkload {w}, {fw} failed: {r['error']}")
                    break
    report = "\n".join(out)
    print("\n" + report)
    if a.save:
        os.makedirs(os.path.dirname(os.path.abspath(a.save)), exist_ok=True)
        with open(a.save + ".tmp", "w") as f:
            f.write(report + "\n")
        os.replace(a.save + ".tmp", a.save)
    return 0 if not any("error" in r for w in works for rs in runs[w].values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
