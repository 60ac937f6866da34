"""fedhpc.run (the Python API beside the command line) and fedhpc.report.load_runs."""

import json
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
import yaml

import fedhpc
from conftest import FAST, REPO, clean_env, final_weights, launch, max_diff, mpiexec
from fedhpc.errors import ConfigError
from fedhpc.run_log import WALL_CLOCK_METRICS

# conftest's FAST as keyword settings (the YAML keys), on the same data and model
SETTINGS = dict(rounds=4, num_clients=8, clients_per_round=4, lr=0.1, local_epochs=2, model="mlp", quiet=True,
                threads=1, tensorboard=False)


def results(rows):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_METRICS} for r in rows]


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def process_state():
    """What a run may change process-wide: torch's threads and random state, the signal handlers the
    engine installs, the process group, the algorithm registry."""
    from fedhpc.algorithms import ALGORITHMS

    return (torch.get_num_threads(), torch.random.get_rng_state(),
            [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)],
            torch.distributed.is_initialized(), list(ALGORITHMS.names()))


@pytest.fixture(scope="module")
def twice():
    """fedhpc.run called twice in this process with the same settings, and the process state before
    and after."""
    fedhpc.run(**{**SETTINGS, "rounds": 1})  # registries filled, lazy imports done
    torch.set_num_threads(2)  # not what the run sets (1)
    before = process_state()
    first, second = fedhpc.run(**SETTINGS), fedhpc.run(**SETTINGS)
    after = process_state()
    torch.set_num_threads(1)  # conftest's
    return first, second, before, after


def test_run_twice_in_one_process_gives_the_same_result_and_restores_torch(twice):
    first, second, before, after = twice
    assert same_state(first.global_state, second.global_state)
    assert results([first.final]) == results([second.final])
    assert results(first.rounds) == results(second.rounds)
    assert [r["round"] for r in first.rounds] == [1, 2, 3, 4] and first.rounds[-1]["round"] == first.final["round"]
    assert 0 < first.final["test_accuracy"] <= 1 and first.out is None and first.client_states is None
    assert first.config.rounds == 4 and first.config.model == "mlp" and first.model == "mlp"
    assert first.metric("test_accuracy")[-1] == (4, first.final["test_accuracy"])
    # the World set 1 thread, the engine seeded torch and handled SIGTERM / SIGUSR1: all put back
    assert after[0] == before[0] == 2 and torch.equal(after[1], before[1])
    assert after[2:] == before[2:] and after[3] is False


def test_run_equals_the_command_line_for_the_same_settings(twice, tmp_path):
    out = str(tmp_path / "cli")
    p = launch(FAST + ["--out", out])
    assert p.returncode == 0, p.stderr
    assert max_diff(final_weights(out), twice[0].global_state) == 0.0
    cli_rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert results(cli_rows) == results(twice[0].rounds)


def test_config_file_dict_and_keywords_combine_as_file_and_flags(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"algo": "fedprox", "rounds": 2, "lr": 0.2, "algo_options": {"mu": 0.3},
                                    "num_clients": 8, "clients_per_round": 4, "model": "mlp"}))
    quiet = dict(quiet=True, threads=1, tensorboard=False)
    r = fedhpc.run(str(path), lr=0.1, mu=0.4, **quiet)
    assert (r.config.algo, r.config.rounds, r.config.lr, r.config.algo_options) == ("fedprox", 2, 0.1, {"mu": 0.4})
    d = fedhpc.run(yaml.safe_load(path.read_text()), lr=0.1, algo_options={"mu": 0.4}, **quiet)
    assert same_state(r.global_state, d.global_state)
    # an algorithm named over the file's drops the file's options as --algo does
    assert fedhpc.run(str(path), algo="fedavg", rounds=1, **quiet).config.algo_options == {}


@pytest.mark.parametrize("kwargs, needle", [
    ({"round": 3}, "'round' is not a setting (did you mean 'rounds'?)"),
    ({"mu": 0.1}, "'mu' is an option of algorithm(s) fedalign, fedprox"),
    ({"rounds": 1.5}, "--rounds must be an integer, got 1.5; give a whole number"),
    ({"algo": "fedmagic"}, "unknown algorithm 'fedmagic'"),
    ({"data_options": 3}, "data_options must be a mapping"),
    ({"resume": True}, "--resume needs --out"),
])
def test_bad_settings_raise_the_launchers_error(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        fedhpc.run(**{**SETTINGS, **kwargs})
    assert needle in str(e.value)


def test_a_personal_method_returns_its_clients_models_and_out_writes_the_run(tmp_path):
    out = tmp_path / "run"
    r = fedhpc.run(**{**SETTINGS, "algo": "fedper", "out": str(out)})
    assert r.out == str(out) and (out / "final_model.pt").exists()
    assert same_state(torch.load(out / "final_model.pt"), r.global_state)
    assert r.rounds == [json.loads(line) for line in open(out / "metrics.jsonl")]
    trained = {c for c in r.client_states}
    assert trained and trained <= set(range(8))
    one = r.client_states[min(trained)]
    assert one.keys() == r.global_state.keys()
    assert any(not torch.equal(one[k], r.global_state[k]) for k in one), "a client's own layers"
    assert fedhpc.run(**{**SETTINGS, "algo": "fedper", "rounds": 1}, client_models=False).client_states is None


API_PROBE = """
import os, sys
import torch
import fedhpc
settings = dict(rounds=4, num_clients=8, clients_per_round=4, lr=0.1, local_epochs=2, model="mlp", quiet=True,
                threads=1, tensorboard=False, algo=sys.argv[2])
first, second = fedhpc.run(**settings), fedhpc.run(**settings)   # two process groups in one MPI process
assert not torch.distributed.is_initialized(), "the process group outlived the run"
from mpi4py import MPI
assert MPI.Is_initialized() and not MPI.Is_finalized()
rank = MPI.COMM_WORLD.Get_rank()
torch.save({"first": first.global_state, "second": second.global_state, "final": first.final,
            "clients": first.client_states, "size": MPI.COMM_WORLD.Get_size()},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
"""


@pytest.mark.parametrize("algo", ["fedavg", "fedper"])
def test_run_under_mpiexec_two_ranks_equals_one_rank(tmp_path, twice, algo):
    probe = tmp_path / "probe.py"
    probe.write_text(API_PROBE)
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(probe), str(tmp_path), algo], cwd=REPO,
                       env=clean_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    one = twice[0] if algo == "fedavg" else fedhpc.run(**{**SETTINGS, "algo": algo})
    for got in ranks:
        assert got["size"] == 2
        assert same_state(got["first"], one.global_state) and same_state(got["second"], one.global_state)
        assert got["final"]["test_accuracy"] == one.final["test_accuracy"]
        if one.client_states is None:
            assert got["clients"] is None
        else:  # gathered from both ranks, each client's model as one rank computes it
            assert got["clients"].keys() == one.client_states.keys()
            assert all(same_state(got["clients"][c], one.client_states[c]) for c in one.client_states)


def test_import_is_cheap_and_the_version_is_the_packages():
    code = ("import sys, fedhpc; from importlib.metadata import version; "
            "print(fedhpc.__version__, version('fedhpc'), 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    mine, installed, torch_loaded = p.stdout.split()
    assert mine == installed and torch_loaded == "False"


# ----------------------------------------------------------------------------- load_runs

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    made = {seed: fedhpc.run(**{**SETTINGS, "rounds": 3, "eval_every": 2, "seed": seed,
                                "out": str(root / "grid" / f"seed{seed}")}) for seed in (0, 1)}
    return str(root), made


def test_load_runs_gives_one_row_per_run_with_settings_final_and_best(two_runs):
    from fedhpc.report import load_runs

    root, made = two_runs
    rows = load_runs(root, as_frame=False)
    assert [r["seed"] for r in rows] == [0, 1] and [r["path"] for r in rows] == [made[s].out for s in (0, 1)]
    for row in rows:
        r = made[row["seed"]]
        assert row["status"] == "finished" and row["rounds_done"] == 3 and row["algo"] == "fedavg"
        assert row["lr"] == 0.1 and row["eval_every"] == 2
        assert row["final_test_accuracy"] == r.final["test_accuracy"]
        assert row["final_bytes_up_total"] == r.final["bytes_up_total"]
        evaluated = [x["test_accuracy"] for x in r.rounds if "test_accuracy" in x]
        assert len(evaluated) == 2 and row["best_test_accuracy"] == max(evaluated)
        assert "final_round" not in row and "reference" not in row


def test_load_runs_frame_when_pandas_is_there(two_runs, monkeypatch):
    from fedhpc.report import load_runs

    root, _ = two_runs
    monkeypatch.setitem(sys.modules, "pandas", None)  # not installed
    assert isinstance(load_runs(root), list)
    with pytest.raises(ImportError, match="pip install pandas"):
        load_runs(root, as_frame=True)
    fake = types.SimpleNamespace(DataFrame=lambda rows: ("frame", rows))
    monkeypatch.setitem(sys.modules, "pandas", fake)
    kind, rows = load_runs(root)
    assert kind == "frame" and len(rows) == 2 and rows == load_runs(root, as_frame=False)
    with pytest.raises(ConfigError, match="is not a folder"):
        load_runs(os.path.join(root, "nope"))
