"""pMixFed (Saadati, Rostami & Amini): layer-wise mixup of the global and each client's model.

Each client keeps its local model L_k (client-state store). With layers i = 1 (base) .. n
(head), n = number of layers, and a mix factor mu:

    broadcast    lambda_i = min(1, mu (n - i)),  L'_k,i = lambda_i G_i + (1 - lambda_i) L_k,i   (Eqs. 6-7)
    local        L_k <- E epochs of the local optimiser from L'_k                             (Eq. 7)
    aggregation  lambda_i = max(0, 1 - i mu),    G'_k,i = lambda_i G_i + (1 - lambda_i) L_k,i    (Eqs. 6, 8)
                 G <- sum_k |D_k| / |D| G'_k

    mu = 1 - 1 / (1 + exp(-delta (Acc^b - 1))),  delta = t / T,  b = 2                         (Eq. 5)

with Acc = Acc_k / Acc_overall at broadcast (one mu per client) and Acc = Acc_overall at
aggregation (one mu for the round). Each mix is one :func:`fedhpc.ops.segment_mix` over the
whole flat state, one coefficient per layer (``personal.LayerMap``).

Readings chosen where the paper is open (options in brackets):

* Direction [``direction``]: the formulas (default) give the base the global model and the
  head the local one at broadcast (Appendix 8.1 agrees: "the local model's head remains
  frozen"); the prose of Sec. 4.2 and 5.2 says lambda goes 1 -> 0 "from the head to the
  base". ``direction=prose`` reverses the broadcast: lambda_i = min(1, mu i). The
  aggregation's prose (Sec. 4.2.2: "increases from 0 to 1 moving from the head to the base")
  agrees with its formula, so it is the same under both.
* Layer [``layer_unit``]: a declared ``layers()`` block with everything under it (default),
  or each parameter tensor (BatchNorm statistics with their module's last parameter).
* Where i starts [``first_layer_index``]: Sec. 4.2 says both "n is total number of layers" and
  "i = 0 -> i = n", which cannot both hold. The default takes n = the number of layers and
  i = 1..n, as Sec. 3.1 numbers layers ({1, ..., M}) and Sec. 5.2 reads them ("i = M -> 1").
  ``first_layer_index=0`` takes "i = 0" literally (n = layers - 1). The broadcast is the same
  under both (only n - i enters it); at aggregation i = 0 gives the base lambda_0 = 1 for
  ever, so the global model's base layer never leaves its random initial values, and every
  broadcast with mu (n - 1) >= 1 (about mu >= 0.25 on a 5-layer CNN) overwrites the clients'
  trained base with it: on digits the global model stays near chance and Eq. 5's mu falls
  towards 0 within a few rounds, i.e. local training only. The paper wants the aggregation
  to retain the previous global model "predominantly", not to never update its base.
* Accuracies (Eq. 5) are measured on the clients' local test splits, as the paper says
  (``acc_split=train`` uses their training data instead). Acc_k = accuracy of the client's
  local model before the broadcast; Acc_overall = mean over the round's sampled clients
  (Alg. 1 writes x = {x_1..x_K} for the K selected devices) of the accuracy of the global
  model the round starts from (the outcome of round t-1, hence the paper's superscript).
  A client without a test split counts as Acc = 1 (mu = 1 - sigmoid(0) = 0.5).
* Mix factor at aggregation: "constant ... for all clients as it depends on the average
  performance of the previous global model", so the mix commutes with the weighted sum and
  runs once on the server: G^{t+1}_i = lambda_i G_i + (1 - lambda_i) sum_k p_k L_k,i.
* Alg. 1 lists initial local models LM^(0) without defining them [``first_local``]: a client
  that has not trained yet uses the global model it receives (default ``global``, so its
  first broadcast mix is the identity) or the seeded initial model (``init``).
* pMixFed-Dynamic (Sec. 5, "mu is fixed across communication rounds"): ``pmixfed_dynamic``
  with ``--mu`` (default 0.5, the value Eq. 5 gives at t = 0 or Acc = 1) at both stages.
* Cold-start clients (Sec. 10.2) run the broadcast mix (the identity with ``first_local=global``)
  and ``finetune_epochs`` epochs of the local update (App. 10.1: r = 4).
* The client's personalised model (evaluation) is its latest local model L_k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...errors import CheckpointError, ConfigError
from .. import register_algorithm
from ..base import Upload
from .base import PersonalAlgorithm, PersonalOptions


def mix_factor(acc: float, delta: float, b: float = 2.0) -> float:
    """Eq. 5: mu = 1 - 1 / (1 + exp(-delta (acc^b - 1))), evaluated without overflow.

    Where acc^b lies beyond the float range (the broadcast's ratio is capped at 1e6, so b >= ~52
    reaches it, and Python's ``**`` raises OverflowError), z = delta (acc^b - 1) ~ delta acc^b is
    taken through its logarithm, log|delta| + b log(acc), and is +-inf where that overflows too:
    mu = sigmoid(-inf) = 0 for delta > 0 (the limit), and mu = 0.5 for delta = 0 (the first
    round), as for every finite acc^b. A finite acc^b takes the same operations as ever."""
    try:
        power = acc ** b
    except OverflowError:
        power = math.inf
    if power == math.inf:
        if delta == 0:
            z = 0.0
        else:
            log_z = math.log(abs(delta)) + b * math.log(acc)   # acc^b - 1 = acc^b at this size
            try:
                z = math.copysign(math.exp(log_z), delta)
            except OverflowError:
                z = math.copysign(math.inf, delta)
    else:
        z = delta * (power - 1.0)           # mu = 1 - sigmoid(z) = sigmoid(-z)
    if z >= 0:
        e = math.exp(-z)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(z))


def broadcast_lambdas(mu: torch.Tensor, num_layers: int, direction: str = "formulas") -> torch.Tensor:
    """Eq. 6, broadcast: lambda_i = min(1, mu (n - i)) from the base to the head, where n - i
    runs L - 1 .. 0 whether i starts at 0 or 1 (n follows it); ``prose`` reverses the layer
    order (lambda = min(1, mu j), j = 0 at the base). ``mu`` scalar or (C,) -> (L,) or (C, L)."""
    mu = torch.as_tensor(mu, dtype=torch.float64)
    n = num_layers - 1
    i = torch.arange(num_layers, dtype=torch.float64)
    steps = (n - i) if direction == "formulas" else i
    return torch.clamp(mu.unsqueeze(-1) * steps, max=1.0)


def aggregation_lambdas(mu: torch.Tensor, num_layers: int, first_index: int = 1) -> torch.Tensor:
    """Eq. 6, aggregation: lambda_i = max(0, 1 - i mu), i = first_index (base) .. (head)."""
    mu = torch.as_tensor(mu, dtype=torch.float64)
    i = torch.arange(first_index, first_index + num_layers, dtype=torch.float64)
    return torch.clamp(1.0 - mu.unsqueeze(-1) * i, min=0.0)


@dataclass
class PMixFedOptions(PersonalOptions):
    b: float = field(default=2.0, metadata={"help": "exponent b of Acc in the mix factor, Eq. 5 (paper 2)"})
    direction: str = field(default="formulas", metadata={
        "help": "formulas (Eq. 6: base global, head local at broadcast) | prose (Sec. 4.2: reversed)"})
    layer_unit: str = field(default="block", metadata={
        "help": "a 'layer' of Eq. 6: block (the model's declared layers()) | tensor (each parameter tensor)"})
    acc_split: str = field(default="test", metadata={
        "help": "where Eq. 5's accuracies are measured: test (each client's local test split, as the paper) | train"})
    first_local: str = field(default="global", metadata={
        "help": "a client's local model before it first trains: global (the received model) | init (the initial model)"})
    first_layer_index: int = field(default=1, metadata={
        "help": "i of the base layer in Eq. 6 (aggregation lambda_i = max(0, 1 - i mu)): 1 (n = number of layers, "
                "Sec. 3.1) | 0 (the text's 'i = 0 -> n': the global base layer then never leaves its initial values)",
        # checked against the checkpointed state (load_state_dict), which knows that a checkpoint
        # from before the option numbered from 0; the identity would fill that checkpoint's {}
        # with today's default 1 and refuse the only numbering it resumes under
        "checked_by_state": True})

    def validate(self):
        super().validate()
        if not math.isfinite(self.b) or self.b <= 0:
            raise ConfigError(f"--b must be a positive number, got {self.b}")
        for name, allowed in (("direction", ("formulas", "prose")), ("layer_unit", ("block", "tensor")),
                              ("acc_split", ("test", "train")), ("first_local", ("global", "init")),
                              ("first_layer_index", (0, 1))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {allowed}, got {getattr(self, name)!r}")


@register_algorithm("pmixfed")
class PMixFed(PersonalAlgorithm):
    """pMixFed: layer-wise mixup of global and local models at broadcast and aggregation, adaptive mu."""

    Options = PMixFedOptions
    #: plain SGD steps on the task loss (the mixed model trained as FedAvg trains): --clients-at-once > 1
    #: may train clients together (fedhpc.batched; PersonalAlgorithm.batched_loss)
    batchable = True
    uses_client_state = True

    def setup(self):
        super().setup()
        if self.options.acc_split == "test" and self.adaptive and self.cfg.client_test_fraction <= 0:
            raise ConfigError(f"{self.name} measures Eq. 5's accuracies on each client's local test split, "
                              "but --client-test-fraction is 0; set it > 0 (e.g. 0.2) or pass --acc-split train")
        self.initial_state = self.flat.flat.detach().clone()  # setup runs before any training
        self.acc_global = 1.0   # Acc_overall of the round's starting global model
        self.mu_aggregation = 0.5
        self._mu_sum = torch.zeros(2, dtype=torch.float64, device=self.device)

    # ------------------------------------------------------------------ the mix factor
    adaptive = True
    # delta(t) = t / T (Eq. 6) reads the run's length: a run resumed with more --rounds would
    # continue on another schedule than the uninterrupted longer run, so T is part of its identity.
    identity_settings = ("rounds",)

    def delta(self, t: int) -> float:
        return t / self.cfg.rounds

    def broadcast_mu(self, acc_local: float, t: int) -> float:
        if math.isnan(acc_local):
            ratio = 1.0
        elif self.acc_global > 0:
            ratio = acc_local / self.acc_global
        else:
            ratio = 1.0 if acc_local == 0 else math.inf
        return mix_factor(min(ratio, 1e6), self.delta(t), self.options.b)

    def round_begin(self, rnd):
        super().round_begin(rnd)
        if not self.adaptive:
            return
        # Acc_overall: the starting global model on the sampled clients' splits, mean over clients.
        # Each client's accuracy has its own slot (one rank writes it, the all-reduce adds zeros
        # to it) and the slots are added exactly (fsum): a sum of fractions made rank by rank
        # would depend on the rank count in its last bit, and Acc_overall sets every mu.
        position = {cid: i for i, cid in enumerate(rnd.sampled)}
        slots = torch.zeros(2, len(rnd.sampled), dtype=torch.float64, device=self.device)
        for cid in rnd.my_clients:
            acc = self.accuracy(self.global_state, *self._acc_data(cid))
            if not math.isnan(acc):
                slots[:, position[cid]] = torch.tensor([acc, 1.0], dtype=torch.float64)
        self.comm.all_reduce_sum_(slots)
        accs = slots[0][slots[1] > 0].tolist()
        self.acc_global = math.fsum(accs) / len(accs) if accs else 1.0
        self.mu_aggregation = mix_factor(self.acc_global, self.delta(rnd.index), self.options.b)

    def _acc_data(self, cid: int, ctx=None):
        if self.options.acc_split == "train":
            c = ctx.data if ctx is not None else self.data.client(cid)
            return c.x, c.y
        if ctx is not None:
            return ctx.data.x_test, ctx.data.y_test
        return self.data.client_test_split(cid)

    # ------------------------------------------------------------------ client side
    def local_model(self, ctx, global_state: torch.Tensor) -> torch.Tensor:
        mine = ctx.load_state()
        if mine is not None:
            return mine["model"].to(self.device)
        return global_state if self.options.first_local == "global" else self.initial_state

    def broadcast(self, ctx, global_state: torch.Tensor) -> float:
        """Eq. 7's mix into the model: L' = lam G + (1 - lam) L_k, lam from this client's mu."""
        local = self.local_model(ctx, global_state)
        if self.adaptive:
            mu = self.broadcast_mu(self.accuracy(local, *self._acc_data(ctx.cid, ctx)), ctx.round.index)
        else:
            mu = self.options.mu
        lam = broadcast_lambdas(mu, self.layer_map.num_layers, self.options.direction)
        self.layer_map.mix(global_state, local, lam, out=self.flat.flat)
        return mu

    def download(self, ctx):
        kept = self.channel_active and self.client_state.get_slot(ctx.cid, "device_model") is not None
        super().download(ctx)  # the global model G, booked as received (or, kept, the device's own)
        # a device whose broadcast was lost trains on the model it kept: no mix this round
        ctx.extra["mu"] = None if kept else self.broadcast(ctx, self.global_state)

    def upload_spec(self):
        # the round's sum of broadcast mix factors (in [0, 1]) and their count, for the log (no
        # traffic); bound=1: summed exactly, so the logged mean is the same for any rank count
        return {"params": Upload(self.flat.numel, "parameters"),
                "mu": Upload(2, "parameters", weighted=False, wire_bytes=0, bound=1.0)}

    def upload(self, model, ctx):
        ctx.save_state({"model": self.flat.flat})
        mu = ctx.extra["mu"]
        self._mu_sum.copy_(torch.tensor([0.0, 0.0] if mu is None else [mu, 1.0], dtype=torch.float64))
        return {"params": self.flat.flat, "mu": self._mu_sum}

    def client_model(self, cid):
        mine = self.client_state.get_slot(cid, "algo")
        return None if mine is None else mine["model"]

    def adapt(self, model, ctx):
        self.broadcast(ctx, self.flat.flat.detach().clone())  # the model holds the final global
        self.train_epochs(model, ctx, self.options.finetune_epochs)

    # ------------------------------------------------------------------ server side
    def aggregation_mu(self) -> float:
        return self.mu_aggregation

    def aggregate(self, global_state, totals, weight_total, rnd):
        if weight_total <= 0:
            return global_state
        self._mu_round = totals["mu"].clone()
        average = totals["params"] / weight_total                     # sum_k p_k L_k
        lam = aggregation_lambdas(self.aggregation_mu(), self.layer_map.num_layers, self.options.first_layer_index)
        # lam G + (1 - lam) sum_k p_k L_k
        return self.layer_map.mix(global_state.to(torch.float64), average, lam)

    def extra_metrics(self):
        out = {"mu_aggregation": self.aggregation_mu()}
        mu = getattr(self, "_mu_round", None)
        if mu is not None and float(mu[1]) > 0:
            out["mu_broadcast_mean"] = float(mu[0] / mu[1])
        if self.adaptive:
            out["acc_overall"] = self.acc_global
        return out

    def state_dict(self):
        return {"acc_global": self.acc_global, "first_layer_index": self.options.first_layer_index}

    def load_state_dict(self, state):
        self.acc_global = float(state.get("acc_global", 1.0))
        # A run's layer numbering must not change halfway. It is an option with a default, which
        # the run identity does not record, and checkpoints written before the option existed
        # numbered the layers from 0.
        saved = int(state.get("first_layer_index", 0))
        if saved != self.options.first_layer_index:
            raise CheckpointError(
                f"this {self.name} checkpoint numbered Eq. 6's layers from {saved} (--first-layer-index {saved}"
                f"{', the only numbering before the option existed' if 'first_layer_index' not in state else ''}), "
                f"this run from {self.options.first_layer_index}; resume with --first-layer-index {saved}, "
                f"or use another --out for a new run")


@dataclass
class PMixFedDynamicOptions(PMixFedOptions):
    mu: float = field(default=0.5, metadata={
        "help": "the fixed mix factor mu of both stages (default 0.5: Eq. 5 at t = 0 or Acc = 1)",
        "method_specific": True})  # not FedProx's or the regularisers' weight mu (fedhpc.config)

    def validate(self):
        super().validate()
        if not 0 <= self.mu <= 1:
            raise ConfigError(f"--mu must be in [0, 1], got {self.mu}")


@register_algorithm("pmixfed_dynamic")
class PMixFedDynamic(PMixFed):
    """pMixFed-Dynamic: the same layer-wise mixup with a fixed mix factor mu (no accuracies)."""

    Options = PMixFedDynamicOptions
    adaptive = False
    identity_settings = ()  # no schedule: a finished run extends with more --rounds

    def aggregation_mu(self) -> float:
        return self.options.mu
