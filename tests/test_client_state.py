import glob
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, clean_env, mpiexec
from fedhpc.client_state import ClientStateStore
from fedhpc.engine import sample_clients
from fedhpc.world import World

PROBE = os.path.join(REPO, "tests", "state_probe.py")
ARGS = ["--num-clients", "12", "--clients-per-round", "5", "--model", "mlp", "--quiet",
        "--threads", "1", "--no-tensorboard", "--client-state-budget-mb", "0.02", "--seed", "4"]


def run_probe(dump, ranks, extra, check=True):
    cmd = [sys.executable, PROBE, dump, *ARGS, *extra]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    p = subprocess.run(cmd, cwd=REPO, env=clean_env(PYTHONPATH=os.path.join(REPO, "tests")),
                       capture_output=True, text=True, timeout=240)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    states, spills = {}, 0
    for f in sorted(glob.glob(os.path.join(dump, "rank*.pt"))):
        body = torch.load(f, weights_only=False)
        for cid, s in body["states"].items():
            assert cid not in states, f"client {cid} held by two ranks"
            states[cid] = s
        spills += body["spills"]
    return states, spills


def expected_rounds(rounds):
    exp = {}
    for t in range(rounds):
        for c in sample_clients(4, t, 12, 5):
            exp.setdefault(c, []).append(t)
    return exp


def test_store_spills_beyond_budget_and_reads_back(tmp_path):
    store = ClientStateStore(World(threads=1), budget_bytes=3 * 4000, spill_dir=str(tmp_path))
    for cid in range(10):
        store.put(cid, {"w": torch.full((1000,), float(cid))})
    assert store.memory_bytes <= 3 * 4000
    assert store.spills >= 7 and len(os.listdir(tmp_path / "rank0")) >= 7
    for cid in range(10):
        assert torch.equal(store.get(cid)["w"], torch.full((1000,), float(cid)))
    assert store.memory_bytes <= 3 * 4000
    assert store.get(99) is None


def test_spilled_states_read_after_the_run_ended_say_where_they_went(tmp_path):
    store = ClientStateStore(World(threads=1), budget_bytes=3 * 4000, spill_dir=str(tmp_path))
    for cid in range(5):
        store.put(cid, {"w": torch.full((1000,), float(cid))})
    store.close()  # what Engine.run() does on its way out
    assert not (tmp_path / "rank0").exists()
    assert torch.equal(store.get(4)["w"], torch.full((1000,), 4.0))  # held in memory: still there
    with pytest.raises(RuntimeError, match="deleted when the run ended.*checkpoint.*--client-state-budget-mb"):
        dict(store.items())
    with pytest.raises(RuntimeError, match="client 0's state was spilled"):
        store.get(0)


@pytest.mark.parametrize("ranks", [1, 2])
def test_state_follows_clients_across_ranks(tmp_path, ranks):
    states, spills = run_probe(str(tmp_path), ranks, ["--rounds", "6"])
    exp = expected_rounds(6)
    assert sorted(states) == sorted(exp)
    for cid, rounds in exp.items():
        assert states[cid]["rounds"] == rounds
        assert torch.equal(states[cid]["vec"], torch.full((2000,), float(len(rounds) * (cid + 1))))
    assert spills > 0, "the 0.02 MB budget must have forced spills"


def test_client_state_survives_checkpoint_and_resume_on_other_rank_count(tmp_path):
    out = str(tmp_path / "run")
    # 3 rounds on 2 ranks, then resume to 6 rounds on 1 rank.
    run_probe(str(tmp_path / "d1"), 2, ["--rounds", "3", "--out", out])
    states, _ = run_probe(str(tmp_path / "d2"), 1, ["--rounds", "6", "--out", out, "--resume"])
    exp = expected_rounds(6)
    assert {c: s["rounds"] for c, s in states.items()} == exp


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec (pip install mpich)")
def test_send_objects_delivers_each_parcel_to_its_rank_alone(tmp_path):
    """Migration's point-to-point exchange on 3 ranks: what each rank receives is exactly what
    the others addressed to it (a brute-force list of the parcels), in rank order."""
    from conftest import run_probe
    from send_objects_probe import parcels

    got = run_probe("send_objects_probe.py", tmp_path, 3)
    for rank, result in enumerate(got):
        for k in range(2):
            want = {src: parcels(src, 3, k)[rank] for src in range(3) if rank in parcels(src, 3, k)}
            received = result["got"][k]
            assert list(received) == sorted(want), (rank, k, received)
            for src, parcel in received.items():
                assert parcel["from"] == src and parcel["to"] == rank and parcel["round"] == k
                assert torch.equal(parcel["values"], want[src]["values"])
    assert any(result["got"][0] for result in got)  # something travelled
