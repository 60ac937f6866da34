"""--cold-start-fraction holds clients out of training entirely (pMixFed Sec. 10.2): the
exchanges that collect from every device up front, before any client trains, must not collect
from them either, or their data reaches the global model and inflates cold_start_accuracy."""

import pytest
import torch

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World

BASE = ["--dataset", "digits", "--num-clients", "8", "--clients-per-round", "2", "--rounds", "1",
        "--model", "mlp", "--seed", "4", "--cold-start-fraction", "0.5", "--client-test-fraction", "0.2",
        "--threads", "1", "--quiet", "--no-tensorboard"]
SERVER = ["--data-opt", "server_per_label=20", "--data-opt", "server_deficient=0,2",
          "--data-opt", "server_deficient_count=4", "--server-epochs", "1"]


def owners_of_mean_data(algo):
    return algo.exchange.means.owners.flatten()


def owners_of_raw_pool(algo):
    return algo.pool["owner"]


def owners_of_seeds(algo):
    return algo.collected.owner


def owners_of_encoded_uploads(algo):
    return torch.tensor(sorted(algo.upload_bytes))


CASES = {
    "fedmix": ([], owners_of_mean_data),
    "naivemix": ([], owners_of_mean_data),
    "globalmix": ([], owners_of_raw_pool),
    "fld": ([], owners_of_seeds),
    "mix2fld": (["--inverse-per-device", "4"], owners_of_seeds),
    "xormixfl": (["--partition", "deficient:0,2:2:10", *SERVER], owners_of_encoded_uploads),
}


@pytest.mark.parametrize("algo", sorted(CASES))
def test_exchanges_before_training_collect_from_training_clients_only(algo, tmp_path):
    extra, owners_of = CASES[algo]
    cfg, ao, do = parse_args(["--algo", algo, *BASE, *extra, "--out", str(tmp_path / "r")])
    eng = Engine(cfg, ao, do, World(threads=1))
    assert len(eng.cold_start) == 4
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(eng.training_clients[:2])})())
    owners = set(owners_of(eng.algo).tolist())
    # every training client that holds data of the kind sent it (not vacuous), no held-out one did
    assert owners and owners <= set(eng.training_clients)
    assert not owners & set(eng.cold_start)
    if algo != "xormixfl":  # there only holders of the target labels are asked
        assert owners == set(eng.training_clients)


def test_dummy_labels_outside_the_dataset_are_refused_before_any_device_encodes(tmp_path):
    cfg, ao, do = parse_args(["--algo", "xormixfl", *BASE[:-4], "--partition", "deficient:0,2:2:10", *SERVER,
                              "--dummy-labels", "3,12", "--threads", "1", "--quiet", "--no-tensorboard"])
    from fedhpc.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--dummy-labels '3,12' names label\(s\) \[12\] that digits does not "
                                          r"have \(its labels are 0..9\)"):
        Engine(cfg, ao, do, World(threads=1))


def test_mix2fld_makes_its_inverse_samples_for_the_training_devices_only(tmp_path):
    """Mix2FLD's server makes N_I inversely mixed samples per device whose seeds reached it
    (--seed-delivery always: every training device); the cold-start devices sent none, so they
    must not add N_I samples each (made from the training devices' seeds)."""
    cfg, ao, do = parse_args(["--algo", "mix2fld", *BASE, "--inverse-per-device", "4", "--out", str(tmp_path / "r")])
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(eng.training_clients[:2])})())
    assert len(eng.algo.training_clients) == 4 < eng.data.num_clients
    assert len(eng.algo.server_set) == 4 * len(eng.training_clients)
