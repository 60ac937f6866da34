"""run.json (fedhpc/provenance.py): a run folder alone says what code ran it, with which settings
(resolved: no ``auto`` left), on what, launched how; on one process and on 2 ranks under mpiexec."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import yaml

import fedhpc
from conftest import FAST, REPO, launch
from fedhpc.provenance import code_version, code_versions, git_state, resolved_partition, start_record

# FAST without --model: the run must record the model the dataset's 'auto' built
ARGS = [a for i, a in enumerate(FAST) if a != "--model" and FAST[i - 1] != "--model"] + ["--rounds", "2"]


def _git(*args):
    p = subprocess.run(["git", "-C", os.path.join(REPO, "fedhpc"), *args], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def _autos(value, where=""):
    """Every place in a nested config that still says 'auto'."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _autos(v, f"{where}.{k}" if where else k)]
    return [where] if isinstance(value, str) and value.strip().lower() == "auto" else []


def _read(out):
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)


def test_a_single_process_run_records_its_code_settings_machine_and_command(tmp_path):
    out = str(tmp_path / "run")
    before = _git("rev-parse", "HEAD")
    p = launch(ARGS + ["--out", out])
    assert p.returncode == 0, p.stderr
    rec = _read(out)
    assert rec["format"] == 1 and rec["rounds_done"] == 2
    started, ended = (time.mktime(time.strptime(rec[k][:19], "%Y-%m-%dT%H:%M:%S")) for k in ("started", "ended"))
    assert 0 <= ended - started < 600

    # the code: fedhpc's version, and the commit and state of the checkout it was imported from
    head = _git("rev-parse", "HEAD")  # HEAD before and after the run: someone may commit meanwhile
    assert rec["fedhpc"]["version"] == fedhpc.__version__
    assert rec["fedhpc"]["commit"] in (before, head) and rec["fedhpc"]["path"] == os.path.join(REPO, "fedhpc")
    if head is None:  # a copy of the tree without .git: unknown, not a failed run
        assert rec["fedhpc"]["dirty"] is None and rec["fedhpc"]["tree_dirty"] is None
    else:
        assert isinstance(rec["fedhpc"]["dirty"], bool) and isinstance(rec["fedhpc"]["tree_dirty"], bool)
        assert (rec["fedhpc"]["diff_sha1"] is not None) == rec["fedhpc"]["dirty"]

    # the libraries; no MPI without an MPI launcher
    v = rec["versions"]
    assert v["torch"] == torch.__version__ and v["cuda"] == torch.version.cuda
    assert v["python"] == ".".join(map(str, sys.version_info[:3])) and v["mpi"] is None and v["mpi4py"] is None

    # launched how, on what
    la = rec["launch"]
    assert la["launcher"] == "single process" and la["ranks"] == 1 and la["backend"] == "none"
    assert la["hosts"] == [socket.gethostname()]
    assert la["per_rank"][0]["threads"] == 1 and la["per_rank"][0]["device"] == "cpu"
    assert rec["command"]["argv"][1:] == ARGS + ["--out", out]
    assert rec["command"]["orig_argv"][1:3] == ["-m", "fedhpc.launch"] and rec["command"]["cwd"] == REPO

    # the settings as resolved: no 'auto' left; config.yaml keeps them as given (resume compares those)
    cfg = rec["config"]
    assert _autos(cfg) == [], _autos(cfg)
    given = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert given["model"] == given["partition"] == given["device"] == "auto" and given["threads"] == 1
    assert cfg["partition"] == "iid" and cfg["device"] == "cpu" and cfg["threads"] == 1
    assert cfg["collective_backend"] == "none" and cfg["rounds"] == 2 and cfg["algo"] == "fedavg"
    # the model recorded is the one whose weights final_model.pt holds
    from fedhpc.models import build_model
    state = torch.load(os.path.join(out, "final_model.pt"))
    build_model(cfg["model"], (1, 8, 8), 10, cfg["model_options"]).load_state_dict(state)
    # every option with the default the run used (config.yaml holds them as given: none)
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    load_algorithm_modules()
    assert given["algo_options"] == {}
    assert cfg["algo_options"]["server_lr"] == ALGORITHMS.get("fedavg").Options().server_lr
    assert rec["earlier_launches"] == []

    # a resumed run: the launch before it kept, newest on top
    p = launch(ARGS[:-1] + ["4", "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    again = _read(out)
    assert again["rounds_done"] == 4 and len(again["earlier_launches"]) == 1
    first = again["earlier_launches"][0]
    assert first["started"] == rec["started"] and first["rounds_done"] == 2 and first["fedhpc"] == rec["fedhpc"]
    assert again["command"]["argv"][-1] == "--resume" and again["config"]["rounds"] == 4


def test_two_ranks_under_mpiexec_record_each_rank_and_the_mpi_library(tmp_path):
    out = str(tmp_path / "run")
    before = _git("rev-parse", "HEAD")
    p = launch(ARGS + ["--out", out], ranks=2)
    assert p.returncode == 0, p.stderr
    rec = _read(out)
    la = rec["launch"]
    assert la["launcher"] == "mpiexec" and la["ranks"] == 2 and la["backend"] == "gloo"
    assert la["hosts"] == [socket.gethostname()] * 2 and la["nodes"] == 1
    assert [r["rank"] for r in la["per_rank"]] == [0, 1] and len({r["pid"] for r in la["per_rank"]}) == 2
    assert all(r["threads"] == 1 and r["device"] == "cpu" for r in la["per_rank"])
    from mpi4py import MPI  # the library this venv's mpi4py runs on: the one the ranks ran on
    import mpi4py
    assert rec["versions"]["mpi_library"] == MPI.Get_library_version().strip().replace("\0", "")
    assert rec["versions"]["mpi"] and rec["versions"]["mpi"] in " ".join(rec["versions"]["mpi_library"].split())
    assert rec["versions"]["mpi4py"] == mpi4py.__version__
    assert _autos(rec["config"]) == [] and rec["config"]["collective_backend"] == "gloo"
    assert rec["fedhpc"]["commit"] in (before, _git("rev-parse", "HEAD"))


def _commit(repo, *extra):
    subprocess.run(["git", "-C", str(repo), *extra], check=True, capture_output=True)


def test_git_state_of_a_checkout_and_of_what_is_none(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    pkg = repo / "pkg"
    pkg.mkdir(parents=True)
    (repo / "csrc").mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (repo / "csrc" / "ops.cpp").write_text("int f();\n")
    (repo / "notes.txt").write_text("o\n")
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    _commit(repo, "init", "-q")
    _commit(repo, "add", "pkg/a.py", "csrc/ops.cpp", "notes.txt")
    _commit(repo, *ident, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    state = lambda: git_state(str(pkg), also=("csrc",))  # noqa: E731
    assert state() == {"commit": head, "dirty": False, "diff_sha1": None, "tree_dirty": False}

    (repo / "notes.txt").write_text("changed\n")  # not code: the tree is dirty, the code is not
    assert state() == {"commit": head, "dirty": False, "diff_sha1": None, "tree_dirty": True}
    (repo / "notes.txt").write_text("o\n")
    (pkg / "a.py").write_text("x = 2\n")  # the code changed: dirty, with a digest of the change
    one = state()
    assert one["commit"] == head and one["dirty"] is True and one["tree_dirty"] is True and len(one["diff_sha1"]) == 40
    (pkg / "a.py").write_text("x = 3\n")  # another dirty tree: another digest
    two = state()
    assert two["dirty"] is True and two["diff_sha1"] != one["diff_sha1"]
    (pkg / "a.py").write_text("x = 1\n")
    (repo / "csrc" / "ops.cpp").write_text("int g();\n")  # the native ops' sources are code too
    assert state()["dirty"] is True and git_state(str(pkg))["dirty"] is False
    (repo / "csrc" / "ops.cpp").write_text("int f();\n")
    (pkg / "new_method.py").write_text("y = 2\n")  # an untracked module in the package is code too
    three = state()
    assert three["dirty"] is True and three["diff_sha1"] not in (one["diff_sha1"], two["diff_sha1"])
    (pkg / "new_method.py").unlink()
    (repo / "scratch.txt").write_text("untracked outside the code\n")
    assert state()["dirty"] is False

    # a folder git does not track, inside someone's checkout (a virtual environment): unknown
    unknown = {"commit": None, "dirty": None, "diff_sha1": None, "tree_dirty": None}
    venv = repo / "venv" / "fedhpc"
    venv.mkdir(parents=True)
    (venv / "a.py").write_text("x = 1\n")
    assert git_state(str(venv)) == unknown
    outside = tmp_path / "plain"
    outside.mkdir()
    assert git_state(str(outside)) == unknown
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no git at all: unknown, no error
    assert git_state(str(pkg)) == unknown


def test_code_versions_name_commit_and_dirty_state():
    assert code_version(None) is None
    assert code_version({"version": "0.1.0", "commit": None}) == "0.1.0 (no git checkout)"
    clean = {"version": "0.1.0", "commit": "e9b957d23ae48c1b3bbe325a", "dirty": False}
    assert code_version(clean) == "0.1.0 e9b957d23ae4"
    dirty = {**clean, "dirty": True, "diff_sha1": "711362b0fbe0c29196"}
    assert code_version(dirty) == "0.1.0 e9b957d23ae4 dirty 711362b0"
    assert code_versions({"fedhpc": dirty, "earlier_launches": [{"fedhpc": clean}, {"fedhpc": clean}]}) == [
        "0.1.0 e9b957d23ae4", "0.1.0 e9b957d23ae4 dirty 711362b0"]


def test_the_partition_auto_stands_for_is_the_datasets_and_the_record_costs_well_under_a_second():
    from fedhpc.config import RunConfig

    assert resolved_partition("auto", "digits") == "iid"
    assert resolved_partition("auto", "femnist") == "natural"  # naturally federated: one client per writer
    assert resolved_partition("Dirichlet:.50", "digits") == "dirichlet:0.5"
    assert resolved_partition("auto", "femnist", SimpleNamespace(meta={"partition": "iid"})) == "iid"  # a store's

    cfg = RunConfig(quiet=True)
    world = SimpleNamespace(rank=0, size=1, local_rank=0, launcher="single", backend="gloo",
                            device=torch.device("cpu"), threads=1)
    ranks = [{"rank": 0, "host": "h", "pid": 1, "local_rank": 0, "device": "cpu", "gpu": None, "threads": 1}]
    start_record(cfg, world, ranks, "cnn")  # imports paid once, as the engine has paid them by then
    t0 = time.perf_counter()
    rec = start_record(cfg, world, ranks, "cnn", previous={"started": "then", "fedhpc": {"version": "0"}})
    assert time.perf_counter() - t0 < 0.5
    assert rec["config"]["model"] == "cnn" and rec["config"]["threads"] == 1
    assert rec["earlier_launches"][0]["started"] == "then"
