"""Mix2FLD's wireless channel (Sec. II-C, Eq. 4): closed forms against Monte Carlo, latency and outage bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhpc.algorithms.base import derive_seed
from fedhpc.errors import ConfigError
from fedhpc.server.channel import Channel, ChannelOptions, LinkResult

MODEL_BITS = 32 * 12_544        # Mix2FLD's CNN, 32-bit weights: 401,408 bits
TABLE_BITS = 32 * 10 * 10       # FD's 10x10 output table: 3,200 bits


def watt(dbm: float) -> float:
    return 10 ** (dbm / 10) / 1000


def success_closed_form(theta, w_hz, p_dbm, r=1000.0, alpha=4.0, n0_dbm=-174.0) -> float:
    """exp(-theta W N0 r^alpha / P), written out here independently of the module."""
    return math.exp(-theta * w_hz * watt(n0_dbm) * r ** alpha / watt(p_dbm))


def binom_cdf_below(n: int, trials: int, p: float) -> float:
    """P(Binomial(trials, p) < n) by a plain loop."""
    return sum(math.comb(trials, k) * p ** k * (1 - p) ** (trials - k) for k in range(n))


def within_4_sigma(hits: int, draws: int, p: float) -> bool:
    sigma = math.sqrt(max(p * (1 - p), 1e-12) / draws)
    return abs(hits / draws - p) <= 4 * sigma + 1e-12


# ----------------------------------------------------------------------------- slot success

# (mode, options, direction, |D|, W^y, P^y in dBm, theta linear)
SETTINGS = [
    ("asymmetric", {}, "up", 10, 2e6, 23.0, 3.0),            # paper: p ~ 0.887
    ("asymmetric", {}, "up", 1, 20e6, 23.0, 3.0),            # one device takes both channels: p ~ 0.302
    ("symmetric", {}, "up", 10, 2e6, 40.0, 3.0),             # p ~ 0.998
    ("asymmetric", {}, "down", 10, 10e6, 40.0, 3.0),         # p ~ 0.988
    ("asymmetric", {"theta": 6.0, "theta_unit": "db", "distance_m": 1500.0},
     "up", 4, 5e6, 23.0, 10 ** 0.6),                         # dB reading of theta, farther device
]


@pytest.mark.parametrize("mode,opts,direction,devices,w_hz,p_dbm,theta", SETTINGS)
def test_slot_success_probability_matches_closed_form_and_monte_carlo(mode, opts, direction, devices, w_hz,
                                                                      p_dbm, theta):
    r = opts.get("distance_m", 1000.0)
    expected = success_closed_form(theta, w_hz, p_dbm, r=r)
    # A one-slot budget and a one-slot payload: the link is ok exactly when its slot decodes.
    o = ChannelOptions(t_max_s=2e-3, **opts)
    ch = Channel(mode, o, seed=7)
    assert ch.budget == 1
    assert ch.slot_success_probability(direction, devices) == pytest.approx(expected, rel=1e-12)
    payload = 1.0                                            # 8 bits: one good slot whatever the bandwidth
    draws = 20_000
    hits = 0
    for cid in range(draws):
        res = ch.uplink(3, cid, payload, devices) if direction == "up" else ch.downlink(3, cid, payload)
        hits += res.ok
    assert within_4_sigma(hits, draws, expected), (hits / draws, expected)


def test_latency_of_one_good_slot_is_geometric():
    """n = 1: P(T = k) = (1-p)^(k-1) p, truncated at the budget; check the mean and the outage rate."""
    o = ChannelOptions(t_max_s=0.01)                         # 5 slots per direction
    ch = Channel("asymmetric", o, seed=1)
    p = success_closed_form(3.0, 20e6, 23.0)                 # |D| = 1: p ~ 0.302, so outages do occur
    draws = 20_000
    res = [ch.uplink(0, cid, TABLE_BITS / 8, 1) for cid in range(draws)]
    out = np.array([not x.ok for x in res])
    q_out = (1 - p) ** 5
    assert within_4_sigma(int(out.sum()), draws, q_out)
    slots = np.array([x.slots for x in res])
    assert slots[out].tolist() == [5] * int(out.sum())
    # Mean over successful links of a geometric truncated at 5, and its standard error.
    pk = np.array([(1 - p) ** (k - 1) * p for k in range(1, 6)]) / (1 - q_out)
    mean = float((np.arange(1, 6) * pk).sum())
    sd = math.sqrt(float(((np.arange(1, 6) - mean) ** 2 * pk).sum()))
    ok_slots = slots[~out]
    assert abs(ok_slots.mean() - mean) <= 4 * sd / math.sqrt(len(ok_slots))


def test_outage_rate_matches_binomial_tail():
    """Outage = fewer than n decoded slots within the budget: P(Binomial(50, p) < n)."""
    ch = Channel("asymmetric", ChannelOptions(), seed=2)
    bits_per_slot = 20e6 * math.log2(4) * 1e-3               # |D| = 1: 40,000 bits per good slot
    n = 15
    payload_bytes = (n - 0.5) * bits_per_slot / 8            # needs exactly 15 good slots
    assert ch.good_slots_needed(payload_bytes, "up", 1) == n
    p = success_closed_form(3.0, 20e6, 23.0)
    q = binom_cdf_below(n, 50, p)
    assert 0.2 < q < 0.8                                     # a setting where the test can tell
    assert ch.outage_probability("up", payload_bytes, 1) == pytest.approx(q, rel=1e-9)
    draws = 5_000
    outages = sum(not ch.uplink(9, cid, payload_bytes, 1).ok for cid in range(draws))
    assert within_4_sigma(outages, draws, q)


# ----------------------------------------------------------------------------- bookkeeping

def reference_link(seed, direction, rnd, cid, payload_bytes, w_hz, p_dbm, theta, budget, tau=1e-3):
    """Eq. 4 slot by slot: add W log2(1+theta) tau bits per decoded slot until the payload is in."""
    rng = np.random.default_rng(derive_seed(seed, "channel", direction, rnd, cid))
    h = rng.exponential(1.0, size=budget)
    received, bits = 0.0, 8 * payload_bytes
    for t in range(budget):
        snr = watt(p_dbm) * h[t] * 1000.0 ** -4 / (w_hz * watt(-174.0))
        if snr >= theta:
            received += w_hz * math.log2(1 + theta) * tau
        if received >= bits - 1e-6:
            return True, t + 1
    return False, budget


def test_latency_matches_a_slot_by_slot_reference():
    ch = Channel("asymmetric", ChannelOptions(), seed=11)
    payloads = [TABLE_BITS / 8, 1_000, 9_472 / 8 * 10, 80_000, 100_000, 150_000]
    checked_outages = checked_ok = 0
    for devices in (1, 3, 10):
        w_up = 10e6 * 2 / devices
        for cid in range(60):
            for payload in payloads:
                up = ch.uplink(4, cid, payload, devices)
                ok, slots = reference_link(11, "up", 4, cid, payload, w_up, 23.0, 3.0, 50)
                assert (up.ok, up.slots) == (ok, slots), (devices, cid, payload)
                assert up.seconds == pytest.approx(slots * 1e-3)
                checked_ok += ok
                checked_outages += not ok
            down = ch.downlink(4, cid, MODEL_BITS / 8)
            assert (down.ok, down.slots) == reference_link(11, "down", 4, cid, MODEL_BITS / 8, 10e6, 40.0, 3.0, 50)
    assert checked_ok > 100 and checked_outages > 100          # both branches were exercised


@pytest.mark.parametrize("devices", [1, 3, 10, 25])
def test_latency_is_ceil_of_bits_over_bits_per_slot_when_every_slot_decodes(devices):
    ch = Channel("asymmetric", ChannelOptions(p_up_dbm=200.0, p_down_dbm=200.0, direction_budget="full"), seed=0)
    assert ch.slot_success_probability("up", devices) > 1 - 1e-12
    per_slot_up = 10e6 * 2 / devices * 2 * 1e-3             # W N_ch / |D| * log2(1 + 3) * tau
    per_slot_down = 10e6 * 2 * 1e-3
    assert ch.bits_per_slot("up", devices) == pytest.approx(per_slot_up)
    for nbytes in [1, 499, 500, 501, 2_500, 4_000, 25_000, 49_999, 50_000, 50_001, 125_000]:
        for direction, per_slot in (("up", per_slot_up), ("down", per_slot_down)):
            # Integer arithmetic where the share is an integer number of bits, so exact multiples are exact.
            need = math.ceil(round(8 * nbytes / per_slot, 9))
            res = ch.uplink(2, 5, nbytes, devices) if direction == "up" else ch.downlink(2, 5, nbytes)
            if need <= 100:
                assert res == LinkResult(True, need, pytest.approx(need * 1e-3)), (direction, nbytes)
            else:
                assert res == LinkResult(False, 100, pytest.approx(0.1)), (direction, nbytes)


def test_exact_multiple_needs_no_extra_slot_and_budget_edges():
    strong = dict(p_up_dbm=200.0, p_down_dbm=200.0)
    half = Channel("asymmetric", ChannelOptions(**strong), seed=0)
    full = Channel("asymmetric", ChannelOptions(direction_budget="full", **strong), seed=0)
    assert (half.budget, full.budget) == (50, 100)
    # 4,000 bits per uplink slot with 10 devices: 50 slots carry exactly 200,000 bits.
    assert half.uplink(0, 0, 200_000 / 8, 10) == LinkResult(True, 50, pytest.approx(0.05))
    assert half.uplink(0, 0, 200_008 / 8, 10) == LinkResult(False, 50, pytest.approx(0.05))
    assert full.uplink(0, 0, 200_008 / 8, 10) == LinkResult(True, 51, pytest.approx(0.051))
    assert full.uplink(0, 0, 400_000 / 8, 10) == LinkResult(True, 100, pytest.approx(0.1))
    # FL's model needs 101 uplink slots: an outage under either budget reading, even with perfect slots.
    assert half.uplink(0, 0, MODEL_BITS / 8, 10) == LinkResult(False, 50, pytest.approx(0.05))
    assert full.uplink(0, 0, MODEL_BITS / 8, 10) == LinkResult(False, 100, pytest.approx(0.1))
    # A budget that is not a whole number of slots keeps only the whole ones.
    assert Channel("asymmetric", ChannelOptions(t_max_s=0.0055), seed=0).budget == 2


def test_paper_defaults_sanity_numbers():
    asym = Channel("asymmetric", ChannelOptions(), seed=0)
    sym = Channel("symmetric", ChannelOptions(), seed=0)
    assert asym.p_up_dbm == 23.0 and sym.p_up_dbm == 40.0
    assert Channel("asymmetric", ChannelOptions(p_up_dbm=30.0), seed=0).p_up_dbm == 30.0
    assert asym.slot_success_probability("up", 10) == pytest.approx(0.88717, abs=1e-5)
    assert sym.slot_success_probability("up", 10) == pytest.approx(0.99761, abs=1e-5)
    assert asym.slot_success_probability("down") == pytest.approx(0.98813, abs=1e-5)
    assert asym.bits_per_slot("up", 10) == pytest.approx(4_000)        # theta linear: log2(1 + 3) = 2
    assert asym.bits_per_slot("down") == pytest.approx(20_000)
    assert asym.good_slots_needed(MODEL_BITS / 8, "up", 10) == 101
    assert asym.good_slots_needed(TABLE_BITS / 8, "up", 10) == 1
    assert asym.good_slots_needed(MODEL_BITS / 8, "down") == 21
    assert asym.outage_probability("up", MODEL_BITS / 8, 10) == 1.0
    assert asym.outage_probability("up", TABLE_BITS / 8, 10) == pytest.approx(0.11283 ** 50, rel=1e-3)
    assert asym.outage_probability("down", MODEL_BITS / 8) < 1e-20


# ----------------------------------------------------------------------------- seeding

def test_results_do_not_depend_on_call_order_or_instance():
    a = Channel("asymmetric", ChannelOptions(), seed=5)
    b = Channel("asymmetric", ChannelOptions(), seed=5)
    keys = [(rnd, cid) for rnd in range(4) for cid in range(30)]
    first = {k: (a.uplink(*k, 60_000, 1), a.downlink(*k, 60_000)) for k in keys}
    # "rank 1" simulates the odd clients in reverse order, downlink first; "rank 0" the even ones.
    order = sorted(keys, key=lambda k: (k[1] % 2, -k[0], -k[1]))
    for k in order:
        down = b.downlink(*k, 60_000)
        up = b.uplink(*k, 60_000, 1)
        assert (up, down) == first[k]
    # The draws are genuinely random: links differ across clients, rounds, directions and seeds.
    ups = [first[k][0].slots for k in keys]
    assert len(set(ups)) > 5
    c = Channel("asymmetric", ChannelOptions(), seed=6)
    assert [c.uplink(*k, 60_000, 1).slots for k in keys] != ups
    up_vs_down = [(first[k][0].slots, first[k][1].slots) for k in keys]
    same_draws = Channel("symmetric", ChannelOptions(p_up_dbm=40.0, num_channels=1), seed=5)
    # Up with one device on one channel equals the downlink's bandwidth and power: only the stream differs.
    assert [same_draws.uplink(*k, 60_000, 1).slots for k in keys] != [d for _, d in up_vs_down]


def test_none_mode_and_empty_payloads():
    none = Channel("none", ChannelOptions(), seed=0)
    assert none.uplink(0, 0, 1e12, 1000) == LinkResult(True, 0, 0.0)
    assert none.downlink(3, 7, 1e12) == LinkResult(True, 0, 0.0)
    assert none.slot_success_probability("up", 10) == 1.0
    assert none.outage_probability("up", 1e12, 10) == 0.0
    assert "none" in none.describe()
    asym = Channel("asymmetric", ChannelOptions(), seed=0)
    assert asym.uplink(0, 0, 0, 10) == LinkResult(True, 0, 0.0)
    assert asym.downlink(0, 0, 0.0) == LinkResult(True, 0, 0.0)
    line = asym.describe()
    assert "asymmetric" in line and "23 dBm" in line and "50 slots" in line and "\n" not in line
    with pytest.raises(ValueError):
        asym.uplink(0, 0, -1, 10)
    with pytest.raises(ValueError):
        asym.uplink(0, 0, 100, 0)
    with pytest.raises(ValueError):
        asym.slot_success_probability("sideways")


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("bad,name", [
    ({"bandwidth_hz": 0.0}, "bandwidth_hz"),
    ({"bandwidth_hz": float("nan")}, "bandwidth_hz"),
    ({"num_channels": 0}, "num_channels"),
    ({"num_channels": 1.5}, "num_channels"),
    ({"p_up_dbm": float("inf")}, "p_up_dbm"),
    ({"p_down_dbm": "40"}, "p_down_dbm"),
    ({"distance_m": -1.0}, "distance_m"),
    ({"pathloss_exponent": 1.5}, "pathloss_exponent"),
    ({"noise_dbm_per_hz": float("nan")}, "noise_dbm_per_hz"),
    ({"theta": 0.0}, "theta"),
    ({"theta": -3.0}, "theta"),
    ({"theta_unit": "dB!"}, "theta_unit"),
    ({"slot_s": 0.0}, "slot_s"),
    ({"t_max_s": -0.1}, "t_max_s"),
    ({"t_max_s": 1e-3}, "t_max_s"),                          # half a slot per direction
    ({"direction_budget": "both"}, "direction_budget"),
    # values a float cannot carry through 10^(dBm/10) or r^alpha (an OverflowError before)
    ({"p_down_dbm": 1e9}, "p_down_dbm"),
    ({"p_up_dbm": -400.0}, "p_up_dbm"),
    ({"noise_dbm_per_hz": 1e9}, "noise_dbm_per_hz"),
    ({"pathloss_exponent": 1e9}, "pathloss_exponent"),
    # a fading draw per slot: 5e11 slots asked for 3.6 TiB (a MemoryError before)
    ({"t_max_s": 1e9}, "t_max_s"),
])
def test_invalid_options_raise_config_error_naming_the_option(bad, name):
    with pytest.raises(ConfigError, match=name):
        ChannelOptions(**bad).validate()
    with pytest.raises(ConfigError, match=name):
        Channel("asymmetric", ChannelOptions(**bad), seed=0)


def test_valid_edge_options_and_unknown_mode():
    ChannelOptions(theta=-3.0, theta_unit="db").validate()   # a negative dB target is a valid ratio < 1
    ChannelOptions(t_max_s=2e-3).validate()                  # one slot per direction
    ChannelOptions(t_max_s=20e3).validate()                  # the most slots simulated (1e7 per direction)
    ChannelOptions(p_down_dbm=300.0, noise_dbm_per_hz=-300.0).validate()
    with pytest.raises(ConfigError, match="asymmetric"):
        Channel("fading", ChannelOptions(), seed=0)


def test_fl_uploads_and_50_seed_round1_uploads_are_lost_under_both_paper_settings():
    """The module docstring's arithmetic: the symmetric setting raises P^up (so the slot success
    probability), not the 4,000 bits a slot carries, so FL's 401,408 bits (101 good slots) never
    fit the 50-slot budget under either setting, nor the 100 of ``full``; nor does FLD's round-1
    upload of N_S = 50 MNIST seeds (80 good slots), while N_S = 10 (17 good slots) passes."""
    seeds = lambda n_s, label_bytes: TABLE_BITS / 8 + n_s * (784 + label_bytes)  # noqa: E731
    for mode in ("asymmetric", "symmetric"):
        for budget in ("half", "full"):
            ch = Channel(mode, ChannelOptions(direction_budget=budget), seed=0)
            assert ch.bits_per_slot("up", 10) == pytest.approx(4_000)
            assert ch.good_slots_needed(MODEL_BITS / 8, "up", 10) == 101 > ch.budget
            assert ch.outage_probability("up", MODEL_BITS / 8, 10) == 1.0
            assert not any(ch.uplink(t, d, MODEL_BITS / 8, 10).ok for t in range(20) for d in range(10))
        ch = Channel(mode, ChannelOptions(), seed=0)
        for label_bytes in (1, 2):  # FLD's raw seeds, MixFLD / Mix2FLD's mixed ones
            assert ch.good_slots_needed(seeds(50, label_bytes), "up", 10) == 80 > ch.budget == 50
            assert ch.outage_probability("up", seeds(50, label_bytes), 10) == 1.0
            assert ch.good_slots_needed(seeds(10, label_bytes), "up", 10) == 17
            assert ch.outage_probability("up", seeds(10, label_bytes), 10) < 1e-20
    # what FL would need: 101 uplink slots per direction
    wide = Channel("symmetric", ChannelOptions(t_max_s=0.202), seed=0)
    assert wide.budget == 101 and wide.outage_probability("up", MODEL_BITS / 8, 10) < 1.0
