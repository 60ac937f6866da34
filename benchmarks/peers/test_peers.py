"""Checks that the peers benchmark compares the same work (run explicitly; not under tests/):

    .venv/bin/python -m pytest -q -p no:cacheprovider benchmarks/peers/test_peers.py -x

The exported workload is checked against fedhpc's engine itself (its sampled cohorts, the
batches its ClientContext yields, its model), the plain loop against ``Engine.run_round``,
the fedhpc and pfl runners end to end against the plain loop, and the table's arithmetic
against a hand computation. The pfl test is skipped when ``.venvs/pfl`` was not made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import bench  # noqa: E402
import export_workload  # noqa: E402
import peerlib  # noqa: E402
import run_plain  # noqa: E402

SHORT = dict(rounds=3, eval_every=2)  # rounds 2 and 3 are evaluated


@pytest.fixture(scope="module")
def short_a(tmp_path_factory):
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("work") / "a.npz")
    export_workload.export("a", path, **SHORT)
    return path


def engine_for(name: str, **overrides):
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World

    flags = export_workload.launch_args(name, **overrides) + ["--threads", "1", "--quiet", "--no-tensorboard"]
    cfg, algo_opts, data_opts = parse_args(flags)
    return Engine(cfg, algo_opts, data_opts, World(threads=1))


def test_export_holds_fedhpcs_clients_cohorts_and_batches(short_a):
    from fedhpc.algorithms import ClientContext, RoundInfo
    from fedhpc.engine import sample_clients

    work = peerlib.Workload(short_a)
    eng = engine_for("a", **SHORT)
    assert work.num_clients == eng.data.num_clients == 100
    assert work.size(7) == int(eng.data.client_sizes()[7])
    for t in range(work.rounds):
        sampled = sample_clients(0, t, 100, 10)
        assert work.cohort(t) == sampled and len(set(sampled)) == 10
        for cid in sampled:
            # the batches the engine's own ClientContext yields for this (round, client)
            ctx = ClientContext(eng.algo, cid, eng.data.client(cid), RoundInfo(t, sampled, sampled, 0.05))
            theirs = list(ctx.batches(0))
            ours = list(work.batches(t, cid))
            assert len(theirs) == len(ours) == -(-work.size(cid) // 5)
            for (xa, ya), (xb, yb) in zip(theirs, ours):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x, y = eng.data.test_slice(0, eng.data.num_test())
    assert torch.equal(work.x_test, x) and torch.equal(work.y_test, y)


@pytest.mark.parametrize("name,model_options", [("mlp", {"hidden": 128}), ("cnn", {})])
def test_models_are_fedhpcs_models(name, model_options):
    from fedhpc.models import build_model

    torch.manual_seed(3)
    theirs = build_model(name, (1, 8, 8), 10, model_options)
    ours = peerlib.MODELS[name]((1, 8, 8), 10, **model_options)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # same names and shapes
    x = torch.rand(6, 1, 8, 8)
    assert torch.equal(ours(x), theirs(x))


def test_plain_loop_equals_the_engine_round_by_round(short_a):
    work = peerlib.Workload(short_a)
    eng = engine_for("a", **SHORT)
    model = work.build_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for t in range(work.rounds):
        eng.run_round(t)
        state = run_plain.fedavg_round(model, state, work, t)
        theirs = eng.flat.state_dict_from(eng.global_state)
        assert max(float((theirs[k] - state[k]).abs().max()) for k in state) <= 1e-6
    moved = max(float((state[k] - work.init[k]).abs().max()) for k in state)
    assert moved > 1e-3  # the comparison is not between two untouched models


def run(cmd, **kw):
    env = bench.clean_env("fedhpc-1")
    p = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def result(path):
    with open(path) as f:
        body = json.load(f)
    with np.load(path + ".weights.npz") as z:
        return body, {k: torch.from_numpy(z[k]) for k in z.files}


@pytest.fixture(scope="module")
def plain_result(short_a, tmp_path_factory):
    """The plain runner's result on the short workload (in this process: its main())."""
    path = str(tmp_path_factory.mktemp("plain") / "plain.json")
    assert run_plain.main(short_a, path) == 0
    return result(path)


def test_runners_fedhpc_and_plain_agree_and_time_every_round(short_a, plain_result, tmp_path):
    run(bench.command("fedhpc-1", short_a, str(tmp_path / "fed.json"), str(tmp_path), 2))
    plain, w_plain = plain_result
    fed, w_fed = result(str(tmp_path / "fed.json"))
    for body in (plain, fed):
        assert len(body["round_seconds"]) == 3 and all(r > 0 for r in body["round_seconds"])
        assert body["loop_seconds"] == pytest.approx(sum(body["round_seconds"]))
        assert body["steady_seconds"] == pytest.approx(sum(body["round_seconds"][1:]))
        assert sorted(body["accuracies"]) == ["2", "3"]
    assert fed["accuracies"] == plain["accuracies"]
    assert max(float((w_fed[k] - w_plain[k]).abs().max()) for k in w_plain) <= 1e-6


@pytest.mark.skipif(not os.path.exists(os.path.join(HERE, ".venvs", "pfl", ".ok")), reason="no pfl venv")
def test_pfl_runner_does_the_plain_loops_work(short_a, plain_result, tmp_path):
    run(bench.command("pfl-1", short_a, str(tmp_path / "pfl.json"), str(tmp_path), 2))
    plain, w_plain = plain_result
    pfl, w_pfl = result(str(tmp_path / "pfl.json"))
    assert len(pfl["round_seconds"]) == 3 and pfl["pfl_version"] == "0.6.0"
    assert pfl["accuracies"] == plain["accuracies"]
    # pfl sums model differences in float32: equal up to rounding, far below any training step
    assert max(float((w_pfl[k] - w_plain[k]).abs().max()) for k in w_plain) <= 1e-5


def test_table_is_medians_and_ratios_to_plain():
    w = {"head.weight": np.zeros((2, 2))}
    w2 = {"head.weight": np.full((2, 2), 0.25)}

    def r(name, loop, steady, proc, acc=0.5, weights=w):
        return {"framework": name, "loop_seconds": loop, "steady_seconds": steady, "process_seconds": proc,
                "final_accuracy": acc, "weights": weights}

    runs = {"plain": [r("plain", 1.0, 0.9, 5.0), r("plain", 3.0, 2.0, 7.0), r("plain", 2.0, 1.0, 6.0)],
            "fedhpc-1": [r("fedhpc (1 rank)", 4.0, 1.0, 9.0), r("fedhpc (1 rank)", 5.0, 3.0, 12.0),
                         r("fedhpc (1 rank)", 6.0, 2.0, 3.0)],
            "pfl-1": [r("pfl (1 process)", 1.0, 1.0, 1.0, weights=w2), {"error": "exit 1:\nboom"}],
            "flower": [{"error": "timed out after 600 s"}]}
    rows = bench.table("a", runs, ["plain", "fedhpc-1", "pfl-1", "flower"])
    cells = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[2:-1]] for row in rows[2:]}
    # medians: plain loop 2.0, steady 1.0, process 6.0; fedhpc 5.0, 2.0, 9.0
    assert cells["plain"][:7] == ["2.00", "1.00", "6.00", "1.00", "1.00", "1.00", "0.5000"]
    assert cells["fedhpc (1 rank)"][:6] == ["5.00", "2.00", "9.00", "2.50", "2.00", "1.50"]
    assert cells["pfl (1 process)"][3] == "0.50" and cells["pfl (1 process)"][7] == "2.5e-01"
    assert cells["Flower simulation (ray), 2 actors"][0] == "timed out after 600 s"
