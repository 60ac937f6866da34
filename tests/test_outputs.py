"""What --out holds after a run, and the SIGUSR1 (SLURM warning) path."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import FAST, REPO, clean_env, launch

REQUIRED = {"round", "test_accuracy", "test_loss", "train_loss", "bytes_up", "bytes_down", "round_seconds",
            "eval_seconds"}


def test_run_outputs(tmp_path):
    out = str(tmp_path / "run")
    args = [a for a in FAST if a != "--no-tensorboard"] + ["--eval-every", "2", "--rounds", "5"]
    p = launch(args + ["--out", out])
    assert p.returncode == 0, p.stderr
    every = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["round"] for r in every] == [1, 2, 3, 4, 5], "every round, evaluated or not"
    for r in every:  # a round off the --eval-every grid keeps what it has: its training metrics
        assert {"train_loss", "bytes_up", "round_seconds", "lr"} <= r.keys() and r["train_loss"] > 0
    assert [r["round"] for r in every if "test_accuracy" in r] == [2, 4, 5], "evaluated: every 2nd and the last"
    recs = [r for r in every if "test_accuracy" in r]
    for r in recs:
        assert REQUIRED <= r.keys()
        assert 0 <= r["test_accuracy"] <= 1 and r["round_seconds"] > 0 and r["eval_seconds"] > 0
    assert not {"eval_seconds", "test_loss"} & (every[0].keys() | every[2].keys())
    # bytes: 4 clients per round each download and upload the whole model (float32)
    sd = torch.load(os.path.join(out, "final_model.pt"))
    nbytes = 4 * sum(v.numel() for v in sd.values())
    assert recs[0]["bytes_up"] == recs[0]["bytes_down"] == 4 * nbytes
    assert recs[-1]["bytes_up_total"] == 5 * 4 * nbytes
    cfg = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert cfg["rounds"] == 5 and cfg["model"] == "mlp" and cfg["algo"] == "fedavg"
    from fedhpc.models import build_model
    build_model("mlp", (1, 8, 8), 10).load_state_dict(sd)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(os.path.join(out, "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"test/accuracy", "train/loss", "comm/bytes_up", "time/round_seconds"} <= tags
    assert all("/" in t and not t.startswith("hparams/") for t in tags), tags
    assert [s.step for s in ev.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [s.step for s in ev.Scalars("test/accuracy")] == [2, 4, 5]


def signal_a_long_run(out, signum, checkpoint_every, after_records):
    """Start a 400-round run, send ``signum`` once metrics.jsonl holds ``after_records`` lines;
    returns (exit code, stderr)."""
    args = FAST[:]
    args[args.index("--rounds") + 1] = "400"
    # A suite started in the background (`nohup ... &`, some CI runners) hands its children SIGINT
    # ignored, and Python then never raises KeyboardInterrupt: the run would finish its 400 rounds.
    # The child gets the disposition a terminal's job has.
    proc = subprocess.Popen([sys.executable, "-m", "fedhpc.launch", *args, "--out", out, "--checkpoint-every",
                             str(checkpoint_every)],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(path) and sum(1 for _ in open(path)) >= after_records):
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_sigusr1_checkpoints_and_exits_75(tmp_path):
    out = str(tmp_path / "run")
    code, err = signal_a_long_run(out, signal.SIGUSR1, 0, 1)
    assert code == 75, err
    done = int(open(os.path.join(out, "checkpoints", "LATEST")).read().split("_")[1])
    assert 1 <= done < 400
    assert sum(1 for _ in open(os.path.join(out, "metrics.jsonl"))) == done


def test_ctrl_c_says_the_last_checkpoint_is_intact_and_how_to_continue(tmp_path):
    out = str(tmp_path / "run")
    code, err = signal_a_long_run(out, signal.SIGINT, 2, 3)
    assert code == 130, err
    assert f"interrupted; the last checkpoint in {out}/checkpoints is intact: continue with the same " \
           f"command plus --resume" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_an_out_that_cannot_be_a_directory_is_refused_before_anything_runs(tmp_path, where):
    blocker = tmp_path / "results.txt"
    blocker.write_text("someone's notes")
    out = str(blocker) if where == "file" else str(blocker / "run")
    p = launch(FAST + ["--out", out])
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"error: --out {out} ") and "choose another --out" in p.stderr, p.stderr
    assert "fedhpc:" not in p.stdout  # refused before the data and the model were built
    assert blocker.read_text() == "someone's notes"


def test_a_config_error_under_mpiexec_is_printed_once(tmp_path):
    p = launch(FAST + ["--out", str(tmp_path / "run"), "--batch-size", "0"], ranks=2)
    assert p.returncode == 2
    assert p.stderr.count("error:") == 1, p.stderr


def test_outputs_are_as_readable_as_any_file_the_user_writes(tmp_path):
    """mkstemp's 0600 hid results from the colleagues a cluster group shares them with."""
    from fedhpc.io import atomic_torch_save, atomic_write_text
    plain = tmp_path / "plain"
    plain.write_text("x")
    atomic_write_text(str(tmp_path / "metrics.jsonl"), "{}\n")
    atomic_torch_save({"w": torch.zeros(2)}, str(tmp_path / "final_model.pt"))
    for name in ("metrics.jsonl", "final_model.pt"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    import errno

    from fedhpc import io as fio
    from fedhpc.errors import OutputError
    path = tmp_path / "checkpoints" / "server.pt"
    fio.atomic_torch_save({"round": 1}, str(path))

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fio.os, "fsync", full)
    with pytest.raises(OutputError, match=rf"cannot write {path}: No space left on device; free space"):
        fio.atomic_torch_save({"round": 2}, str(path))
    monkeypatch.undo()
    assert torch.load(str(path)) == {"round": 1}
    assert os.listdir(path.parent) == ["server.pt"]  # no temporary file left behind


def test_a_rename_into_place_is_synced_in_its_directory(tmp_path, monkeypatch):
    """os.replace changes only the directory entry: until the directory is synced, a node losing
    power after a checkpoint could come back to the old LATEST. Each write syncs the file's data
    before the rename and the directory after it (what the log records at each fsync: a file or
    the directory, and whether the new name was in place)."""
    import stat

    from fedhpc import io as fio
    target = tmp_path / "out" / "LATEST"
    log, expected = [], ["round_2\n"]
    real_fsync = os.fsync

    def fsync(fd):
        log.append(("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file",
                    target.exists() and target.read_text() == expected[0]))
        real_fsync(fd)

    fio.atomic_write_text(str(target), "round_1\n")
    monkeypatch.setattr(fio.os, "fsync", fsync)
    fio.atomic_write_text(str(target), "round_2\n")
    assert log == [("file", False), ("dir", True)]

    log.clear()  # a file a library wrote without syncing (an h5py store) goes in the same way
    tmp = tmp_path / "out" / "store.h5.tmp"
    tmp.write_text("round_3\n")
    expected[0] = "round_3\n"
    fio.durable_replace(str(tmp), str(target))
    assert log == [("file", False), ("dir", True)] and not tmp.exists()


def test_more_threads_than_cores_is_warned_about(tmp_path):
    cores = len(os.sched_getaffinity(0))
    args = FAST[:] + ["--no-out"]
    args[args.index("--rounds") + 1] = "1"
    args[args.index("--threads") + 1] = str(cores + 1)
    p = launch(args)
    assert p.returncode == 0, p.stderr
    assert f"warning: {cores + 1} thread(s) per rank x 1 rank(s) on this node exceed its {cores} core(s)" in p.stderr
    args[args.index("--threads") + 1] = str(cores)
    assert "exceed" not in launch(args).stderr


def test_the_final_line_leads_with_the_model_the_method_ends_with():
    """A global model: its test accuracy; clients that kept models of their own (personal methods):
    also their mean accuracy on their splits, the personalised papers' metric; a global model whose
    personal layers stayed initial (FedPer, LG-FedAvg): the clients' own models first; no global
    model (FD): the devices' own models first, and it says why there is no test accuracy."""
    from types import SimpleNamespace

    from fedhpc.run_log import RunLog

    run = SimpleNamespace(stop_round=7, reference_device=4, cfg=SimpleNamespace(algo="pmixfed"))
    glob = {"test_accuracy": 0.91234, "test_loss": 0.25, "local_test_accuracy_mean": 0.8}
    assert RunLog._final_line(run, glob) == "final test accuracy 0.9123 (test loss 0.2500) after 7 rounds"
    personal = {**glob, "local_test_accuracy_mean": 0.95678, "local_test_accuracy_global_model": 0.7,
                "reference_device_accuracy": 0.5}
    assert RunLog._final_line(run, personal) == (
        "final test accuracy 0.9123 (test loss 0.2500) after 7 rounds; clients' own models on their splits: "
        "mean accuracy 0.9568; reference device 4: accuracy 0.5000")
    # a partial personal method: the global state's personal layers are the initial ones
    run.algo = SimpleNamespace(global_model_is_partial=True)
    assert RunLog._final_line(run, personal) == (
        "final mean accuracy of the clients' own models 0.9568 (their local splits) after 7 rounds; the global "
        "model (trained shared part, initial personal part): test accuracy 0.9123; reference device 4: "
        "accuracy 0.5000")
    del run.algo
    run.cfg.algo = "fd"
    fd_final = {"local_test_accuracy_mean": 0.85, "reference_device_accuracy": 0.72, "sim_seconds_total": 1.5}
    run.channel = SimpleNamespace(models_compute=lambda: False)
    assert RunLog._final_line(run, fd_final) == (
        "final mean accuracy of the devices' own models 0.8500 (their local splits) after 7 rounds; fd trains no "
        "global model; reference device 4: accuracy 0.7200, convergence time 1.50 s (simulated channel + "
        "measured compute)")
    # the channel's per-sample rates (the launch files'), not this machine's clock
    run.channel = SimpleNamespace(models_compute=lambda: True)
    assert RunLog._final_line(run, fd_final).endswith("convergence time 1.50 s (simulated channel + compute model)")
    run.stop_round = 1  # a one-shot run: "1 round"
    assert RunLog._final_line(run, fd_final).startswith(
        "final mean accuracy of the devices' own models 0.8500 (their local splits) after 1 round; fd trains")
