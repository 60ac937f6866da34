"""Which reading of Mix2FLD's channel budget the launch files run, and a time axis that does not
depend on the machine (issue 39, section 2, items 3 and 6).

Item 3: under Eq. 4 with the paper's numbers read literally (10 devices share W N_ch, 2 MHz
each, T_max / 2 per direction) FL's 401,408-bit upload needs 101 good slots of 4,000 bits against
50 and never passes, on either channel, nor does a round-1 upload with N_S = 50 seeds: "FL is
best on symmetric channels" (Fig. 2) cannot hold, and the seeds reached the server only because
--seed-delivery always bypassed the channel. Under the launch files' reading (each device has the
N_ch channels of W to itself, ``uplink_bandwidth: dedicated``) FL passes on the symmetric channel,
loses some uploads on the asymmetric one, and the seeds arrive through the channel.

Item 6: with ``device_seconds_per_sample`` / ``server_seconds_per_sample`` set, the simulated
convergence time is a formula of what was processed and sent, the same on every run and machine.
Expected values are computed here by hand from the paper's numbers.
"""

from __future__ import annotations

import math
import os

import pytest
import yaml

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.server.channel import Channel, ChannelOptions
from fedhpc.world import World

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch")

# The paper's payloads (Sec. II-C, III-A, IV), in bytes: 12,544 32-bit weights; an N_L x N_L
# table of 32-bit outputs; a seed of 28 x 28 8-bit pixels (+ its two label ids, one byte each)
FL_UP = 12_544 * 4
TABLE = 10 * 10 * 4


def seeds_up(n_seeds):
    return TABLE + n_seeds * (28 * 28 + 2)


def binomial_below(n_trials, p, k):
    """P(Binomial(n_trials, p) < k), summed here term by term."""
    return sum(math.comb(n_trials, i) * p ** i * (1 - p) ** (n_trials - i) for i in range(k))


def slot_success(p_up_dbm, bandwidth_hz):
    """exp(-theta W N0 r^alpha / P): theta 3, N0 -174 dBm/Hz, r 1 km, alpha 4 (Sec. IV)."""
    n0 = 10 ** ((-174 - 30) / 10)
    return math.exp(-3 * bandwidth_hz * n0 * 1000.0 ** 4 / 10 ** ((p_up_dbm - 30) / 10))


def launch_channel_options(name="mix2fld_mnist.yaml"):
    cfg, _, _ = parse_args(["--config", os.path.join(LAUNCH, name)])
    return dict(cfg.channel_options)


# ----------------------------------------------------------------------------- item 3: the budget's reading

def test_under_the_literal_reading_fl_and_fifty_seeds_never_pass_on_either_channel():
    """2 MHz a device: 4,000 bits a good slot (W N_ch / |D| log2(1 + 3) tau), 50 slots."""
    for mode in ("asymmetric", "symmetric"):
        ch = Channel(mode, ChannelOptions(uplink_bandwidth="fdma"))
        assert ch.bits_per_slot("up", 10) == 2e6 * 2 * 1e-3
        assert ch.good_slots_needed(FL_UP, "up", 10) == math.ceil(401_408 / 4_000) == 101 > ch.budget == 50
        assert ch.outage_probability("up", FL_UP, 10) == 1.0
        assert ch.outage_probability("up", seeds_up(50), 10) == 1.0       # 80 good slots
        assert ch.outage_probability("up", seeds_up(10), 10) < 1e-20      # 17: N_S = 10 passes


def test_the_launch_files_reading_lets_fl_through_on_symmetric_channels_and_seeds_through_on_both():
    """``dedicated``: 40,000 bits a good slot; slot success exp(-theta W N_ch N0 r^a / P): 0.302 at
    23 dBm, 0.976 at 40 dBm. FL needs 11 of 50, N_S = 50 seeds 8, the table 1."""
    for name in ("mix2fld_mnist.yaml", "mix2fld_mnist_fl.yaml", "mix2fld_mnist_fd.yaml",
                 "mix2fld_digits.yaml", "mix2fld_digits_fl.yaml", "mix2fld_digits_fd.yaml"):
        assert launch_channel_options(name)["uplink_bandwidth"] == "dedicated", name
    opts = launch_channel_options()
    p = {mode: slot_success(dbm, 20e6) for mode, dbm in (("asymmetric", 23), ("symmetric", 40))}
    want = {(mode, what): binomial_below(50, p[mode], k) for mode in p
            for what, k in (("fl", 11), ("seeds50", 8), ("seeds10", 2), ("table", 1))}
    for mode in p:
        ch = Channel(mode, ChannelOptions(**opts))
        assert ch.bits_per_slot("up", 10) == 20e6 * 2 * 1e-3
        assert ch.slot_success_probability("up", 10) == pytest.approx(p[mode], rel=1e-12)
        for what, payload in (("fl", FL_UP), ("seeds50", seeds_up(50)), ("seeds10", seeds_up(10)), ("table", TABLE)):
            assert ch.outage_probability("up", payload, 10) == pytest.approx(want[mode, what], rel=1e-9, abs=1e-300)
    assert want["symmetric", "fl"] < 1e-50                 # FL passes on symmetric channels
    assert 0.05 < want["asymmetric", "fl"] < 0.1           # and loses 7.4% of its uploads on asymmetric ones
    assert want["asymmetric", "seeds50"] < 0.01 and want["symmetric", "seeds50"] < 1e-50
    assert want["asymmetric", "table"] < 1e-7


def engine(config, tmp_path, *extra):
    """The launch file's run on the 28 x 28 MNIST subset every machine has (mnist5k: 4,000 training
    images, so 8 devices of 388 with the paper's two 2-sample labels), one short local epoch."""
    settings = yaml.safe_load(open(os.path.join(LAUNCH, config)))
    settings.pop("data_options", None)  # MNIST's reader options; mnist5k has none
    settings.update(dataset="mnist5k", num_clients=8, clients_per_round=8, partition="skewed:2:2:48",
                    local_epochs=1, batch_size=50)
    path = tmp_path / config
    path.write_text(yaml.safe_dump(settings))
    cfg, ao, do = parse_args(["--config", str(path), "--threads", "1", "--quiet", "--no-tensorboard", "--no-out", *extra])
    return Engine(cfg, ao, do, World(threads=1))


@pytest.mark.parametrize("algo", ["mixfld", "mix2fld"])
def test_fifty_seeds_reach_the_server_through_the_channel_of_the_launch_files(algo, tmp_path):
    """The launch files read Alg. 1 literally (--seed-delivery channel): a device's seeds arrive
    only with a round-1 upload that had no outage. On the paper's 28 x 28 MNIST seeds, N_S = 50."""
    eng = engine("mix2fld_mnist.yaml", tmp_path, "--algo", algo, "--server-steps", "2", "--seeds-per-device", "50",
                 "--inverse-per-device", "50")
    assert eng.algo.options.seed_delivery == "channel"
    for mode in ("asymmetric", "symmetric"):
        eng.channel = Channel(mode, eng.channel.options, eng.cfg.seed)
        eng.links.channel = eng.channel
        eng.algo.collected = None
        m = eng.run_round(0)
        assert m["uplink_outages"] == 0 and m["seeds_delivered"] == 8 * 50, (mode, m)
        eng.global_state.zero_()


def test_fl_trains_on_symmetric_channels_of_the_launch_files_and_never_under_the_literal_reading(tmp_path):
    eng = engine("mix2fld_mnist_fl.yaml", tmp_path, "--channel", "symmetric")
    assert [eng.run_round(t)["uplink_outages"] for t in range(2)] == [0, 0]
    literal = engine("mix2fld_mnist_fl.yaml", tmp_path, "--channel", "symmetric", "--channel-opt",
                     "uplink_bandwidth=fdma")
    before = literal.global_state.clone()
    assert [literal.run_round(t)["uplink_outages"] for t in range(2)] == [8, 8]
    assert bool((literal.global_state == before).all())  # FL's model never moves


# ----------------------------------------------------------------------------- item 6: the time axis

DIGITS = ["--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=8", "--num-clients", "5",
          "--clients-per-round", "5", "--partition", "iid", "--rounds", "2", "--local-epochs", "2",
          "--batch-size", "10", "--threads", "1", "--quiet", "--no-tensorboard", "--no-out",
          # every slot decodes (100 dBm): the slots a payload takes are its size over a slot's bits
          "--channel", "asymmetric", "--channel-opt", "p_up_dbm=100", "--channel-opt", "p_down_dbm=100",
          "--channel-opt", "uplink_bandwidth=dedicated",
          "--channel-opt", "device_seconds_per_sample=0.001", "--channel-opt", "server_seconds_per_sample=0.0001"]


def run(algo, *extra):
    cfg, ao, do = parse_args(["--algo", algo, *DIGITS, *extra])
    eng = Engine(cfg, ao, do, World(threads=1))
    rows = [eng.run_round(t) for t in range(2)]
    return eng, rows


def slots(payload_bytes, bits_per_slot):
    return math.ceil(8 * payload_bytes / bits_per_slot)


def server_samples(n, batch, steps):
    """Samples K_s steps of ``batch`` process over ``n`` samples: passes of ceil(n / batch) batches,
    each pass's last one smaller (fedhpc.server.trainer's documented batch order)."""
    per_pass = math.ceil(n / batch)
    full, rest = divmod(steps, per_pass)
    return full * n + rest * batch


@pytest.mark.parametrize("algo", ["fedavg", "fd", "mix2fld"])
def test_the_simulated_time_is_the_same_on_two_runs_and_is_the_compute_model_plus_the_slots(algo):
    extra = ["--server-steps", "7", "--server-batch", "4", "--seeds-per-device", "3", "--inverse-per-device", "3"] \
        if algo == "mix2fld" else []
    eng, rows = run(algo, *extra)
    _, again = run(algo, *extra)
    assert [r["sim_seconds_total"] for r in rows] == [r["sim_seconds_total"] for r in again]
    # by hand: rounds are the slowest device's compute + uplink, the server, the slowest downlink
    weights = 64 * 8 + 8 + 8 * 10 + 10
    up_bits, down_bits = 20e6 * 2 * 1e-3, 10e6 * 2 * 1e-3  # dedicated uplink W N_ch, downlink W; log2(1 + 3) = 2
    sizes = {cid: eng.data.client(cid).num_train for cid in range(5)}
    total = 0.0
    for t in range(2):
        if algo == "fedavg":
            up, down, server = weights * 4, weights * 4, 0
        elif algo == "fd":
            up, down, server = 10 * 10 * 4, (10 * 10 * 4 if t > 0 else 0), 0
        else:  # outputs (+ 3 seeds of 64 pixels and 2 label bytes in round 1); the model down; K_s x batch
            up, down, server = 10 * 10 * 4 + (3 * (64 + 2) if t == 0 else 0), weights * 4, server_samples(5 * 3, 4, 7)
        device = max(0.001 * 2 * sizes[cid] + slots(up, up_bits) * 1e-3 for cid in range(5))
        total += device + 0.0001 * server + (slots(down, down_bits) * 1e-3 if down else 0.0)
        assert rows[t]["sim_seconds_total"] == pytest.approx(total, rel=1e-12, abs=1e-12), (t, rows[t])
    assert rows[-1]["compute_seconds"] == pytest.approx(max(0.002 * n for n in sizes.values()) + 0.0001 * server)


def test_measured_compute_stays_available():
    cfg, ao, do = parse_args(["--algo", "fedavg", *DIGITS[:-4]])
    eng = Engine(cfg, ao, do, World(threads=1))
    assert "measured compute" in eng.channel.describe()
    row = eng.run_round(0)
    assert row["compute_seconds"] > 0 and row["sim_seconds_total"] > row["comm_seconds"]
