"""FLD: federated learning after distillation (Mix2FLD paper Sec. III-A, Eq. 5, Alg. 1).

Uplink as in FD, downlink as in FL. Every round each device trains the downloaded
global model with plain SGD on its own data (Eq. 1) while averaging its softmax
outputs per label (Eq. 2), and uploads only that N_L x N_L table; in the first round
it also uploads N_S seed samples. The server averages the tables per label (Eq. 3)
into G_out, then converts outputs into a model: starting from the current global
model it runs K_s SGD iterations of

    CE(F(s), label(s)) + beta * psi(F(s), G_out[label(s)])                   (Eq. 5)

on the collected seeds (psi the cross-entropy to the teacher row, as in FD), and
broadcasts the weights; devices replace their model with them. The conversion is
real training, so it runs data-parallel over every rank
(:class:`fedhpc.server.trainer.ServerTrainer`).

Where the conversion starts (``--server-init``). The paper has the server transfer the
teacher's knowledge "to an untrained student model (i.e., a global model)" (Sec. I); Alg. 1
and Eq. 5 do not say whether the student is re-initialised every round. ``previous``
(default): the global model broadcast last round, so K_s steps refine the model the rounds
before trained. ``initial``: the run's initial model every round, the untrained student read
literally, so K_s steps must train a whole model from scratch each round. The default is the
one that trains: on digits' bare run (K_s = 50 a round, 200 samples) Mix2FLD reaches 83% from
the previous model and stays at chance (9.8%) from the initial one.

K_s (``--server-steps``): 3,200 is the paper's (its 100 MNIST seeds at batch 1: 32 passes a
round), which ``launch/mix2fld_mnist.yaml`` sets. A run that does not set it gets
:attr:`FLD.AUTO_SERVER_PASSES` passes over its server's samples (:mod:`fedhpc.config.auto`):
the paper's 3,200 on digits' 200 seeds at batch 32 were 512 passes, four minutes a round on
2 cores.

What the seeds are is the one thing the family's members change (:meth:`make_seeds`,
:meth:`server_samples`): FLD sends raw samples (flagged by the privacy audit: raw data
leaves the device), MixFLD mixups (:mod:`fedhpc.algorithms.distillation.mixfld`), Mix2FLD mixups
that the server inversely mixes (:mod:`fedhpc.algorithms.distillation.mix2fld`). A seed with a soft
label distils from the same mixture of teacher rows; rows of labels without a global
output are left out (renormalised), and a seed with none distils nothing.

Fig. 2's metric, ``reference_device_accuracy``, is the reference device's model after round t's
download, as for every method: here the converted global model it would start round t + 1 from
(or the model it kept when the broadcast did not reach it).

Readings: seeds are made once, on every device, before the first round's training
(Alg. 1, p = 1), in model-input space; their bytes (8-bit pixels) are booked on each
device's first upload, so the channel model sees the larger round-1 payload.
Until a table has arrived, and in a round in which no device's table arrived (all
uplinks lost), the server keeps the global model as it is: it has nothing new to convert,
and K_s more steps on the old table would be training Alg. 1 does not do.

Which seeds reach the server (``--seed-delivery``):

* ``always`` (default): every device's seeds, whatever the channel does to its round-1
  uplink (devices not sampled in round 1 send theirs too). Alg. 1 line 6 sends the seeds
  in the round-1 uplink, which a latency outage loses; but with the paper's channel read
  literally (:mod:`fedhpc.server.channel`, ``uplink_bandwidth=fdma``: 4,000 bits per good
  uplink slot, 50 slots per direction) a round-1 upload with N_S = 50 MNIST seeds (50 x 6,272
  bits of pixels, plus their label bytes, and the 3,200-bit table: about 317,000 bits) needs
  80 good slots, so under either channel of Fig. 2/3 *no* device's seeds would arrive, and
  the N_S = 50 curves would be of a global model that never leaves its initialisation.
  (N_S = 10 needs 17 good slots and passes almost surely.)
* ``channel``: Alg. 1 read literally, what the launch files run: under the channel reading
  they use (``uplink_bandwidth=dedicated``, under which Fig. 2 holds) N_S = 50 seeds need 8
  good slots of 40,000 bits and arrive with probability 0.993 per device on the asymmetric
  channel (N_S = 10: 1 - 4e-7). A device's seeds reach the server only with its
  round-1 upload: if it was sampled in round 1 and that uplink had no outage. A straggler's
  seeds are lost for good (Alg. 1 sends them only at p = 1), and a device not sampled in
  round 1 sends none. The server learns which uploads arrived from the round's sum (each
  device adds a 1 at its own id, an indicator the unicast itself carries: no extra bytes),
  so the set is built after round 1's uploads, in the aggregation, identically on every
  rank. With no seed at the server (or, for Mix2FLD, no pair of devices to invert) the
  conversion is skipped and the global model stays as it is, with a warning once; the
  ``seeds_delivered`` metric says how many arrived. With full participation and no outage
  in round 1 the run is the same as ``always``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ...analysis.privacy import audit_raw_leaves, sample_privacy
from ...batched import weighted_task_loss
from ...errors import CheckpointError, ConfigError
from ...exchanges import label_outputs
from ...exchanges.seed_samples import SeedSampleOptions, SeedSet, collect_seeds, raw_seeds
from ...server.trainer import ServerTrainConfig, ServerTrainer
from .. import register_algorithm
from ..base import Algorithm, Upload, derive_seed, task_loss
from .fd import group_outputs, label_relative_change

SEED_DELIVERIES = ("always", "channel")
#: --server-init: where the output-to-model conversion starts each round
SERVER_INITS = ("previous", "initial")
#: K_s of a run that does not set --server-steps: passes over the server's samples (FLD.AUTO_SERVER_PASSES)
AUTO_SERVER_PASSES = 8


@dataclass
class FLDOptions(SeedSampleOptions):
    beta: float = field(default=0.01, metadata={"help": "weight beta of the distillation term in Eq. 5 (paper 0.01)"})
    server_steps: int = field(default=3200, metadata={
        "help": "K_s: server SGD iterations per round (paper 3,200, which launch/mix2fld_mnist.yaml sets)",
        "auto": f"{AUTO_SERVER_PASSES} passes over the server's samples at --server-batch, 50 steps on digits' bare "
                f"run (fedhpc.config.auto)"})
    server_batch: int = field(default=32, metadata={"help": "seed samples per server iteration"})
    # method_specific: the step size eta of plain SGD on Eq. 5, K_s steps every round; the one-shot
    # server trainers' (MixFL, XorMixFL, standalone) is --server-optimizer's learning rate, Adam's
    # 1e-3 by default, so a value chosen for one is 5-50 times off for the other (FedAvg's is a step)
    server_lr: float = field(default=0.01, metadata={"help": "server learning rate eta (paper 0.01, as the devices')",
                                                     "method_specific": True})
    server_micro_batch: int = field(default=8, metadata={
        "help": "samples per micro-batch of the data-parallel server step (fixed: results do not depend on ranks)"})
    server_init: str = field(default="previous", metadata={
        "help": "where each round's conversion starts: previous (the global model, warm: what trains) | initial "
                "(the run's initial model every round: the paper's 'untrained student')"})
    seed_delivery: str = field(default="always", metadata={
        "help": "always (every device's seeds reach the server, whatever the channel: a round-1 upload of N_S "
                "= 50 seeds never passes the literal fdma uplink) | channel (Alg. 1 literally: only with a "
                "round-1 upload that had no outage; launch/mix2fld_*.yaml)"})

    def validate(self):
        super().validate()
        if not self.beta >= 0:
            raise ConfigError(f"--beta must be >= 0, got {self.beta}")
        if self.server_steps < 0:
            raise ConfigError(f"--server-steps must be >= 0, got {self.server_steps}")
        for name in ("server_batch", "server_micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.server_lr > 0:
            raise ConfigError(f"--server-lr must be positive, got {self.server_lr}")
        if self.server_init not in SERVER_INITS:
            raise ConfigError(f"--server-init must be one of {', '.join(SERVER_INITS)}, got {self.server_init!r}: "
                              f"previous (start from the global model) or initial (from the run's initial model)")
        if self.seed_delivery not in SEED_DELIVERIES:
            raise ConfigError(f"--seed-delivery must be one of {', '.join(SEED_DELIVERIES)}, got "
                              f"{self.seed_delivery!r}: always (every device's seeds arrive) or channel "
                              f"(only with a round-1 upload the channel let through)")


def seed_teacher(y_soft: torch.Tensor, table: torch.Tensor, has: torch.Tensor):
    """Teacher rows of seeds with (soft) labels: the label mixture of G_out rows over the labels
    that have one, renormalised; and whether any such label exists. On the seeds' device (the
    server set stays on the host; G_out comes from the round's sums, on the run's device)."""
    w = y_soft.double() * has.to(y_soft.device, torch.float64)
    total = w.sum(1, keepdim=True)
    return (w @ table.to(y_soft.device, torch.float64)) / total.clamp_min(1e-30), (total.squeeze(1) > 0).double()


@register_algorithm("fld")
class FLD(Algorithm):
    """Federated learning after distillation: outputs up, weights down, raw seed samples."""

    Options = FLDOptions
    ledger_kinds = ("parameters", "outputs", "seeds")
    #: --clients-at-once: the devices' training (Eq. 1 + Eq. 2) batched; the server's conversion is its own
    batchable = True
    #: the privacy audit's verdict is expected to flag raw seeds (FLD) and pass mixtures
    seed_kind = "raw"
    #: K_s of a run that does not set --server-steps (fedhpc.config.auto): this many passes over the
    #: server's samples at --server-batch, scaled to the sample set instead of the MNIST paper's fixed
    #: 3,200 iterations (its 100 seeds at batch 1 made that 32 passes; on digits' 200 seeds at batch 32
    #: it is 512 passes, four minutes a round on 2 cores). 8 passes (digits: 50 steps a round): bare
    #: Mix2FLD reaches 83% in its 20 rounds in about 12 s; 4 passes reached 58%, 32 passes 92% in 4x the time
    AUTO_SERVER_PASSES = AUTO_SERVER_PASSES

    @classmethod
    def server_set_size(cls, options: FLDOptions, devices: int) -> int:
        """The samples the server converts on when every one of ``devices`` devices' seeds arrives:
        their N_S seeds each (FLD, MixFLD; Mix2FLD makes N_I per device)."""
        return options.seeds_per_device * devices

    @classmethod
    def auto_options(cls, cfg, options: FLDOptions):
        """The options a run that leaves them unset gets on its settings (fedhpc.config.auto)."""
        devices = max(1, cfg.num_clients - int(round(cfg.cold_start_fraction * cfg.num_clients)))
        n = max(1, cls.server_set_size(options, devices))
        batch = min(options.server_batch, n)
        steps = max(1, math.ceil(cls.AUTO_SERVER_PASSES * n / batch))
        return {"server_steps": (steps, f"K_s: {cls.AUTO_SERVER_PASSES} passes over the server's {n} samples at batch "
                                        f"{batch}; the paper's 3,200 is launch/mix2fld_mnist.yaml's")}

    def setup(self):
        self.options = self.options or self.Options()
        if self.data.task != "classification":
            # found by running every algorithm on Shakespeare: the seeds' check then said "13 inputs
            # but 104 labels" in round 1, naming neither the cause nor a fix
            raise ConfigError(
                f"--algo {self.cfg.algo} uploads seed samples that carry one label each (raw or mixed inputs, "
                f"Mix2FLD Eq. 6) for the server to train on; {self.data.name} is {self.data.task} data, with a "
                f"label at every position of a sequence. Use --algo fd (per-label outputs, no seeds), or a "
                f"classification dataset")
        self.num_classes = self.data.num_classes
        self.trainer = ServerTrainer(self.comm, self.model, self.flat)
        #: the run's initial model (setup runs before any training or restore): --server-init initial
        self.initial_state = self.flat.flat.detach().clone() if self.options.server_init == "initial" else None
        self.teacher = None
        self.collected: Optional[SeedSet] = None  # every device's seeds, made once
        self.server_set: Optional[SeedSet] = None
        self.seed_bytes: Dict[int, int] = {}
        self.privacy: Dict[str, float] = {}
        #: --seed-delivery channel: the devices that sent seeds (round 1's sampled) and those
        #: whose round-1 upload arrived; None until known (checkpointed: a resume rebuilds the set)
        self.seed_senders: Optional[List[int]] = None
        self.seed_deliverers: Optional[List[int]] = None
        self._privacy_of = None  # (uploaded, delivered, server set) still to measure

    # ---------------------------------------------------------------- seed samples (once)
    def device_inputs(self, cid: int):
        c = self.data.client(cid)
        return self.data.transform(c.x, False, None).float(), c.y

    def make_seeds(self, cid: int) -> SeedSet:
        x, y = self.device_inputs(cid)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "seed-samples", cid))
        return raw_seeds(x, y, self.options.seeds_per_device, g, cid=cid, num_classes=self.num_classes)

    def server_samples(self, collected: SeedSet) -> SeedSet:
        """The samples the server converts on (the collected seeds; Mix2FLD inversely mixes them)."""
        return collected

    def round_begin(self, rnd):
        if self.collected is not None:
            return
        # Collective, once (also on a resumed run, which rebuilds the same seeded sets).
        comm = self.comm
        local = {cid: self.make_seeds(cid) for cid in self.hosted_training_clients()}
        collected = self.collected = collect_seeds(comm, local)
        seeds_per_device = torch.bincount(collected.owner.cpu(), minlength=self.data.num_clients).tolist()
        row_bytes = collected.row_bytes()
        self.seed_bytes.update({cid: count * row_bytes for cid, count in enumerate(seeds_per_device)})
        if self.options.seed_delivery == "always":
            self.build_server_set(collected, collected)
            if rnd.index == 0 and comm.rank == 0:
                # devices not sampled in round 1 sent their seeds too: booked once (the ledger is summed)
                self.ledger.add("up", "seeds", sum(b for c, b in self.seed_bytes.items() if c not in rnd.sampled))
            return
        # channel: only round 1's devices send seeds (with their upload, booked in upload());
        # which arrived is known after that round's uploads (aggregate), or from the checkpoint
        if rnd.index == 0:
            self.seed_senders, self.seed_deliverers = list(rnd.sampled), None
        elif self.seed_deliverers is None:
            raise CheckpointError(f"{self.cfg.algo} with --seed-delivery channel resumes from a checkpoint that "
                                  f"does not say whose round-1 seeds arrived; start the run again without --resume")
        if self.seed_deliverers is not None:
            self.build_server_set(self.seeds_of(self.seed_senders), self.seeds_of(self.seed_deliverers))

    def seeds_of(self, cids) -> SeedSet:
        """The rows of the collected seeds uploaded by devices ``cids``, in (device, position) order."""
        c = self.collected
        return c.select(torch.isin(c.owner, torch.tensor(list(cids), dtype=torch.long)).nonzero().flatten())

    def build_server_set(self, uploaded: SeedSet, delivered: SeedSet) -> None:
        """The samples the server converts on, from the seeds that reached it; identical on every rank."""
        self.server_set = self.server_samples(delivered)
        # measured in extra_metrics, after the aggregation: the analysis stays off the server's clock
        self._privacy_of = (uploaded, delivered, self.server_set)
        # built once per run (a resumed one rebuilds it), so this warns once
        if len(self.server_set) == 0:
            arrived, sent = len(delivered.owner.unique()), len(uploaded.owner.unique())
            why = ("" if arrived == 0 else
                   ", and no two of them come from different devices with rotated label tuples (inverse mixup)")
            msg = (f"{self.cfg.algo}: the server has no samples for the output-to-model conversion: with "
                   f"--seed-delivery channel the seeds of {arrived} of the {sent} devices that sent them "
                   f"arrived with their round-1 upload{why}. Every round keeps the global model as it is. "
                   f"--seed-delivery always delivers every device's seeds; fewer --seeds-per-device or a "
                   f"larger --channel-opt t_max_s lets round-1 uploads through")
            self.warn(msg)

    def measure_privacy(self, uploaded: SeedSet, delivered: SeedSet, server_set: SeedSet) -> Dict[str, float]:
        """What left the devices (audit: ``uploaded``, also the seeds an outage then lost), what
        reached the server, and how far the samples are from their raw sources (log min
        distance, Tables II-III); identical on every rank."""
        raw = lambda cid: self.device_inputs(cid)[0]  # noqa: E731
        audit = audit_raw_leaves(uploaded, raw)
        out = {"seeds_uploaded": float(len(uploaded)), "seeds_delivered": float(len(delivered)),
               "seeds_leaking_raw": float(len(audit.leaked_rows))}
        if self.seed_kind != "raw":
            p = sample_privacy(uploaded, raw)
            out.update(sample_privacy_uploaded=p.mean, sample_privacy_uploaded_std=p.std)
        if server_set is not delivered:
            out["server_samples"] = float(len(server_set))
            if len(server_set):  # the privacy of no sample is undefined
                p = sample_privacy(server_set, raw)
                out.update(sample_privacy_server=p.mean, sample_privacy_server_std=p.std)
        return out

    def extra_metrics(self):
        if self._privacy_of is not None:
            self.privacy, self._privacy_of = self.measure_privacy(*self._privacy_of), None
        return self.privacy

    # ---------------------------------------------------------------- devices
    def upload_spec(self):
        spec = label_outputs.upload_spec(self.num_classes)
        if self.options.seed_delivery == "channel":
            # whose round-1 upload (and so whose seeds) arrived: the server knows the sender of a
            # unicast, so nothing extra is sent; a straggler's upload is left out of the sum
            spec["seeds_delivered"] = Upload(self.data.num_clients, "seeds", weighted=False, wire_bytes=0, bound=1.0)
        return spec

    def download(self, ctx):
        super().download(ctx)  # the global weights (or the device's own after a downlink outage)
        ctx.extra["outputs"] = label_outputs.LabelOutputs(self.num_classes, self.device)

    def loss(self, model, x, y, ctx):
        logits = model(x)
        ctx.extra["outputs"].add(logits, y)  # Eq. 2, while training on Eq. 1
        return task_loss(logits, y)

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K devices at once (fedhpc.batched): Eq. 1 on each device's rows, each adding
        its own Eq. 2 sums."""
        logits = group.forward(x)
        group_outputs(group.ctxs).add(logits, y, weight > 0)
        return weighted_task_loss(logits, y, weight)

    def upload(self, model, ctx):
        if ctx.round.index == 0:
            ctx.ledger.add("up", "seeds", self.seed_bytes[ctx.cid])  # with the first outputs
        out = label_outputs.upload(ctx.extra["outputs"])
        if self.options.seed_delivery == "channel":
            sent = torch.zeros(self.data.num_clients, dtype=torch.float64, device=self.device)
            if ctx.round.index == 0:
                sent[ctx.cid] = 1.0
            out["seeds_delivered"] = sent
        return out

    # ---------------------------------------------------------------- server: output-to-model conversion
    def aggregate(self, global_state, totals, weight_total, rnd):
        if self.options.seed_delivery == "channel" and rnd.index == 0:
            # Alg. 1, p = 1: the seeds came with the uploads that arrived, also when none did
            arrived = totals["seeds_delivered"].cpu()
            self.seed_deliverers = [cid for cid in self.seed_senders if float(arrived[cid]) > 0.5]
            self.build_server_set(self.seeds_of(self.seed_senders), self.seeds_of(self.seed_deliverers))
        g = label_outputs.global_outputs(totals, self.num_classes)
        if g is None:
            return global_state
        self.teacher = g
        if self.options.server_steps == 0 or len(self.server_set) == 0:
            return global_state  # no seed reached the server: nothing to convert on (warned once)
        o, s = self.options, self.server_set
        teacher, has = seed_teacher(s.y, *self.teacher)
        beta = o.beta

        def eq5(logits, targets, extra):
            rows, mask = extra
            logp = F.log_softmax(logits, -1)
            ce = -(targets.to(logp.dtype) * logp).sum(-1)
            kd = -(rows.to(logp.dtype) * logp).sum(-1) * mask.to(logp.dtype)
            return ce + beta * kd

        self.flat.load_(global_state if o.server_init == "previous" else self.initial_state)
        cfg = ServerTrainConfig(steps=o.server_steps, batch_size=min(o.server_batch, len(s)),
                                micro_batch=o.server_micro_batch, lr=o.server_lr)
        fit = self.trainer.fit(s.x, s.y, cfg, seed=derive_seed(self.cfg.seed, "server-train", rnd.index),
                               loss_fn=eq5, extra=(teacher, has))
        self.server_trained_samples = float(fit.get("samples", 0.0))  # K_s x batch: the channel's compute model counts them
        return self.flat.flat.detach().clone()

    def convergence_state(self, global_state):
        return None if self.teacher is None else self.teacher[0]  # Alg. 1 stops on G_out

    def relative_change(self, previous, current):
        return label_relative_change(previous, current)  # Alg. 1 line 2: for all n

    def state_dict(self):
        state = {"teacher": self.teacher}
        if self.options.seed_delivery == "channel":
            state.update(seed_senders=self.seed_senders, seed_deliverers=self.seed_deliverers)
        return state

    def load_state_dict(self, state):
        self.teacher = state.get("teacher")
        self.seed_senders = state.get("seed_senders")
        self.seed_deliverers = state.get("seed_deliverers")
