"""The command line and what a run shows and leaves: no abbreviated flags, --version, one-line type
errors, the default run folder, the per-round ETA, grouped TensorBoard tags, the SLURM signal-margin
warning, the native ops' build note and a local sweep's progress."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import fedhpc
from conftest import REPO, clean_env, mpiexec
from fedhpc.config import parse_args
from fedhpc.errors import ConfigError
from fedhpc.launch import default_run_folder, main

TINY = ["--rounds", "3", "--num-clients", "4", "--clients-per-round", "2", "--model", "mlp", "--threads", "1",
        "--no-tensorboard"]


def run_main(argv, capsys):
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, near", [(["--round", "5"], "--rounds"), (["--conf", "x.yaml"], "--config"),
                                        (["--algo", "fedprox", "--m", "0.1"], "--mu")])
def test_an_abbreviated_flag_is_refused_not_taken_for_the_full_one(argv, near, capsys):
    with pytest.raises(ConfigError):
        parse_args(argv)
    code, out, err = run_main(argv + ["--quiet"], capsys)
    assert code == 2 and err.startswith(f"error: unrecognized argument(s) {argv[-2]}") and err.count("\n") == 1
    assert f"did you mean {near}?" in err or near in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fedhpc {fedhpc.__version__}"
    with pytest.raises(SystemExit):  # before a broken --config is read
        main(["--config", "no/such.yaml", "--version"])
    assert capsys.readouterr().out.strip() == f"fedhpc {fedhpc.__version__}"


@pytest.mark.parametrize("argv, yaml_text, expected", [
    (["--rounds", "1.5"], "rounds: 1.5\n", "--rounds must be"),
    (["--rounds", "many"], "rounds: many\n", "--rounds must be of type int, got 'many'; give a whole number, e.g. --rounds 20"),
    (["--lr", "fast"], "lr: fast\n", "--lr must be of type float, got 'fast'; give a number, e.g. --lr 0.05"),
    (["--nesterov=maybe"], "nesterov: maybe\n", "--nesterov"),
])
def test_a_wrong_type_is_one_line_naming_the_problem_and_the_fix(argv, yaml_text, expected, capsys, tmp_path):
    """argparse printed its whole usage (30 lines) before a type error; a file's key says the same."""
    code, out, err = run_main(argv + ["--quiet"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "usage:" not in err and out == ""
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    code, _, err = run_main(["--config", str(path), "--quiet"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err


def test_argparse_problems_are_one_line_too(capsys):
    code, _, err = run_main(["--config"], capsys)
    assert code == 2 and err == "error: --config expected one argument; python -m fedhpc.launch --help lists the flags\n"


# ----------------------------------------------------------------------------- the run folder

def test_a_run_without_out_writes_to_a_default_folder_named_on_the_first_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(TINY, capsys)
    assert code == 0, err
    (name,) = os.listdir(tmp_path / "runs")
    assert re.fullmatch(r"fedavg_digits_\d{8}-\d{6}", name)
    first = out.splitlines()[0]
    assert first == (f"fedhpc: writing to runs/{name} (no --out given; --out DIR chooses the folder, --no-out "
                     f"writes nothing)")
    run = tmp_path / "runs" / name
    assert (run / "final_model.pt").exists() and len((run / "metrics.jsonl").read_text().splitlines()) == 3
    # the same second again: another folder, not a refusal to overwrite
    cfg = SimpleNamespace(algo="fedavg", dataset="digits")
    stamp = os.path.getmtime(run)
    assert default_run_folder(cfg, now=stamp) != default_run_folder(cfg, now=stamp + 3600)
    os.makedirs(default_run_folder(cfg, now=0))
    assert default_run_folder(cfg, now=0).endswith("-2")


@pytest.mark.parametrize("opt_out", [["--no-out"], ["--out", "none"], ["--out", "None"], "yaml"])
def test_the_default_folder_can_be_declined(opt_out, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if opt_out == "yaml":
        (tmp_path / "c.yaml").write_text("out: none\nrounds: 1\n")
        opt_out = ["--config", "c.yaml"]
    code, out, err = run_main(TINY + ["--quiet"] + opt_out, capsys)
    assert code == 0, err
    assert os.listdir(tmp_path) in ([], ["c.yaml"]), "nothing written"


def test_resume_and_out_conflicts_still_need_an_explicit_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(TINY + ["--resume"], capsys)
    assert code == 2 and "--resume needs --out" in err
    code, _, err = run_main(TINY + ["--no-out", "--out", "x"], capsys)
    assert code == 2 and "--no-out writes nothing but --out x names a folder" in err
    assert os.listdir(tmp_path) == []


RANKED_FOLDERS = """
import os, sys
import fedhpc.launch as launch
real = launch.default_run_folder
# each rank reads its own clock, and two ranks may straddle a second: here they always differ
launch.default_run_folder = lambda cfg, now=None: real(cfg) + "-rank" + os.environ["PMI_RANK"]
launch.exit_now(launch.main(sys.argv[1:]))
"""


def test_two_ranks_agree_on_the_default_folder(tmp_path):
    """Each rank names a folder from its own clock: they must still write one folder, rank 0's."""
    probe = tmp_path / "probe.py"
    probe.write_text(RANKED_FOLDERS)
    # fedper: every rank writes its clients' states into the checkpoint
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(probe), *TINY, "--algo", "fedper"], cwd=str(tmp_path),
                       env=clean_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    (name,) = os.listdir(tmp_path / "runs")
    assert name.endswith("-rank0") and p.stdout.count(f"fedhpc: writing to runs/{name} ") == 1
    assert (tmp_path / "runs" / name / "final_model.pt").exists()
    shards = tmp_path / "runs" / name / "checkpoints" / "round_000003" / "client_state"
    assert sorted(os.listdir(shards)) == ["rank0", "rank1"], "both ranks' clients in the one folder"
    assert "2 rank(s) via mpi" in p.stdout


# ----------------------------------------------------------------------------- what a run shows

def test_the_round_line_shows_elapsed_time_and_an_eta(capsys):
    code, out, err = run_main(TINY + ["--no-out"], capsys)
    assert code == 0, err
    lines = [l for l in out.splitlines() if l.startswith("round ")]
    assert len(lines) == 3
    for line in lines[:-1]:
        assert re.search(r" \| elapsed \d+\.\d s, ETA \d+\.\d s$", line), line
    assert re.search(r" \| elapsed \d+\.\d s$", lines[-1]), lines[-1]


def test_duration_format():
    from fedhpc.run_log import duration

    assert [duration(s) for s in (0.04, 9.96, 42.4, 185, 7620)] == ["0.0 s", "10.0 s", "42 s", "3 min 05 s",
                                                                    "2 h 07 min"]


# Every metric a Mix2FLD run with cold-start clients and --final-adapt logs (38 flat tags before), and
# the tag each one has now.
MIX2FLD_TAGS = {
    "test_accuracy": "test/accuracy", "test_loss": "test/loss", "train_loss": "train/loss", "lr": "train/lr",
    "clients": "train/clients", "relative_change": "train/relative_change",
    "bytes_up": "comm/bytes_up", "bytes_down": "comm/bytes_down", "bytes_up_total": "comm/bytes_up_total",
    "bytes_down_total": "comm/bytes_down_total", "bytes_up_parameters": "comm/bytes_up_parameters",
    "bytes_down_parameters": "comm/bytes_down_parameters", "bytes_up_outputs": "comm/bytes_up_outputs",
    "bytes_down_outputs": "comm/bytes_down_outputs", "bytes_up_seeds": "comm/bytes_up_seeds",
    "bytes_down_seeds": "comm/bytes_down_seeds",
    "uplink_outages": "channel/uplink_outages", "downlink_outages": "channel/downlink_outages",
    "comm_seconds": "channel/comm_seconds", "compute_seconds": "channel/compute_seconds",
    "sim_round_seconds": "channel/sim_round_seconds", "sim_seconds_total": "channel/sim_seconds_total",
    "round_seconds": "time/round_seconds", "round_seconds_total": "time/round_seconds_total",
    "eval_seconds": "time/eval_seconds",
    "local_test_accuracy": "local/accuracy", "local_test_accuracy_mean": "local/accuracy_mean",
    "local_test_accuracy_std": "local/accuracy_std", "local_test_accuracy_worst10": "local/accuracy_worst10",
    "local_test_accuracy_adapted_mean": "local/accuracy_adapted_mean",
    "reference_device_accuracy": "local/reference_device_accuracy",
    "cold_start_accuracy": "cold_start/accuracy", "cold_start_accuracy_mean": "cold_start/accuracy_mean",
    "cold_start_clients": "cold_start/clients", "participation_gap": "cold_start/participation_gap",
    "seeds_uploaded": "server/seeds_uploaded", "seeds_delivered": "server/seeds_delivered",
    "server_samples": "server/samples", "sample_privacy_server": "privacy/sample_privacy_server",
    "seeds_leaking_raw": "privacy/seeds_leaking_raw",
    "test_accuracy_label3": "test/accuracy_label3", "mu_aggregation": "algo/mu_aggregation",
}


def test_metric_names_map_to_grouped_tags():
    from fedhpc.report.tensorboard import tensorboard_tag

    assert {m: tensorboard_tag(m) for m in MIX2FLD_TAGS} == MIX2FLD_TAGS
    assert len(set(MIX2FLD_TAGS.values())) == len(MIX2FLD_TAGS), "two metrics on one tag"


def test_a_mix2fld_run_writes_grouped_tags_and_no_hparams_duplicates(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    code, _, err = run_main(["--config", os.path.join(REPO, "launch", "mix2fld_digits.yaml"), "--rounds", "2",
                             "--threads", "1", "--quiet", "--cold-start-fraction", "0.1", "--out", str(out)], capsys)
    assert code == 0, err
    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    logged = {k for line in open(out / "metrics.jsonl") for k, v in json.loads(line).items()
              if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    from fedhpc.report.tensorboard import tensorboard_tag
    assert tags == {tensorboard_tag(k) for k in logged}, "every metric once, under its tag"
    assert {"test/accuracy", "train/loss", "comm/bytes_up_parameters", "channel/uplink_outages",
            "local/accuracy_mean", "cold_start/accuracy"} <= tags
    assert {t.split("/")[0] for t in tags} <= {"test", "train", "local", "cold_start", "comm", "channel", "time",
                                               "server", "privacy", "algo"}
    assert not any(t.startswith("hparams/") for t in tags)
    # metrics.jsonl keeps the metric names the report reads
    assert {"test_accuracy", "bytes_up_parameters", "uplink_outages"} <= logged


# ----------------------------------------------------------------------------- SLURM's signal margin

def test_the_signal_margin_warning_names_the_sbatch_setting_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDHPC_SIGNAL_MARGIN_S", "0.000001")
    code, _, err = run_main(TINY + ["--rounds", "4", "--quiet", "--checkpoint-every", "1",
                                    "--out", str(tmp_path / "a")], capsys)
    assert code == 0 and err.count("warning:") == 1, err
    assert "between SLURM's warning signal and the time limit (FEDHPC_SIGNAL_MARGIN_S)" in err
    assert "`#SBATCH --signal=B:USR1@60` and FEDHPC_SIGNAL_MARGIN_S=60" in err
    for margin in ("3600", "", "soon"):  # room enough, unset, unreadable: nothing to say
        monkeypatch.setenv("FEDHPC_SIGNAL_MARGIN_S", margin)
        code, _, err = run_main(TINY + ["--quiet", "--checkpoint-every", "1", "--out", str(tmp_path / f"b{margin}")],
                                capsys)
        assert code == 0 and "warning" not in err, err


def test_margin_warning_sums_round_and_checkpoint():
    from fedhpc.run_log import margin_warning, signal_margin

    text = margin_warning(120, 7, 100.0, 50.0)
    assert text.startswith("round 7 took 100 s and a checkpoint took 50 s (150 s together), more than the 120 s")
    assert "--signal=B:USR1@240" in text and "signal_seconds: 240" in text
    assert margin_warning(120, 1, None, 200.0).startswith("a checkpoint took 200 s, more than")
    assert [signal_margin({"FEDHPC_SIGNAL_MARGIN_S": v}) for v in ("120", "0", "-5", "x", "inf")] == [
        120.0, None, None, None, None]


def test_the_slurm_scripts_set_the_margin_beside_their_signal():
    for script in ("run.sbatch", "run_gpu.sbatch"):
        text = open(os.path.join(REPO, "slurm", script)).read()
        seconds = re.search(r"#SBATCH --signal=B:USR1@(\d+)", text).group(1)
        assert f"export FEDHPC_SIGNAL_MARGIN_S=${{FEDHPC_SIGNAL_MARGIN_S:-{seconds}}}" in text
    from fedhpc.sweep.slurm import SlurmOptions, render_array_script

    script = render_array_script("g", ["a"], 1, SlurmOptions(signal_seconds=300), "/s", "/w")
    assert "#SBATCH --signal=B:USR1@300" in script and "export FEDHPC_SIGNAL_MARGIN_S=300 " in script


def test_the_recommended_gpu_layout_gives_each_rank_its_own_gpu():
    """slurm/run_gpu.sbatch: --gpus-per-node=G, --gpu-bind=none, G tasks per node. Every task sees the
    node's G GPUs and takes cuda:SLURM_LOCALID: distinct GPUs, so NCCL (not gloo through host memory)."""
    from fedhpc.layout import agree_backend, gpu_layout

    text = open(os.path.join(REPO, "slurm", "run_gpu.sbatch")).read()
    per_node = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    tasks = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
    assert tasks == per_node and "#SBATCH --gpu-bind=none" in text
    env = {"SLURM_GPUS_ON_NODE": str(per_node), "SLURM_GPU_BIND": "none"}
    ranks, gpus = gpu_layout(env, "srun", tasks, tasks, visible=per_node)
    assert ranks <= gpus
    devices = [local % per_node for local in range(tasks)]  # World: cuda:(local_rank % visible)
    assert len(set(devices)) == tasks
    views = [{"host": f"n{r // tasks}", "cuda": True, "gpu": f"GPU-{r // tasks}-{devices[r % tasks]}",
              "ranks": ranks, "gpus": gpus} for r in range(2 * tasks)]
    assert agree_backend(views) == ("nccl", "")
    assert agree_backend([{**v, "gpu": None} for v in views]) == ("nccl", ""), "without UUIDs, from the counts"


# ----------------------------------------------------------------------------- native ops, sweeps

def test_a_first_run_time_build_of_the_native_ops_says_so(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    from fedhpc.ops import _loader, _sources

    built = []

    def fake_load(name, sources, build_directory, **kw):
        built.append(build_directory)
        return SimpleNamespace(abi_version=_loader.ABI_VERSION, with_cuda=False, __file__="x.so")

    monkeypatch.setattr(_sources, "REPO", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(_loader.shutil, "which", lambda c: "/usr/bin/c++")
    module, why = _loader._jit("abc")
    assert module is not None and why == ""
    err = capsys.readouterr().err
    assert re.match(r"fedhpc\.ops: compiling fedhpc's native ops once \(about [15] min", err) and "compiled" in err
    open(os.path.join(built[0], f"{_sources.JIT_NAME}.so"), "w").close()  # what a build leaves
    assert _loader._jit("abc")[0] is not None and capsys.readouterr().err == "", "a reused build says nothing"
    monkeypatch.setenv("PMI_RANK", "1")
    os.remove(os.path.join(built[0], f"{_sources.JIT_NAME}.so"))
    _loader._jit("abc")
    assert capsys.readouterr().err == "", "rank 0 alone speaks"


def test_a_local_sweep_shows_points_done_an_eta_and_a_running_points_round(tmp_path, monkeypatch):
    from fedhpc.sweep import local

    clock = [0.0]
    monkeypatch.setattr(local, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def fake_run_point(cmd, run_dir, log, waiting, every):
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"round": 1, "train_loss": 1.0}) + "\n")
        clock[0] += every
        waiting()
        waiting()  # no new round: nothing said
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"round": 2, "test_accuracy": 0.5}) + "\n")
        clock[0] += 10.0
        return 0

    monkeypatch.setattr(local, "run_point", fake_run_point)
    monkeypatch.setattr(local, "mpiexec_path", lambda: "mpiexec")
    said = []
    todo = [(SimpleNamespace(id=f"p{i}", rounds=2), SimpleNamespace(last_round=0)) for i in range(3)]
    assert local.run_points(todo, 1, str(tmp_path), say=said.append, every=30.0) == 0
    assert said[1] == "      round 1/2, 30 s on this point"
    assert said[2] == "      done: test_accuracy 0.5000, 40.0 s; 1/3 points done, ETA 1 min 20 s"
    assert said[5] == "      done: test_accuracy 0.5000, 40.0 s; 2/3 points done, ETA 40 s"
    assert said[-1] == "      done: test_accuracy 0.5000, 40.0 s; 3/3 points done in 2 min 00 s"
