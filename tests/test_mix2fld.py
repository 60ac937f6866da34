"""The FLD family through the engine: what crosses the network by kind, and the privacy audit."""

import pytest
import torch

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World

ARGS = ["--dataset", "digits", "--model", "mlp", "--num-clients", "5", "--clients-per-round", "5",
        "--rounds", "2", "--threads", "1", "--quiet", "--no-tensorboard", "--server-steps", "3",
        "--seeds-per-device", "4", "--inverse-per-device", "6", "--partition", "iid"]


def run_two_rounds(algo):
    cfg, ao, do = parse_args(["--algo", algo, *ARGS])
    eng = Engine(cfg, ao, do, World(threads=1))
    return eng, [eng.run_round(0), eng.run_round(1)]


@pytest.mark.parametrize("algo", ["fld", "mixfld", "mix2fld"])
def test_ledger_books_outputs_seeds_and_parameters_by_kind(algo):
    eng, (r1, r2) = run_two_rounds(algo)
    C, devices = 10, 5
    pixels = 64  # 8x8 digits, 8 bits each; plus one byte per label of a seed
    labels = 1 if algo == "fld" else 2
    assert r1["bytes_up_outputs"] == r2["bytes_up_outputs"] == devices * C * C * 4  # 32-bit table
    assert r1["bytes_up_seeds"] == devices * 4 * (pixels + labels)                     # round 1 only
    assert r2["bytes_up_seeds"] == 0
    assert r1["bytes_up_parameters"] == 0                                              # never weights up
    assert r1["bytes_down_parameters"] == devices * eng.flat.numel * 4                 # weights down


def test_privacy_audit_flags_raw_seeds_and_passes_mixtures():
    for algo, leaks in (("fld", True), ("mixfld", False), ("mix2fld", False)):
        _, (r1, _) = run_two_rounds(algo)
        assert r1["seeds_uploaded"] == 20
        assert (r1["seeds_leaking_raw"] == 20) if leaks else (r1["seeds_leaking_raw"] == 0), algo
        if algo != "fld":
            assert torch.isfinite(torch.tensor(r1["sample_privacy_uploaded"]))
        if algo == "mix2fld":
            assert r1["server_samples"] == 30 and "sample_privacy_server" in r1


def test_mix2fld_inverts_seeds_mixed_from_three_samples():
    """General N (Eq. 8): seeds mixing 3 samples, inverted three devices at a time."""
    cfg, ao, do = parse_args(["--algo", "mix2fld", *ARGS, "--seed-mix-n", "3", "--seed-lam", "0.2"])
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.run_round(0)
    s = eng.algo.server_set
    assert len(s) == 30 and torch.equal(s.y.max(1).values, torch.ones(30))  # hard labels
    assert s.source_cid.shape[1] == 9  # 3 parent seeds of 3 raw samples each
