"""FD, federated distillation (Mix2FLD paper Sec. II-B, Eqs. 2-3; Jeong et al. 2018).

Devices never exchange weights. Each keeps its own model across rounds (in the
client-state store) and trains it with

    CE(F, label) + beta * psi(F, G_out[label])                              (Eq. 3)

where G_out[n] is the global average output for ground-truth label n from the last
broadcast it received, and psi is the cross-entropy -sum_m G_m log F_m. (The paper
prints psi = sum_m G_m log F_m without the minus sign while calling it a
cross-entropy that measures the gap; minimising the printed form would push F *away*
from G, so the cross-entropy reading is the default.) Labels without a global output
are skipped; before the first broadcast a device trains on CE alone. While training,
the device averages its softmax outputs per label (Eq. 2) and uploads that N_L x N_L
table; the server averages it per label over the devices whose upload arrived (Eq. 3,
:mod:`fedhpc.exchanges.label_outputs`).

Stopping rule (``--stop-epsilon``): FD stops when |G_out,n^p - G_out,n^p-1| / |G_out,n^p-1| <
epsilon "for all n" (Sec. II-B, and Alg. 1 line 2 for FLD), so the relative change it logs is
the largest per-label one (:func:`label_relative_change`), not the ratio over the whole table,
in which one label still moving is averaged away by the others.

Under the channel model a device whose downlink fails keeps distilling from the table
it had. The global *model* is never trained (``has_global_model = False``): the run reports
the devices' own models (``reference_device_accuracy``, ``local_test_accuracy*``) and no
``test_accuracy``, which would be the untouched initial model's.

Where in the round ``reference_device_accuracy`` is measured (Fig. 2), for every method alike:
the reference device's model after round t's download, the one it starts round t + 1 from. An
FD device's download is the global outputs, which leave its model as its round-t training made
it; an FL or FLD device's is the global model (tests/test_reference_point.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...batched import weighted_task_loss
from ...errors import ConfigError
from ...exchanges import label_outputs
from .. import register_algorithm
from ..base import Algorithm, task_loss


@dataclass
class FDOptions:
    beta: float = field(default=0.01, metadata={"help": "weight beta of the distillation regulariser (paper 0.01)"})
    finetune_epochs: int = field(default=4, metadata={
        "help": "epochs a cold-start device (--cold-start-fraction) or --final-adapt trains a model of its own "
                "from the initial one by Eq. 3, the final global outputs as teacher, before it is evaluated (the "
                "personalised baselines' r = 4, pMixFed App. 10.1; 0 = the untrained initial model)"})

    def validate(self):
        if not self.beta >= 0:
            raise ConfigError(f"--beta must be >= 0, got {self.beta}")
        if self.finetune_epochs < 0:
            raise ConfigError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")


def label_relative_change(previous: torch.Tensor, current: torch.Tensor) -> float:
    """max over labels n of |G_n^p - G_n^p-1| / |G_n^p-1| (rows of two N_L x N_L global output tables).

    Mix2FLD's stopping rule holds "for all n", so the largest row ratio is what is compared
    with epsilon. A row that was zero (a label without a global output: no device holding it
    uploaded) has no ratio; it counts as 0 while it stays zero (a label no device holds never
    blocks convergence) and as infinite once it has a global output (a label just heard of is
    not converged). A row that drops to zero (its devices' uploads were lost) has ratio 1.
    Never NaN.
    """
    diff = (current - previous).norm(dim=1)
    before = previous.norm(dim=1)
    zero = before == 0
    ratio = diff / torch.where(zero, torch.ones_like(before), before)
    ratio = torch.where(zero & (diff > 0), torch.full_like(ratio, math.inf), ratio)
    return float(ratio.max()) if ratio.numel() else 0.0


def group_outputs(ctxs) -> label_outputs.GroupLabelOutputs:
    """Eq. 2's running sums of the devices of one batched group (``--clients-at-once``) as one
    stacked table, made at the group's first step and kept in the devices' contexts."""
    stack = ctxs[0].extra.get("group_outputs")
    if stack is None:
        stack = label_outputs.GroupLabelOutputs([ctx.extra["outputs"] for ctx in ctxs])
        for ctx in ctxs:
            ctx.extra["group_outputs"] = stack
    return stack


@register_algorithm("fd")
class FD(Algorithm):
    """Federated distillation: devices upload per-label average outputs, never weights."""

    Options = FDOptions
    ledger_kinds = ("outputs",)
    uses_client_state = True
    has_global_model = False
    #: --clients-at-once: each device's own model (its download loads it) and teacher table, Eq. 3
    batchable = True

    def setup(self):
        self.options = self.options or FDOptions()
        self.num_classes = self.data.num_classes
        self.teacher = None  # (G_out, mask) of the last round whose outputs arrived

    def upload_spec(self):
        return label_outputs.upload_spec(self.num_classes)

    def download(self, ctx):
        state = ctx.load_state()
        if state is not None:
            self.flat.load_(state["model"])  # the device's own model, kept across rounds
        # The table this device distils from: the latest broadcast, unless its downlink
        # failed last time, when it keeps the one it had.
        ctx.extra["teacher"] = state["teacher"] if state is not None and state["missed"] else self.teacher
        if ctx.extra["teacher"] is not None:
            ctx.ledger.add("down", "outputs", self.num_classes ** 2 * 4)
        ctx.extra["outputs"] = label_outputs.LabelOutputs(self.num_classes, self.device)

    def loss(self, model, x, y, ctx):
        logits = model(x)
        ctx.extra["outputs"].add(logits, y)
        loss = task_loss(logits, y)
        teacher = ctx.extra["teacher"]
        if teacher is not None and self.options.beta > 0:
            table, mask = teacher  # G_out and its labels, in the model's dtype (aggregate casts them)
            loss = loss + self.options.beta * label_outputs.distillation_loss(logits, table[y], mask[y])
        return loss

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K devices at once (fedhpc.batched): each device's rows through its own model,
        its own Eq. 2 sums and its own teacher (a device that missed a broadcast keeps its table)."""
        logits = group.forward(x)
        group_outputs(group.ctxs).add(logits, y, weight > 0)
        loss = weighted_task_loss(logits, y, weight)
        if self.options.beta > 0:
            teachers = [ctx.extra["teacher"] for ctx in group.ctxs]
            loss = loss + self.options.beta * label_outputs.group_distillation_loss(logits, y, weight, teachers)
        return loss

    def upload(self, model, ctx):
        ctx.save_state({"model": self.flat.flat, "teacher": ctx.extra["teacher"], "missed": False})
        return label_outputs.upload(ctx.extra["outputs"])

    def on_downlink_outage(self, model, ctx):
        state = ctx.load_state()
        state["missed"] = True
        ctx.save_state(state)

    def aggregate(self, global_state, totals, weight_total, rnd):
        g = label_outputs.global_outputs(totals, self.num_classes)
        if g is not None:
            self.teacher = tuple(t.to(self.flat.flat.dtype) for t in g)
        return global_state  # FD has no global model

    def adapt(self, model, ctx):
        """A device that joins after training (--cold-start-fraction) has no model to take: it
        trains its own from the initial one (``model`` holds it, FD's global state) for
        ``finetune_epochs`` epochs of Eq. 3, distilling from the last global outputs."""
        ctx.extra["teacher"] = self.teacher
        ctx.extra["outputs"] = label_outputs.LabelOutputs(self.num_classes, self.device)  # Eq. 2's sums: not sent
        if self.options.finetune_epochs > 0:
            self.local_update(model, ctx, epochs=self.options.finetune_epochs)

    def client_model(self, cid):
        state = self.client_state.get_slot(cid, "algo")
        return None if state is None else state["model"]

    def convergence_state(self, global_state):
        return None if self.teacher is None else self.teacher[0]

    def relative_change(self, previous, current):
        return label_relative_change(previous, current)  # "for all n": the largest label's change

    def state_dict(self):
        return {"teacher": self.teacher}

    def load_state_dict(self, state):
        self.teacher = state.get("teacher")
