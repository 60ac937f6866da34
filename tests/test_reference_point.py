"""Fig. 2's metric is measured at one point of the round for every method (issue 39, section 2, item 4).

Mix2FLD's Fig. 2 plots "the learning curve of a randomly selected device" for FL, FD, MixFLD and
Mix2FLD. ``reference_device_accuracy`` after round t is the accuracy of the reference device's
model after round t's download: the model it would start round t + 1 from. For FL and the FLD
family that is the broadcast global model (or the model it kept when the broadcast did not reach
it); for FD its own model, which FD's download (global outputs) does not change. The test
captures the model the device actually starts round t + 1's local training from and evaluates it
on the global test set: the two accuracies must be the same number, for every method, with and
without downlink outages.
"""

from __future__ import annotations

import warnings

import pytest

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World

ARGS = ["--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=16", "--num-clients", "6",
        "--clients-per-round", "6", "--rounds", "4", "--partition", "iid", "--threads", "1", "--quiet",
        "--no-tensorboard", "--no-out", "--channel", "asymmetric", "--channel-opt", "uplink_bandwidth=dedicated"]
SEEDS = {"fld": ["--server-steps", "5", "--seeds-per-device", "4"],
         "mixfld": ["--server-steps", "5", "--seeds-per-device", "4"],
         "mix2fld": ["--server-steps", "5", "--seeds-per-device", "4", "--inverse-per-device", "4"]}


@pytest.mark.parametrize("downlink", ["reaches", "fails"])
@pytest.mark.parametrize("algo", ["fl", "fd", "fld", "mixfld", "mix2fld"])
def test_the_reference_device_is_scored_on_the_model_it_starts_the_next_round_from(algo, downlink):
    extra = [] if downlink == "reaches" else ["--channel-opt", "p_down_dbm=10"]  # every broadcast lost
    cfg, ao, do = parse_args(["--algo", algo, *ARGS, *SEEDS.get(algo, []), *extra])
    eng = Engine(cfg, ao, do, World(threads=1))
    ref = eng.reference_device
    starts = {}
    train = eng.algo.local_update

    def capture(model, ctx, *a, **kw):
        if ctx.cid == ref:  # after the download, before local training
            starts[ctx.round.index] = eng.flat.flat.detach().clone()
        return train(model, ctx, *a, **kw)

    eng.algo.local_update = capture
    scored, outages = {}, []
    for t in range(4):
        m = eng.run_round(t)
        outages.append(m["downlink_outages"])
        scored[t] = eng.evaluate(t + 1)["reference_device_accuracy"]
    if downlink == "fails":
        assert outages[1:] == [6, 6, 6] and (algo == "fd" or outages[0] == 6)  # FD downloads nothing in round 1
    else:
        assert outages == [0, 0, 0, 0]
    for t in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = eng._evaluate_global(starts[t + 1].detach())["test_accuracy"]
        assert scored[t] == used, (t, scored[t], used)
    # and it is a model that moved: not the initial one (the metric measures training)
    assert len({round(v, 12) for v in scored.values()}) > 1
