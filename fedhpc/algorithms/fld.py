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

What the seeds are is the one thing the family's members change (:meth:`make_seeds`,
:meth:`server_samples`): FLD sends raw samples (flagged by the privacy audit: raw data
leaves the device), MixFLD mixups (:mod:`fedhpc.algorithms.mixfld`), Mix2FLD mixups
that the server inversely mixes (:mod:`fedhpc.algorithms.mix2fld`). A seed with a soft
label distils from the same mixture of teacher rows; rows of labels without a global
output are left out (renormalised), and a seed with none distils nothing.

Readings: seeds are collected once, from every device, before the first round's
training (Alg. 1, p = 1), in model-input space; their bytes (8-bit pixels) are booked
on each device's first upload, so the channel model sees the larger round-1 payload.
Until a table has arrived, and in a round in which no device's table arrived (all
uplinks lost), the server keeps the global model as it is: it has nothing new to convert,
and K_s more steps on the old table would be training Alg. 1 does not do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F

from ..analysis.privacy import audit_raw_leaves, sample_privacy
from ..errors import ConfigError
from ..exchanges import label_outputs
from ..exchanges.seed_samples import SeedSampleOptions, SeedSet, collect_seeds, raw_seeds
from ..server.trainer import ServerTrainConfig, ServerTrainer
from . import register_algorithm
from .base import Algorithm, derive_seed, task_loss


@dataclass
class FLDOptions(SeedSampleOptions):
    beta: float = field(default=0.01, metadata={"help": "weight beta of the distillation term in Eq. 5 (paper 0.01)"})
    server_steps: int = field(default=3200, metadata={"help": "K_s: server SGD iterations per round (paper 3,200)"})
    server_batch: int = field(default=32, metadata={"help": "seed samples per server iteration"})
    server_lr: float = field(default=0.01, metadata={"help": "server learning rate eta (paper 0.01, as the devices')"})
    server_micro_batch: int = field(default=8, metadata={
        "help": "samples per micro-batch of the data-parallel server step (fixed: results do not depend on ranks)"})

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


def seed_teacher(y_soft: torch.Tensor, table: torch.Tensor, has: torch.Tensor):
    """Teacher rows of seeds with (soft) labels: the label mixture of G_out rows over the labels
    that have one, renormalised; and whether any such label exists."""
    w = y_soft.double() * has.double()
    total = w.sum(1, keepdim=True)
    return (w @ table.double()) / total.clamp_min(1e-30), (total.squeeze(1) > 0).double()


@register_algorithm("fld")
class FLD(Algorithm):
    """Federated learning after distillation: outputs up, weights down, raw seed samples."""

    Options = FLDOptions
    ledger_kinds = ("parameters", "outputs", "seeds")
    #: the privacy audit's verdict is expected to flag raw seeds (FLD) and pass mixtures
    seed_kind = "raw"

    def setup(self):
        self.options = self.options or self.Options()
        self.num_classes = self.data.num_classes
        self.trainer = ServerTrainer(self.comm, self.model, self.flat)
        self.teacher = None
        self.server_set = None
        self.seed_bytes: Dict[int, int] = {}
        self.privacy: Dict[str, float] = {}

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
        if self.server_set is not None:
            return
        # Collective, once (also on a resumed run, which rebuilds the same seeded sets).
        comm = self.comm
        local = {cid: self.make_seeds(cid) for cid in range(comm.rank, self.data.num_clients, comm.size)}
        collected = collect_seeds(comm, local)
        for cid in range(self.data.num_clients):
            self.seed_bytes[cid] = collected.select((collected.owner == cid).nonzero().flatten()).wire_bytes()
        self.server_set = self.server_samples(collected)
        self.privacy = self.measure_privacy(collected, self.server_set)
        if rnd.index == 0 and comm.rank == 0:
            # devices not sampled in round 1 sent their seeds too: booked once (the ledger is summed)
            self.ledger.add("up", "seeds", sum(b for c, b in self.seed_bytes.items() if c not in rnd.sampled))

    def measure_privacy(self, uploaded: SeedSet, server_set: SeedSet) -> Dict[str, float]:
        """What left the devices (audit) and how far the samples are from their raw sources
        (log min distance, Tables II-III); identical on every rank."""
        raw = lambda cid: self.device_inputs(cid)[0]  # noqa: E731
        audit = audit_raw_leaves(uploaded, raw)
        out = {"seeds_uploaded": float(len(uploaded)), "seeds_leaking_raw": float(len(audit.leaked_rows))}
        if self.seed_kind != "raw":
            p = sample_privacy(uploaded, raw)
            out.update(sample_privacy_uploaded=p.mean, sample_privacy_uploaded_std=p.std)
        if server_set is not uploaded:
            p = sample_privacy(server_set, raw)
            out.update(sample_privacy_server=p.mean, sample_privacy_server_std=p.std,
                       server_samples=float(len(server_set)))
        return out

    def extra_metrics(self):
        return self.privacy

    # ---------------------------------------------------------------- devices
    def upload_spec(self):
        return label_outputs.upload_spec(self.num_classes)

    def download(self, ctx):
        super().download(ctx)  # the global weights (or the device's own after a downlink outage)
        ctx.extra["outputs"] = label_outputs.LabelOutputs(self.num_classes, self.device)

    def loss(self, model, x, y, ctx):
        logits = model(x)
        ctx.extra["outputs"].add(logits, y)  # Eq. 2, while training on Eq. 1
        return task_loss(logits, y)

    def upload(self, model, ctx):
        if ctx.round.index == 0:
            ctx.ledger.add("up", "seeds", self.seed_bytes[ctx.cid])  # with the first outputs
        return label_outputs.upload(ctx.extra["outputs"])

    # ---------------------------------------------------------------- server: output-to-model conversion
    def aggregate(self, global_state, totals, weight_total, rnd):
        g = label_outputs.global_outputs(totals, self.num_classes)
        if g is None:
            return global_state
        self.teacher = g
        if self.options.server_steps == 0:
            return global_state
        o, s = self.options, self.server_set
        teacher, has = seed_teacher(s.y, *self.teacher)
        beta = o.beta

        def eq5(logits, targets, extra):
            rows, mask = extra
            logp = F.log_softmax(logits, -1)
            ce = -(targets.to(logp.dtype) * logp).sum(-1)
            kd = -(rows.to(logp.dtype) * logp).sum(-1) * mask.to(logp.dtype)
            return ce + beta * kd

        self.flat.load_(global_state)
        cfg = ServerTrainConfig(steps=o.server_steps, batch_size=min(o.server_batch, len(s)),
                                micro_batch=o.server_micro_batch, lr=o.server_lr)
        self.trainer.fit(s.x, s.y, cfg, seed=derive_seed(self.cfg.seed, "server-train", rnd.index),
                         loss_fn=eq5, extra=(teacher, has))
        return self.flat.flat.detach().clone()

    def convergence_state(self, global_state):
        return None if self.teacher is None else self.teacher[0]  # Alg. 1 stops on G_out

    def state_dict(self):
        return {"teacher": self.teacher}

    def load_state_dict(self, state):
        self.teacher = state.get("teacher")
