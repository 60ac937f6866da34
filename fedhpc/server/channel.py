"""Wireless channel of Mix2FLD (Sec. II-C, Eq. 4), usable with every algorithm (``--channel``).

The model, in the paper's words and symbols (y = up | dn):

* Uplink FDMA: each of the |D| devices gets W^up = W N_ch / |D|; the downlink
  is a multicast over the whole W^dn = W.
* Rayleigh block fading: in slot t, SNR_{d,t} = P^y h_{d,t} r^-alpha / (W^y N_0)
  with h ~ Exp(1), IID over devices and slots; a slot is decoded when
  SNR >= theta, so its success probability is
  ``exp(-theta W^y N_0 r^alpha / P^y)`` (:meth:`Channel.slot_success_probability`).
* Eq. 4: every decoded slot carries ``W^y log2(1 + theta) tau`` bits; the
  latency T^y is the smallest T whose decoded slots add up to the payload B^y,
  i.e. the slot of the n-th success with n = ceil(B^y / bits per good slot).
* T_max is shared equally by uplink and downlink; T^y above a direction's
  budget is a latency outage: the device is a straggler (uplink: its upload is
  lost this round; downlink: it keeps its local model).

Readings chosen where the text leaves room (each documented at its option):

* theta is a *linear* SNR (theta = 3, about 4.8 dB). Eq. 4 puts it inside
  ``log2(1 + theta)``, a Shannon rate of a linear ratio; the paper requires
  ``theta > 0``, which only constrains a linear value; and every dB quantity
  of Sec. IV carries its unit (dBm, dBm/Hz) while theta = 3 has none.
  ``theta_unit="db"`` gives the other reading.
* |D| is the number of devices that transmit in this round's uplink (the
  round's sampled clients; in the paper every device transmits every round).
* The noise power uses the direction's own bandwidth W^y (the per-device
  share on the uplink), as the SNR formula writes it: a narrower share has
  less noise, a higher SNR and fewer bits per slot.
* Budget per direction: ``T_max / 2`` by default ("allocates up to T_max time
  slots equally to the uplink and downlink"); ``direction_budget="full"``
  reads "an outage occurs when T^y > T_max" literally (T_max per direction).
  Only whole slots count (floor).
* Decoded slots accumulate (the transmitter resumes where it stopped, as with
  ARQ); failed slots carry nothing. On an outage the link reports the whole
  budget as its latency: the server waited until its deadline.

Which reading of the uplink budget (``uplink_bandwidth``). With the paper's settings read
literally (``fdma``, the default: 10 devices share W N_ch = 20 MHz, 2 MHz each) an uplink slot
carries 4,000 bits and succeeds with probability 0.887 (asymmetric, P^up = 23 dBm) or 0.998
(symmetric, P^up = 40 dBm): FD's 10x10 output table (3,200 bits) needs one good slot, but FL's
12,544-weight model (401,408 bits) needs 101, more than the 50-slot budget (and the 100 slots of
``full``). The symmetric setting raises only the slot success probability, not the bits a slot
carries, so FL's uploads are lost in *every* round under both settings (outage probability 1),
its global model never leaves its initialisation, and the paper's Fig. 2 ("Under symmetric
channels, FL achieves the highest accuracy") cannot hold; a round-1 upload with N_S = 50 seeds
(317,600 bits, 80 good slots) never passes either. Outage probabilities per upload under the
candidate readings (:meth:`Channel.outage_probability`; asymmetric / symmetric; budget T_max/2 =
50 slots unless said):

=============================================  ===============  ================  ================
reading                                        FL model          MixFLD round 1,   FD table
                                                                 N_S = 50
=============================================  ===============  ================  ================
``fdma`` (W N_ch / |D| = 2 MHz), literal       1 / 1             1 / 1             4e-48 / 8e-132
``fdma``, ``direction_budget=full`` (100)      1 / 1             0.0036 / 1e-34    ~0 / ~0
W per device (10 MHz)                          0.024 / 6e-45     3e-4 / 8e-56      5e-18 / 5e-97
``dedicated`` (W N_ch = 20 MHz per device)     0.074 / 7e-56     0.0067 / 9e-63    2e-8 / 4e-82
``dedicated``, ``full``                        1e-6 / 5e-134     1e-8 / 7e-142     ~0 / ~0
=============================================  ===============  ================  ================

No reading of the time budget alone (T_max per direction or split, per round or per upload) lets
FL's 101 slots of 4,000 bits through: the uplink share must be wider. ``dedicated`` (each device
has the N_ch uplink channels of W to itself, as if "W N_ch / |D|" allotted the channels rather than
divided them) is the reading under which Fig. 2's claims hold: on the symmetric channel FL's upload
passes almost surely (11 good slots of 40,000 bits, slot success 0.976), on the asymmetric one
the wider band's noise drops the slot success to 0.302, so FL loses 7.4% of its uploads and takes
about three times the slots (its round is the slowest device's), while FD's and the FLD family's
tables need one slot and Mix2FLD's N_S = 50 seeds pass with probability 0.993 (N_S = 10: 1 - 4e-7),
through the channel, as Alg. 1 sends them. It is the launch files' setting
(``launch/mix2fld_*.yaml``). It does not make FL's asymmetric outage large: a 16.7-point gap
(Sec. IV) is not implied by any reading of these numbers (at 2 MHz the window where FL passes on
one channel and not the other needs a 102-113-slot budget). The 20,000-bit downlink slots carry
the model in 21 good slots (success 0.988 per slot) under every reading.

Compute time (``device_seconds_per_sample``, ``server_seconds_per_sample``). The paper's
convergence time adds "the computing delays of devices and the server, which are measured using
tic-toc elapsed time"; measured on this machine (the default, both unset) the same command gave
27.6 s and 14.8 s. Set, they replace the measurement by a deterministic model: a device's compute
in a round is ``device_seconds_per_sample`` times the samples its local update processed (epochs x
its data), the server's is ``server_seconds_per_sample`` times the samples its own training
processed in that round (Mix2FLD's K_s steps x batch; 0 for an average), so the time axis is the
same on every machine (:class:`RoundLinks`).

Randomness: the link of (round, client, direction) draws its fading from its own
generator seeded with ``derive_seed(seed, "channel", direction, round, cid)``,
so results do not depend on the rank that simulates the client, on call order,
or on the number of ranks, and the channel keeps no state between calls
(nothing to checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..errors import ConfigError
from ..seeding import derive_seed

DIRECTIONS = ("up", "down")
#: readings of Sec. II-C's uplink share (ChannelOptions.uplink_bandwidth)
UPLINK_BANDWIDTHS = ("fdma", "dedicated")


#: the most slots per direction a link simulates (it draws a fading value for each)
MAX_BUDGET_SLOTS = 10_000_000
#: powers and noise densities beyond this many dBm overflow once multiplied out (10^30 W)
MAX_ABS_DBM = 300.0


def dbm_to_watt(dbm: float) -> float:
    """Power in dBm (or a density in dBm/Hz) to W (or W/Hz)."""
    return 10.0 ** ((dbm - 30.0) / 10.0)


@dataclass
class ChannelOptions:
    bandwidth_hz: float = field(default=10e6, metadata={
        "help": "W: downlink bandwidth; the uplink shares W * N_ch among the round's devices (Hz)"})
    num_channels: int = field(default=2, metadata={
        "help": "N_ch: uplink channels of W each, split equally over the devices that upload (FDMA)"})
    p_up_dbm: Optional[float] = field(default=None, metadata={
        "help": "P_up: device transmit power in dBm (default 23 for asymmetric, 40 for symmetric)"})
    p_down_dbm: float = field(default=40.0, metadata={"help": "P_dn: server transmit power in dBm"})
    distance_m: float = field(default=1000.0, metadata={"help": "r: device-server distance in metres"})
    pathloss_exponent: float = field(default=4.0, metadata={"help": "alpha: path-loss exponent (>= 2)"})
    noise_dbm_per_hz: float = field(default=-174.0, metadata={"help": "N_0: noise power spectral density in dBm/Hz"})
    theta: float = field(default=3.0, metadata={
        "help": "target SNR for decoding a slot (linear, as in the paper; see theta_unit)"})
    theta_unit: str = field(default="linear", metadata={
        "help": "linear (paper: theta = 3 is a ratio) | db (theta given in dB)"})
    slot_s: float = field(default=1e-3, metadata={"help": "tau: slot length = coherence time, in seconds"})
    t_max_s: float = field(default=0.1, metadata={"help": "T_max: latency budget of a round (up + down), seconds"})
    direction_budget: str = field(default="half", metadata={
        "help": "half (T_max split equally between up- and downlink) | full (T_max for each direction)"})
    uplink_bandwidth: str = field(default="fdma", metadata={
        "help": "fdma (Sec. II-C literally: W N_ch / |D| per device; FL's model never passes) | dedicated (W N_ch "
                "per device: the reading under which Fig. 2 holds; launch/mix2fld_*.yaml)"})
    device_seconds_per_sample: Optional[float] = field(default=None, metadata={
        "help": "a device's compute per training sample processed, in seconds (deterministic convergence time); "
                "unset: measured (tic-toc, as the paper, so it depends on the machine)"})
    server_seconds_per_sample: Optional[float] = field(default=None, metadata={
        "help": "the server's compute per sample of each of its training steps (K_s x batch a round), in "
                "seconds; unset: measured"})

    def validate(self) -> None:
        def positive(name: str, unit: str, example: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"channel option {name} must be a positive number ({unit}), got {v!r}; "
                                  f"e.g. {name}={example}")

        def finite(name: str, example: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"channel option {name} must be a finite number, got {v!r}; e.g. {name}={example}")

        positive("bandwidth_hz", "Hz", "10e6")
        if isinstance(self.num_channels, bool) or not isinstance(self.num_channels, int) or self.num_channels < 1:
            raise ConfigError(f"channel option num_channels must be an integer >= 1 (uplink channels N_ch), "
                              f"got {self.num_channels!r}; e.g. num_channels=2")
        if self.p_up_dbm is not None:
            finite("p_up_dbm", "23 (or leave it unset: 23 asymmetric, 40 symmetric)")
        finite("p_down_dbm", "40")
        positive("distance_m", "metres", "1000")
        finite("noise_dbm_per_hz", "-174")
        if not (isinstance(self.pathloss_exponent, (int, float)) and self.pathloss_exponent >= 2
                and math.isfinite(self.pathloss_exponent)):
            raise ConfigError(f"channel option pathloss_exponent must be >= 2 (Mix2FLD Sec. II-C: alpha >= 2), "
                              f"got {self.pathloss_exponent!r}; e.g. pathloss_exponent=4")
        if self.theta_unit not in ("linear", "db"):
            raise ConfigError(f"channel option theta_unit must be 'linear' or 'db', got {self.theta_unit!r}")
        if self.theta_unit == "linear":
            positive("theta", "a linear SNR ratio; use theta_unit=db for a value in dB", "3")
        else:
            finite("theta", "4.77")
        positive("slot_s", "seconds", "1e-3")
        positive("t_max_s", "seconds", "0.1")
        if self.direction_budget not in ("half", "full"):
            raise ConfigError(f"channel option direction_budget must be 'half' or 'full', "
                              f"got {self.direction_budget!r}")
        if self.uplink_bandwidth not in UPLINK_BANDWIDTHS:
            raise ConfigError(f"channel option uplink_bandwidth must be one of {', '.join(UPLINK_BANDWIDTHS)}, got "
                              f"{self.uplink_bandwidth!r}: fdma (W N_ch / |D| per device) or dedicated (W N_ch each)")
        for name in ("device_seconds_per_sample", "server_seconds_per_sample"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ConfigError(f"channel option {name} must be a number of seconds >= 0, or unset for the "
                                  f"measured time, got {v!r}; e.g. {name}=5.1e-3")
        if self.budget_slots() < 1:
            raise ConfigError(f"channel options give no whole slot per direction: t_max_s={self.t_max_s} "
                              f"({self.direction_budget}) over slot_s={self.slot_s}; raise t_max_s or lower slot_s")
        if self.budget_slots() > MAX_BUDGET_SLOTS:
            # every link draws one fading value per slot of the budget
            raise ConfigError(f"channel options give {self.budget_slots():,} slots per direction (t_max_s={self.t_max_s} "
                              f"over slot_s={self.slot_s}); every link draws a fading value per slot, so at most "
                              f"{MAX_BUDGET_SLOTS:,} are simulated: lower t_max_s or raise slot_s")
        # dBm and r^alpha are exponents: a value far outside physics overflows a float
        for name, value in (("p_up_dbm", self.p_up_dbm), ("p_down_dbm", self.p_down_dbm),
                            ("noise_dbm_per_hz", self.noise_dbm_per_hz)):
            if value is not None and abs(value) > MAX_ABS_DBM:
                raise ConfigError(f"channel option {name}={value} dBm overflows a float once converted to watts "
                                  f"(10^(dBm/10) mW); give a value within +-{MAX_ABS_DBM:g} dBm (transmit powers are "
                                  f"tens of dBm, the noise density -174 dBm/Hz)")
        try:
            float(self.distance_m) ** float(self.pathloss_exponent)
        except OverflowError:
            raise ConfigError(f"channel options distance_m={self.distance_m}, pathloss_exponent={self.pathloss_exponent}"
                              f" give a path loss r^alpha beyond a float; alpha is 2-6 in practice") from None

    def budget_slots(self) -> int:
        """Whole slots each direction may use: floor(T_max / 2 / tau) (or T_max / tau with ``full``)."""
        seconds = self.t_max_s / 2 if self.direction_budget == "half" else self.t_max_s
        # The tolerance keeps 0.05 / 0.001 = 49.999... from losing a slot to rounding.
        return int(math.floor(seconds / self.slot_s + 1e-9))

    def theta_linear(self) -> float:
        return 10.0 ** (self.theta / 10.0) if self.theta_unit == "db" else float(self.theta)


@dataclass
class LinkResult:
    ok: bool          # payload through within the direction's budget
    slots: int        # slots used (the whole budget when not ok)
    seconds: float    # slots * slot_s


class Channel:
    """Per-link latency and outage under Mix2FLD's channel; a pure function of (seed, round, client)."""

    MODES = ("none", "symmetric", "asymmetric")

    def __init__(self, mode: str, options: Optional[ChannelOptions] = None, seed: int = 0):
        if mode not in self.MODES:
            raise ConfigError(f"unknown --channel {mode!r}; choose one of {', '.join(self.MODES)}")
        self.mode = mode
        self.options = options if options is not None else ChannelOptions()
        self.options.validate()
        self.seed = int(seed)
        o = self.options
        p_up = o.p_up_dbm if o.p_up_dbm is not None else (23.0 if mode == "asymmetric" else 40.0)
        self.p_up_dbm = float(p_up)
        self.power_w = {"up": dbm_to_watt(self.p_up_dbm), "down": dbm_to_watt(o.p_down_dbm)}
        self.theta = o.theta_linear()
        self.noise_w_per_hz = dbm_to_watt(o.noise_dbm_per_hz)
        self.pathloss = float(o.distance_m) ** float(o.pathloss_exponent)   # r^alpha
        self.budget = o.budget_slots()

    # ------------------------------------------------------------------ closed forms

    def bandwidth_hz(self, direction: str, num_uplink_devices: int = 1) -> float:
        """W^up = W N_ch / |D| (FDMA share; ``dedicated``: W N_ch) or W^dn = W."""
        _check_direction(direction)
        if direction == "down":
            return float(self.options.bandwidth_hz)
        if int(num_uplink_devices) < 1:
            raise ValueError(f"num_uplink_devices must be >= 1, got {num_uplink_devices}")
        share = 1 if self.options.uplink_bandwidth == "dedicated" else int(num_uplink_devices)
        return self.options.bandwidth_hz * self.options.num_channels / share

    def bits_per_slot(self, direction: str, num_uplink_devices: int = 1) -> float:
        """Bits a decoded slot carries: W^y log2(1 + theta) tau (Eq. 4)."""
        return self.bandwidth_hz(direction, num_uplink_devices) * math.log2(1.0 + self.theta) * self.options.slot_s

    def slot_success_probability(self, direction: str, num_uplink_devices: int = 1) -> float:
        """P(SNR >= theta) = P(h >= theta W^y N_0 r^alpha / P^y) = exp(-theta W^y N_0 r^alpha / P^y), h ~ Exp(1)."""
        if self.mode == "none":
            _check_direction(direction)
            return 1.0
        w = self.bandwidth_hz(direction, num_uplink_devices)
        return math.exp(-self.theta * w * self.noise_w_per_hz * self.pathloss / self.power_w[direction])

    def good_slots_needed(self, payload_bytes: float, direction: str, num_uplink_devices: int = 1) -> int:
        """n = ceil(8 B / bits per good slot): decoded slots the payload needs."""
        bits = 8.0 * float(payload_bytes)
        if bits <= 0:
            return 0
        ratio = bits / self.bits_per_slot(direction, num_uplink_devices)
        # An exact multiple must not need an extra slot because of float rounding.
        return max(1, math.ceil(ratio - 1e-9 * ratio))

    def outage_probability(self, direction: str, payload_bytes: float, num_uplink_devices: int = 1) -> float:
        """P(fewer than n successes in the budget) = P(Binomial(budget, p) < n): the straggler rate."""
        if self.mode == "none" or payload_bytes <= 0:
            return 0.0
        n = self.good_slots_needed(payload_bytes, direction, num_uplink_devices)
        if n > self.budget:
            return 1.0
        p = self.slot_success_probability(direction, num_uplink_devices)
        return float(sum(math.comb(self.budget, k) * p ** k * (1 - p) ** (self.budget - k) for k in range(n)))

    # ------------------------------------------------------------------ sampled links

    def uplink(self, round_index: int, cid: int, payload_bytes: float, num_uplink_devices: int) -> LinkResult:
        """Device ``cid`` unicasts ``payload_bytes`` on its FDMA share among ``num_uplink_devices`` devices."""
        return self._link("up", round_index, cid, payload_bytes, num_uplink_devices)

    def downlink(self, round_index: int, cid: int, payload_bytes: float) -> LinkResult:
        """The server's multicast of ``payload_bytes`` as received by device ``cid`` (its own fading)."""
        return self._link("down", round_index, cid, payload_bytes, 1)

    def _link(self, direction: str, round_index: int, cid: int, payload_bytes: float,
              num_uplink_devices: int) -> LinkResult:
        _check_direction(direction)
        if not math.isfinite(payload_bytes) or payload_bytes < 0:
            raise ValueError(f"payload_bytes must be finite and >= 0, got {payload_bytes}")
        if self.mode == "none" or payload_bytes == 0:
            return LinkResult(ok=True, slots=0, seconds=0.0)
        n = self.good_slots_needed(payload_bytes, direction, num_uplink_devices)
        if n > self.budget:
            # Even a slot-perfect channel cannot carry it: no draw can change the outcome.
            return self._outage()
        rng = np.random.default_rng(derive_seed(self.seed, "channel", direction, int(round_index), int(cid)))
        h = rng.exponential(1.0, size=self.budget)        # Rayleigh block fading: |h|^2 ~ Exp(1) per slot
        w = self.bandwidth_hz(direction, num_uplink_devices)
        snr = self.power_w[direction] * h / (self.pathloss * w * self.noise_w_per_hz)
        received = np.cumsum(snr >= self.theta)            # decoded slots so far, slot by slot
        t = int(np.searchsorted(received, n, side="left"))  # 0-based slot of the n-th success
        if t >= self.budget:
            return self._outage()
        return LinkResult(ok=True, slots=t + 1, seconds=(t + 1) * self.options.slot_s)

    def _outage(self) -> LinkResult:
        return LinkResult(ok=False, slots=self.budget, seconds=self.budget * self.options.slot_s)

    # ------------------------------------------------------------------ report

    def models_compute(self) -> bool:
        """Whether compute time comes from the per-sample rates (the same on every machine), not a clock."""
        return self.options.device_seconds_per_sample is not None or self.options.server_seconds_per_sample is not None

    def describe(self) -> str:
        if self.mode == "none":
            return "channel none: every link succeeds at once"
        o = self.options
        theta = f"{o.theta:g} dB" if o.theta_unit == "db" else f"{o.theta:g} (linear)"
        uplink = f"W*{o.num_channels}/|D|" if o.uplink_bandwidth == "fdma" else f"W*{o.num_channels} (dedicated)"
        compute = ("measured compute" if not self.models_compute()
                   else f"compute {_per_sample(o.device_seconds_per_sample)} per device sample, "
                        f"{_per_sample(o.server_seconds_per_sample)} per server sample")
        return (f"channel {self.mode} (Mix2FLD Eq. 4): W {o.bandwidth_hz / 1e6:g} MHz, uplink {uplink} "
                f"per device, P_up {self.p_up_dbm:g} dBm, P_dn {o.p_down_dbm:g} dBm, r {o.distance_m:g} m, "
                f"alpha {o.pathloss_exponent:g}, N0 {o.noise_dbm_per_hz:g} dBm/Hz, theta {theta}, "
                f"tau {o.slot_s * 1e3:g} ms, T_max {o.t_max_s * 1e3:g} ms ({self.budget} slots per direction); "
                f"downlink slot success {self.slot_success_probability('down'):.3f}; {compute}")


class RoundLinks:
    """The channel's bookkeeping in the engine's rounds: each sampled device's uplink and downlink
    in its row of the round's buffer (summed over ranks with everything else, so every rank
    reads every device's), then the round's link metrics and the simulated clock.

    Payloads are what the ledger booked for the device this round: its upload, and what it
    receives. A downlink outage leaves the device on its local model until a later downlink
    succeeds (the algorithm's ``on_downlink_outage``); an uplink outage makes it a straggler
    whose upload is lost this round.

    Compute: the engine hands in what it measured (a device's ``compute_s``, the round's
    ``server_s``) and what was processed (the device's training samples, the samples the
    algorithm's server trained on in ``aggregate``: its ``server_trained_samples``); with ``device_seconds_per_sample`` /
    ``server_seconds_per_sample`` set the simulated clock counts the latter at those rates and
    the machine's speed never enters it.
    """

    #: per sampled device: uplink ok, downlink ok, uplink s, downlink s, compute s
    FIELDS = 5

    def __init__(self, channel: Channel, num_ledger_kinds: int):
        self.channel = channel
        self.num_ledger_kinds = num_ledger_kinds
        #: Mix2FLD's convergence time so far (checkpointed by the engine)
        self.sim_seconds_total = 0.0

    def device(self, rows: torch.Tensor, round_index: int, cid: int, position: int, num_devices: int,
               sent: torch.Tensor, compute_s: float, samples: Optional[float] = None) -> Tuple[bool, bool]:
        """Device ``cid``'s links this round, written into ``rows[position]``; (uplink ok, downlink ok).
        ``sent``: the ledger's bytes for this device (up kinds, then down kinds); ``compute_s``: its
        measured compute; ``samples``: the training samples its local update processed (the
        compute model's count, required when ``device_seconds_per_sample`` is set)."""
        rate = self.channel.options.device_seconds_per_sample
        if rate is not None:
            if samples is None:
                raise ValueError("device_seconds_per_sample is set: pass the samples the device processed")
            compute_s = rate * float(samples)
        k = self.num_ledger_kinds
        up = self.channel.uplink(round_index, cid, float(sent[:k].sum()), num_devices)
        down = self.channel.downlink(round_index, cid, float(sent[k:].sum()))
        row = rows[position]
        row.copy_(torch.tensor([float(up.ok), float(down.ok), up.seconds, down.seconds, compute_s],
                               dtype=row.dtype))
        return up.ok, down.ok

    def round_metrics(self, rows: torch.Tensor, server_s: float, server_samples: float = 0.0) -> Dict[str, float]:
        """The round's link metrics from every device's row (after the sum over ranks). ``server_s``:
        the server's measured time; ``server_samples``: the samples its training processed this
        round (identical on every rank), which ``server_seconds_per_sample`` turns into its time."""
        rate = self.channel.options.server_seconds_per_sample
        if rate is not None:
            server_s = rate * float(server_samples)
        num_devices = rows.shape[0]
        up_ok, down_ok, up_s, down_s, compute_s = rows.cpu().unbind(1)
        # Devices compute and upload in parallel (FDMA); the server converts; the broadcast
        # reaches every device in parallel: Mix2FLD's convergence time adds these delays.
        sim = float((compute_s + up_s).max()) + server_s + float(down_s.max())
        self.sim_seconds_total += sim
        return {
            "uplink_outages": int(num_devices - up_ok.sum()),
            "downlink_outages": int(num_devices - down_ok.sum()),
            "comm_seconds": float(up_s.max() + down_s.max()),
            "compute_seconds": float(compute_s.max()) + server_s,
            "sim_round_seconds": sim,
            "sim_seconds_total": self.sim_seconds_total,
        }


def _per_sample(seconds: Optional[float]) -> str:
    return "measured" if seconds is None else f"{seconds:g} s"


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
