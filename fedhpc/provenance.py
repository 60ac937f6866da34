"""``run.json``: what a run folder says about how the run came to be, beside ``config.yaml``.

config.yaml holds the settings as they were given (``model: auto``, ``threads: 0``), which a resume
compares and a later fedhpc may read otherwise; ``run.json`` holds what they came to mean, and what
ran them, so that the folder alone answers: what code, which settings, on what, launched how.

* ``config``: every RunConfig field as this run resolved it: the model actually built, the partition
  the split was dealt under (``natural`` / ``iid`` for ``auto``), the device type, the threads per
  rank, the collective backend, the option mappings with every default this code filled in;
* ``fedhpc``: ``version`` (``fedhpc.__version__``), the git ``commit`` of the checkout the package was
  imported from, whether the code differs from that commit (``dirty``: the package's files or the
  native ops' csrc/, tracked changes or untracked files) with a digest of the differences
  (``diff_sha1``, so that two dirty trees can be told apart), and whether anything tracked in the
  checkout differs (``tree_dirty``: tests, docs too); null where git is missing or the package is
  not a checkout (:func:`git_state`);
* ``versions``: Python, torch, CUDA / cuDNN / NCCL (as torch was built; null on CPU builds), numpy,
  and the MPI library (``MPI.Get_library_version()``) and mpi4py when the run was launched by MPI;
* ``launch``: the launcher (``mpiexec``, ``srun``, ``torchrun`` or ``single process``), the number
  of ranks, each rank's host, device, GPU and threads (gathered over the ranks), the backend, and the
  SLURM job / step where there is one;
* ``command``: ``sys.argv``, the interpreter's full command line (``sys.orig_argv``) and the folder
  it ran in;
* ``started`` / ``ended`` (UTC, ISO 8601; ``ended`` null until the run finished) and
  ``rounds_done``; a resumed run keeps the launches before it under ``earlier_launches``
  (each with its own code, versions, launch and command), newest last.

Rank 0 writes the file atomically at the start (after one gather over the ranks) and rewrites it
once at the end; together well under a second (git is given 10 s at most and skipped if missing).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: the file's name in a run folder
PROVENANCE_FILE = "run.json"
#: bumped when a field changes meaning
PROVENANCE_FORMAT = 1

#: what describes one launch (kept per launch in ``earlier_launches`` when a run is resumed)
LAUNCH_FIELDS = ("started", "ended", "rounds_done", "fedhpc", "versions", "launch", "command")

#: world.py's launcher names -> what run.json calls them
LAUNCHERS = {"mpi": "mpiexec", "srun": "srun", "torchrun": "torchrun", "single": "single process"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_state(directory: Optional[str] = None, also: Sequence[str] = (), timeout: float = 10.0) -> Dict[str, Any]:
    """The git checkout holding ``directory`` (default: this package's folder): ``commit`` (HEAD),
    ``dirty`` (the code differs from it: a tracked file under ``directory`` or under the checkout's
    folders ``also`` changed, or an untracked file sits in them), ``diff_sha1`` (a digest of those
    differences: the diff against HEAD and the untracked files' names and bytes, so that two dirty
    trees can be told apart; None when clean) and ``tree_dirty`` (a tracked file anywhere in the
    checkout changed: tests, docs...). All None where git is missing or fails, or ``directory`` is not
    tracked in the checkout git finds above it (a package installed into a virtual environment inside
    someone's project). git runs without the index lock (GIT_OPTIONAL_LOCKS=0): others may be working
    in the tree."""
    directory = os.path.abspath(directory or os.path.dirname(os.path.abspath(__file__)))
    unknown: Dict[str, Any] = {"commit": None, "dirty": None, "diff_sha1": None, "tree_dirty": None}
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0"}

    def git(*args: str, where: str = directory) -> Tuple[int, bytes]:
        p = subprocess.run(["git", "-C", where, *args], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout, env=env)
        return p.returncode, p.stdout

    try:
        rc, head = git("rev-parse", "--show-toplevel", "HEAD")
        if rc != 0 or len(head.split()) != 2:
            return unknown
        top, commit = (x.decode() for x in head.split())
        # the checkout must be this package's, not one that merely contains the folder
        rc, tracked = git("ls-files", "--", ".")
        if rc != 0 or not tracked.strip():
            return unknown
        paths = [os.path.relpath(directory, top)] + [p for p in also if os.path.exists(os.path.join(top, p))]
        rc_diff, diff = git("diff", "HEAD", "--no-ext-diff", "--no-textconv", "--binary", "--no-color", "--",
                            *paths, where=top)
        rc_new, untracked = git("ls-files", "--others", "--exclude-standard", "-z", "--", *paths, where=top)
        rc_tree, _ = git("diff", "HEAD", "--quiet", "--no-ext-diff", where=top)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return unknown
    if rc_diff != 0 or rc_new != 0:
        return {**unknown, "commit": commit}
    names = sorted(n for n in untracked.decode(errors="replace").split("\0") if n)
    dirty = bool(diff) or bool(names)
    digest = None
    if dirty:
        h = hashlib.sha1(diff)
        for name in names:
            h.update(b"\0untracked\0" + name.encode())
            try:
                with open(os.path.join(top, name), "rb") as f:
                    h.update(f.read())
            except OSError:
                pass
        digest = h.hexdigest()
    return {"commit": commit, "dirty": dirty, "diff_sha1": digest,
            "tree_dirty": dirty or rc_tree == 1 if rc_tree in (0, 1) else None}


def code_record() -> Dict[str, Any]:
    from . import __version__

    package = os.path.dirname(os.path.abspath(__file__))
    # the code a run executes: the package, and the native ops' sources beside it in a checkout
    return {"version": __version__, **git_state(package, also=("csrc",)), "path": package}


def library_versions(launcher: str) -> Dict[str, Any]:
    """Python, torch and what torch was built with; the MPI library only when MPI launched the run
    (importing mpi4py otherwise would start MPI)."""
    import numpy
    import torch

    out: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cudnn": None, "nccl": None, "numpy": numpy.__version__,
                           "mpi": None, "mpi_library": None, "mpi4py": None}
    try:
        if torch.backends.cudnn.is_available():
            out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a CPU build may lack the module's backend entirely
        pass
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else v
    except Exception:  # noqa: BLE001 - built without NCCL
        pass
    if launcher == "mpi":
        try:
            import mpi4py
            from mpi4py import MPI

            text = MPI.Get_library_version().strip().replace("\0", "")
            out["mpi"] = next((" ".join(line.split()) for line in text.splitlines() if line.strip()), text)
            out["mpi_library"] = text
            out["mpi4py"] = mpi4py.__version__
        except Exception:  # noqa: BLE001 - never fail a run over its record
            pass
    return out


def rank_facts(world) -> Dict[str, Any]:
    """What this rank ran on: host, process, device (with the GPU's name), threads. Never raises (every
    rank gathers these: one rank failing alone would leave the others waiting)."""
    facts: Dict[str, Any] = {"rank": getattr(world, "rank", None), "host": socket.gethostname(), "pid": os.getpid(),
                             "local_rank": getattr(world, "local_rank", None),
                             "device": str(getattr(world, "device", None)), "gpu": None,
                             "threads": getattr(world, "threads", None)}
    if getattr(getattr(world, "device", None), "type", None) == "cuda":
        try:
            import torch

            facts["gpu"] = torch.cuda.get_device_name(world.device)
        except Exception:  # noqa: BLE001
            pass
    return facts


def launch_record(world, ranks: List[Dict[str, Any]], env=None) -> Dict[str, Any]:
    env = os.environ if env is None else env
    slurm = {k: env[f"SLURM_{k.upper()}"] for k in ("job_id", "step_id", "array_job_id", "array_task_id",
                                                       "job_nodelist") if f"SLURM_{k.upper()}" in env}
    return {"launcher": LAUNCHERS.get(world.launcher, world.launcher), "ranks": world.size,
            "hosts": [r["host"] for r in ranks], "nodes": len({r["host"] for r in ranks}),
            "backend": world.backend if world.size > 1 else "none", "per_rank": ranks, "slurm": slurm or None}


def command_record() -> Dict[str, Any]:
    return {"argv": list(sys.argv), "orig_argv": list(getattr(sys, "orig_argv", sys.argv)),
            "executable": sys.executable, "cwd": os.getcwd()}


def natural_datasets() -> set:
    """The datasets whose ``auto`` partition is ``natural`` (one client per writer): those read by a
    reader marked natural (fedhpc/data/readers). Empty if that cannot be told."""
    try:
        from .data.readers import common

        found, todo = set(), [common.Reader]
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if getattr(cls, "natural", False) and getattr(cls, "name", ""):
                found.add(cls.name)
        return found
    except Exception:  # noqa: BLE001 - the readers moved: the partition is then recorded as given
        return set()


def resolved_partition(spec: str, dataset: str, data: Any = None) -> str:
    """The partition ``spec`` meant for ``dataset``: as canonically spelled; ``auto`` as what the
    dataset deals for it (what an HDF5 store recorded, else ``natural`` for naturally federated data,
    ``iid`` for the others)."""
    from .data.partition import canonical_partition

    spelled = canonical_partition(spec)
    if spelled != "auto":
        return spelled
    meta = getattr(data, "meta", None)
    if isinstance(meta, dict) and isinstance(meta.get("partition"), str):
        return canonical_partition(meta["partition"])
    return "natural" if dataset in natural_datasets() else "iid"


def resolved_config(cfg, world, model: str, data: Any = None,
                    options_as_run: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``cfg`` as the run resolved it (see the module docstring); ``options_as_run``: the option
    mappings with every default filled in (the identity record's)."""
    from .config.identity import canonical_identity

    out = canonical_identity({**cfg.to_dict(), "model": model})
    out.update({k: v for k, v in (options_as_run or {}).items() if isinstance(v, dict)})
    out["partition"] = resolved_partition(cfg.partition, out.get("dataset", cfg.dataset), data)
    out["device"] = world.device.type
    out["threads"] = world.threads
    out["collective_backend"] = world.backend if world.size > 1 else "none"
    if isinstance(out.get("data_options"), dict) and out["data_options"].get("store") == "auto":
        # where the clients' data lived: an HDF5 store (which records its meta) or memory
        out["data_options"]["store"] = "hdf5" if isinstance(getattr(data, "meta", None), dict) else "memory"
    return json.loads(json.dumps(out, default=str))


def start_record(cfg, world, ranks: List[Dict[str, Any]], model: str, data: Any = None,
                 options_as_run: Optional[Dict[str, Any]] = None,
                 previous: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """run.json's content at the start of a launch; ``previous``: the file an earlier launch of this
    run folder left (its launch goes to ``earlier_launches``)."""
    record: Dict[str, Any] = {
        "format": PROVENANCE_FORMAT, "started": _now(), "ended": None, "rounds_done": None,
        "fedhpc": code_record(), "command": command_record(), "launch": launch_record(world, ranks),
        "versions": library_versions(world.launcher),
        "config": resolved_config(cfg, world, model, data, options_as_run),
    }
    earlier: List[Dict[str, Any]] = []
    if isinstance(previous, dict):
        earlier = [e for e in previous.get("earlier_launches") or [] if isinstance(e, dict)]
        earlier.append({k: previous.get(k) for k in LAUNCH_FIELDS})
    record["earlier_launches"] = earlier
    return record


def write_provenance(run_dir: str, record: Dict[str, Any]) -> None:
    """run.json, atomically, its sections in the order :func:`start_record` builds them."""
    from .io import atomic_write_text

    atomic_write_text(os.path.join(run_dir, PROVENANCE_FILE), json.dumps(record, indent=2, default=str) + "\n")


def read_provenance(run_dir: str) -> Optional[Dict[str, Any]]:
    """The run's run.json, or None where there is none or it cannot be read (a torn file, another
    tool's): the folder is then read as one from before run.json existed."""
    try:
        with open(os.path.join(run_dir, PROVENANCE_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def code_version(fedhpc_record: Optional[Dict[str, Any]]) -> Optional[str]:
    """One launch's code as one string: ``0.1.0 e9b957d23ae4`` with `` dirty 3f2a9c1b`` (the
    digest of its differences) for a dirty tree, ``0.1.0 (no git checkout)``; None: unrecorded."""
    if not isinstance(fedhpc_record, dict):
        return None
    version = fedhpc_record.get("version") or "?"
    commit = fedhpc_record.get("commit")
    if not commit:
        return f"{version} (no git checkout)"
    text = f"{version} {str(commit)[:12]}"
    if fedhpc_record.get("dirty"):
        digest = fedhpc_record.get("diff_sha1")
        text += f" dirty {str(digest)[:8]}" if digest else " dirty"
    return text


def code_versions(record: Optional[Dict[str, Any]]) -> List[str]:
    """Every code version that ran a part of the run (its launches, oldest first, each once)."""
    if not isinstance(record, dict):
        return []
    out: List[str] = []
    for launch in list(record.get("earlier_launches") or []) + [record]:
        v = code_version(launch.get("fedhpc")) if isinstance(launch, dict) else None
        if v is not None and v not in out:
            out.append(v)
    return out
