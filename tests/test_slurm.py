"""slurm/ and the sweep's array jobs, run here with stand-in sbatch / srun / scontrol that record the
arguments and environment they receive (and srun really starts the ranks, on this machine)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time

import yaml

from conftest import REPO, clean_env
from fedhpc.sweep import expand, load_grid, run_state
from fedhpc.sweep.cli import main as sweep_main

FAKE_SRUN = f"""#!{sys.executable}
# Stand-in srun: records its options, command and rendezvous variables, then runs SLURM_NTASKS
# tasks here with the variables a real step gets. node01... do not resolve on this machine, so the
# tasks meet on 127.0.0.1 instead of the MASTER_ADDR the batch script chose (that one is recorded).
import json, os, socket, subprocess, sys
args = sys.argv[1:]
opts = []
while args and args[0].startswith("--"):
    opts.append(args.pop(0))
env = os.environ
with open(os.path.join(env["FAKE_SLURM_DIR"], "srun.log"), "a") as f:
    f.write(json.dumps({{"opts": opts, "cmd": args, "env": {{k: env.get(k) for k in
             ("MASTER_ADDR", "MASTER_PORT", "SLURM_CPUS_PER_TASK", "FEDHPC_PYTHON")}}}}) + "\\n")
if env.get("FAKE_SRUN") == "record":
    sys.exit(int(env.get("FAKE_SRUN_EXIT", "0")))
n = int(env.get("SLURM_NTASKS", "1"))
if n == 1:
    os.execvp(args[0], args)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS=str(n),
                                         SLURM_STEP_NODELIST=env["SLURM_JOB_NODELIST"],
                                         SLURM_STEP_TASKS_PER_NODE="1(x%d)" % n,
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
         for i in range(n)]
sys.exit(max((p.wait() for p in procs), key=abs))
"""

FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$FAKE_SLURM_DIR/scontrol.log"
if [ "$1 $2" = "show hostnames" ]; then
    [ -z "${FAKE_SCONTROL_NO_SHOW:-}" ] || exit 1
    case "$3" in
        "node[01-02]") printf 'node01\\nnode02\\n' ;;
        *) echo "stand-in scontrol does not know $3" >&2; exit 1 ;;
    esac
fi
"""

FAKE_SBATCH = """#!/bin/bash
echo "$@" >> "$FAKE_SLURM_DIR/sbatch.log"
echo 4242
"""


def _fake_bin(tmp_path):
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH)):
        (b / name).write_text(text)
        (b / name).chmod((b / name).stat().st_mode | stat.S_IEXEC)
    return str(b) + os.pathsep + os.environ["PATH"]


def _srun_calls(tmp_path):
    return [json.loads(l) for l in (tmp_path / "srun.log").read_text().splitlines()]


def _sbatch_lines(text):
    return [l for l in text.splitlines() if l.startswith("#SBATCH ")]


def test_run_sbatch_requeues_after_the_warning_signal(tmp_path):
    env = clean_env(PATH=_fake_bin(tmp_path), FEDHPC_PYTHON=sys.executable, FAKE_SLURM_DIR=str(tmp_path),
                    SLURM_JOB_ID="77", SLURM_JOB_NAME="t", SLURM_SUBMIT_DIR=REPO, OUT=str(tmp_path / "run"))
    p = subprocess.Popen(["bash", "slurm/run.sbatch", "--rounds", "400", "--num-clients", "8", "--clients-per-round",
                          "4", "--model", "mlp", "--quiet", "--no-tensorboard", "--checkpoint-every", "0"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does to the batch shell
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, out + err
    assert "requeue 77" in (tmp_path / "scontrol.log").read_text()
    assert (tmp_path / "run" / "checkpoints" / "LATEST").exists()
    assert json.loads((tmp_path / "run" / "status.json").read_text())["exit_code"] == 75
    assert run_state(str(tmp_path / "run")).status == "interrupted"


def test_pre_empted_array_task_requeues_itself_by_array_id(tmp_path):
    env = clean_env(PATH=_fake_bin(tmp_path), FEDHPC_PYTHON=sys.executable, FAKE_SLURM_DIR=str(tmp_path),
                    FAKE_SRUN="record", FAKE_SRUN_EXIT="75", SLURM_JOB_ID="81", SLURM_ARRAY_JOB_ID="70",
                    SLURM_ARRAY_TASK_ID="3", SLURM_JOB_NODELIST="node[01-02]")
    p = subprocess.run(["bash", "slurm/step.sh", str(tmp_path / "out"), "--rounds", "2"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 75, p.stdout + p.stderr
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["show hostnames node[01-02]", "requeue 70_3"]


def test_gpu_template_one_rank_per_gpu_across_nodes(tmp_path):
    text = open(os.path.join(REPO, "slurm", "run_gpu.sbatch")).read()
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--gpu-bind=none", "--cpus-per-task=8",
                 "--signal=B:USR1@120", "--requeue"):
        assert f"#SBATCH {line}" in _sbatch_lines(text)
    # per-task GPU isolation can stop NCCL's peer-to-peer transfers inside a node
    assert not any("--gpus-per-task" in l for l in _sbatch_lines(text))
    assert "export FEDHPC_SIGNAL_MARGIN_S=${FEDHPC_SIGNAL_MARGIN_S:-120}" in text
    # scontrol cannot expand the list here: the script falls back to fedhpc's own parser.
    env = clean_env(PATH=_fake_bin(tmp_path), FEDHPC_PYTHON=sys.executable, FAKE_SLURM_DIR=str(tmp_path),
                    FAKE_SRUN="record", FAKE_SCONTROL_NO_SHOW="1", SLURM_JOB_ID="99", SLURM_SUBMIT_DIR=REPO,
                    SLURM_JOB_NODELIST="gpu-a[1-2],gpu-b7", SLURM_CPUS_PER_TASK="8", OUT=str(tmp_path / "gpu"))
    p = subprocess.run(["bash", "slurm/run_gpu.sbatch", "--config", "launch/digits_fedavg.yaml"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    (call,) = _srun_calls(tmp_path)
    assert {"--kill-on-bad-exit=1", "--mpi=none", "--cpus-per-task=8"} <= set(call["opts"])
    assert call["env"]["MASTER_ADDR"] == "gpu-a1" and call["env"]["MASTER_PORT"] == "20099"
    cmd = call["cmd"]
    assert cmd[:3] == [sys.executable, "-m", "fedhpc.launch"]
    assert cmd[3:5] == ["--device", "cuda"] and cmd[-5:] == ["--out", str(tmp_path / "gpu"), "--resume", "--threads", "8"]
    assert json.loads((tmp_path / "gpu" / "status.json").read_text())["exit_code"] == 0


def test_sweep_array_runs_each_point_as_a_two_rank_step_and_resubmits_only_unfinished(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    grid_path = tmp_path / "g.yaml"
    grid_path.write_text(yaml.safe_dump({
        "name": "arr", "out": str(sweep), "ranks": 2,
        "base": {"rounds": 2, "num_clients": 8, "clients_per_round": 4, "model": "mlp", "tensorboard": False},
        "axes": {"seed": [0, 1]},
        "slurm": {"nodes": 2, "max_parallel": 1, "partition": "debug", "time": "00:10:00",
                  "setup": ["echo setup-ran"]},
    }))
    ids = [p.id for p in expand(load_grid(str(grid_path)))]
    monkeypatch.chdir(REPO)  # the array script runs from the folder the sweep was started in
    monkeypatch.setenv("PATH", _fake_bin(tmp_path))
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    assert sweep_main([str(grid_path)]) == 0
    assert "submitted array job 4242: 2 task(s), at most 1 at once" in capsys.readouterr().out
    script = sweep / "slurm" / "array-1.sbatch"
    assert (tmp_path / "sbatch.log").read_text().split() == ["--parsable", str(script)]
    lines = _sbatch_lines(script.read_text())
    for line in ("--array=0-1%1", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--partition=debug",
                 "--time=00:10:00", "--signal=B:USR1@120", "--requeue", f"--output={sweep}/logs/%x-%A_%a.out"):
        assert f"#SBATCH {line}" in lines
    assert not any("gpus" in l for l in lines)

    # What SLURM would do for array task 1: run the script with the array and allocation variables.
    env = clean_env(PATH=_fake_bin(tmp_path), FAKE_SLURM_DIR=str(tmp_path), SLURM_ARRAY_TASK_ID="1",
                    SLURM_ARRAY_JOB_ID="4242", SLURM_JOB_ID="4244", SLURM_JOB_NODELIST="node[01-02]",
                    SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="1")
    p = subprocess.run(["bash", str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "setup-ran" in p.stdout and "2 rank(s) via srun" in p.stdout
    (call,) = _srun_calls(tmp_path)
    assert {"--kill-on-bad-exit=1", "--mpi=none", "--cpus-per-task=1"} <= set(call["opts"])
    assert call["env"]["MASTER_ADDR"] == "node01" and call["env"]["MASTER_PORT"] == str(20000 + 4244)
    assert call["env"]["FEDHPC_PYTHON"] == sys.executable
    assert call["cmd"][3:] == ["--config", f"{sweep}/points/{ids[1]}.yaml", "--out", f"{sweep}/runs/{ids[1]}",
                               "--resume", "--threads", "1"]
    assert "show hostnames node[01-02]" in (tmp_path / "scontrol.log").read_text()
    run1 = sweep / "runs" / ids[1]
    assert run_state(str(run1), 2).status == "finished"
    assert [json.loads(l)["round"] for l in (run1 / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((run1 / "status.json").read_text())["where"] == "slurm job 4244"

    # Re-submitting the sweep submits only the point that has not run.
    assert sweep_main([str(grid_path)]) == 0
    out = capsys.readouterr().out
    assert f"{ids[1]}: finished (round 2/2) -> skip" in out
    text2 = (sweep / "slurm" / "array-2.sbatch").read_text()
    assert "#SBATCH --array=0-0%1" in text2 and f"IDS=({ids[0]})" in text2
    assert script.read_text().count(ids[1]) == 1  # the first array's script is left as it was


def test_sweep_gpu_array_layout(tmp_path, capsys):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({
        "out": str(tmp_path / "s"), "ranks": 8, "base": {"rounds": 2}, "axes": {"seed": [0, 1, 2]},
        "slurm": {"nodes": 2, "ntasks_per_node": 4, "gpus_per_task": 1, "cpus_per_task": 6,
                  "extra": ["--constraint=a100"], "setup": ["module load cuda"]},
    }))
    assert sweep_main([str(grid), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("--array=0-2", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-task=1", "--cpus-per-task=6",
                 "--constraint=a100"):
        assert f"#SBATCH {line}\n" in out
    assert "\nmodule load cuda\n" in out
    assert sweep_main([str(grid), "--dry-run", "--ranks", "6"]) == 2
    assert "must equal ranks (6)" in capsys.readouterr().err


def test_sweep_gpus_per_node_layout(tmp_path, capsys):
    """The recommended GPU layout: GPUs per node with every rank seeing them (--gpu-bind=none), not
    --gpus-per-task; both at once are refused by name."""
    grid = tmp_path / "g.yaml"
    spec = {"out": str(tmp_path / "s"), "ranks": 8, "base": {"rounds": 2}, "axes": {"seed": [0]},
            "slurm": {"nodes": 2, "ntasks_per_node": 4, "gpus_per_node": 4}}
    grid.write_text(yaml.safe_dump(spec))
    assert sweep_main([str(grid), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=4\n" in out and "#SBATCH --gpu-bind=none\n" in out
    assert "--gpus-per-task" not in out
    spec["slurm"]["gpus_per_task"] = 1
    grid.write_text(yaml.safe_dump(spec))
    assert sweep_main([str(grid), "--dry-run"]) == 2
    assert "slurm.gpus_per_node and slurm.gpus_per_task both set" in capsys.readouterr().err


def _sbatch_words(line):
    """The words of an #SBATCH line as sbatch reads them (src/sbatch/opt.c, _get_argument): blanks split
    outside quotes, a backslash escapes the next character, an unquoted '#' ends the line."""
    words, word, quote, escape, started = [], "", None, False, False
    for c in line[len("#SBATCH"):]:
        if escape:
            word, escape, started = word + c, False, True
        elif c == "\\":
            escape = True
        elif quote:
            if c == quote:
                quote = None
            else:
                word += c
        elif c in "\"'":
            quote, started = c, True
        elif c == "#":
            break
        elif c.isspace():
            if started or word:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + c, True
    assert quote is None, f"unmatched quote in {line!r}"
    return words + ([word] if started or word else [])


def _batch_output_name(pattern, job_name, array_job, task):
    """--output as slurmstepd names a batch job's file (src/slurmd/slurmstepd/fname.c): a backslash turns
    every pattern off, '%%' is '%', %x %A %a the job name, array job id and task id."""
    if "\\" in pattern:
        return pattern.replace("\\", "")
    subst = {"%": "%", "x": job_name, "A": array_job, "a": task}
    out, i = "", 0
    while i < len(pattern):
        if pattern[i] == "%" and i + 1 < len(pattern) and pattern[i + 1] in subst:
            out, i = out + subst[pattern[i + 1]], i + 2
        else:
            out, i = out + pattern[i], i + 1
    return out


def test_array_script_names_a_sweep_folder_with_blanks_quotes_hash_and_percent(tmp_path, capsys):
    """sbatch splits #SBATCH lines on unquoted blanks and cuts them at '#', and SLURM reads --output as a
    pattern ('%' is written '%%'): the logs of a sweep in such a folder went elsewhere."""
    sweep = tmp_path / 'my "runs" #2 at 50% of %a' / "exp 1"
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"out": str(sweep), "base": {"rounds": 2}, "axes": {"seed": [0, 1]},
                                    "slurm": {"job_name": "my job", "partition": "debug"}}))
    assert sweep_main([str(grid), "--dry-run"]) == 0
    script = capsys.readouterr().out.split("sbatch --parsable:\n", 1)[1]
    words = dict((w.split("=", 1) + [""])[:2] for l in _sbatch_lines(script) for w in _sbatch_words(l))
    assert len(words) == len(_sbatch_lines(script))  # one option per line, none split or cut
    assert words["--job-name"] == "my job" and words["--partition"] == "debug"
    assert _batch_output_name(words["--output"], "my job", "70", "1") == f"{sweep}/logs/my job-70_1.out"
    # the shell lines of the body name the same folder
    shell = [l for l in script.splitlines() if l.startswith(("SWEEP=", "cd "))]
    p = subprocess.run(["bash", "-c", "\n".join(shell) + '\nprintf "%s\\n" "$SWEEP" "$PWD"'],
                       capture_output=True, text=True)
    assert p.stdout.splitlines() == [str(sweep), os.getcwd()], p.stderr
    # a backslash turns SLURM's patterns off (and is dropped): refused, naming the folder
    grid.write_text(yaml.safe_dump({"out": str(tmp_path / "a\\b"), "base": {"rounds": 2}, "axes": {"seed": [0]}}))
    assert sweep_main([str(grid), "--dry-run"]) == 2
    assert "cannot write in its --output path" in capsys.readouterr().err


def test_resubmitting_a_sweep_in_a_bracketed_folder_keeps_the_earlier_scripts(tmp_path, monkeypatch, capsys):
    """The next array-<k> was counted with a glob over the sweep folder, which read exp[1] as a pattern
    (matching exp1): k was 1 again, and a re-submission overwrote array-1.sbatch and array-1.json."""
    sweep = tmp_path / "exp[1]"
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"out": str(sweep), "base": {"rounds": 2}, "axes": {"seed": [0]}}))
    monkeypatch.setenv("PATH", _fake_bin(tmp_path))
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    slurm_dir = sweep / "slurm"
    assert sweep_main([str(grid)]) == 0
    first = {f: (slurm_dir / f).read_text() for f in ("array-1.sbatch", "array-1.json")}
    time.sleep(0.01)  # array-1.json records when it was submitted
    assert sweep_main([str(grid)]) == 0
    assert {f: (slurm_dir / f).read_text() for f in first} == first
    assert (slurm_dir / "array-2.sbatch").exists() and (slurm_dir / "array-2.json").exists()
    # with array-1.sbatch deleted by hand, the next one is still array-3, not array-2 again
    (slurm_dir / "array-1.sbatch").unlink()
    assert sweep_main([str(grid)]) == 0
    assert sorted(os.listdir(slurm_dir)) == ["array-1.json", "array-2.json", "array-2.sbatch", "array-3.json",
                                             "array-3.sbatch"]
    assert [l.split()[-1] for l in (tmp_path / "sbatch.log").read_text().splitlines()] == [
        str(slurm_dir / f"array-{k}.sbatch") for k in (1, 2, 3)]
