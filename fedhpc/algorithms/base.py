"""The small base every algorithm overrides.

A round, as the engine runs it on every rank:

    round_begin(rnd)                       # collective hook: all ranks, same order
    for cid in rnd.my_clients:             # the clients this rank trains
        model <- global state
        local_update(model, ctx)           # E epochs of loss(...) steps by default
        upload(model, ctx)                 # tensors summed over clients, weighted
    one flat all-reduce of the weighted sums (+ metrics)
    global <- aggregate(global, totals)    # identical on every rank

An algorithm overrides a few of these hooks; the defaults are FedAvg's. It may
keep per-client state (``ctx.load_state()`` / ``ctx.save_state(obj)``), exchange
extra data through ``self.comm`` (all_gather, all_gather_object, all_reduce_sum_)
and count what it sends in ``ctx.ledger`` so the communication ledger stays honest.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import nn

# The engine's primitives live below the algorithms; they are imported here too, so that an
# algorithm file finds everything it overrides and uses in one place.
from ..losses import soft_loss, task_loss  # noqa: F401
from ..round import ClientContext, CommLedger, RoundInfo, Upload  # noqa: F401
from ..seeding import derive_seed, seed_torch  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RunConfig
    from ..data import FederatedData
    from ..flat import FlatModel
    from ..world import World


class Algorithm:
    """FedAvg's behaviour; subclasses override hooks. See the module docstring."""

    name = "base"
    #: dataclass of the algorithm's own options (flags / algo_options), or None. A field whose
    #: meaning is this method's own although other methods have an option of that name takes
    #: ``metadata={"method_specific": True}``: ``--algo`` replacing a file's algorithm then never
    #: carries its value over (fedhpc.config.METHOD_SPECIFIC; FedAvg's server_lr, the five
    #: methods' mu, Ditto's lam against the mixup methods' mixing ratio)
    Options: Optional[type] = None
    #: kinds of traffic this algorithm reports in the communication ledger
    ledger_kinds: Tuple[str, ...] = ("parameters",)
    #: whether the algorithm keeps per-client state (engine then checkpoints the store)
    uses_client_state = False
    #: RunConfig settings outside RunConfig.IDENTITY that this algorithm's updates read (e.g.
    #: a schedule over ``rounds``): a checkpoint then resumes only with the same values
    identity_settings: Tuple[str, ...] = ()
    #: False for a method that trains no global model (FD: devices exchange outputs, never
    #: weights). The global state then stays the initial model, so the engine reports no global
    #: test accuracy (it would be the untrained model's) and leads with the devices' own models
    has_global_model = True
    #: True where the global state pairs the trained shared part with the *initial* personal part
    #: (FedPer, FedSim, FedAlt, LG-FedAvg: the personal layers are never sent). Its test accuracy
    #: is still logged, but the final line leads with the clients' own models, the method's result
    global_model_is_partial = False

    def __init__(self, cfg: "RunConfig", options: Any, model: nn.Module, flat: "FlatModel",
                 data: "FederatedData", comm: "World", client_state: Any):
        self.cfg, self.options, self.model, self.flat = cfg, options, model, flat
        self.data, self.comm, self.client_state = data, comm, client_state
        self.device = flat.flat.device
        self.ledger = CommLedger(self.ledger_kinds)
        #: the engine's current global flat state: what clients start from in a round, the new
        #: one after its aggregation (set by the engine)
        self.global_state: Optional[torch.Tensor] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        #: set by the engine: a channel model is simulating links (outages can happen)
        self.channel_active = False
        #: set by the engine: True while it evaluates the model the run ends with, after the
        #: last round or after the round that met --stop-epsilon (e.g. FedBABU fine-tunes then)
        self.final_evaluation = False
        #: set by the engine: the rounds the current global model has had (also after a resume)
        self.rounds_done = 0
        #: set by the engine before setup(): the clients that take part in training, ascending.
        #: --cold-start-fraction holds the others out entirely, so exchanges that collect from
        #: every device up front (mean data, seeds, encoded uploads) collect from these alone.
        self.training_clients: List[int] = list(range(data.num_clients))

    @property
    def model_name(self) -> str:
        """The registry name of the run's model (--model, or the dataset's default under auto)."""
        return self.data.model_for(self.cfg.model)

    @property
    def model_named(self) -> str:
        """The run's model as a message names it: its registry name, and where --model is auto that
        it is the dataset's default (the class name would be no value --model takes)."""
        if self.cfg.model == "auto":
            return f"{self.model_name!r} (the {self.data.name} default, as --model is auto)"
        return repr(self.model_name)

    def hosted_training_clients(self) -> List[int]:
        """The training clients whose up-front exchange (seeds, shared samples, encoded uploads)
        this rank computes: client c on rank c % size, as the mean-data exchange deals them
        (``exchanges.ownership.owner_rank``); cold-start clients take part in none."""
        training = set(self.training_clients)
        return [c for c in range(self.comm.rank, self.data.num_clients, self.comm.size) if c in training]

    # ---------------------------------------------------------------- round-level hooks
    def setup(self) -> None:
        """Called once on every rank after construction (collectives allowed)."""

    def round_begin(self, rnd: RoundInfo) -> None:
        """Called on every rank before local training (collectives allowed, e.g. mean-data exchange)."""

    # ---------------------------------------------------------------- client-side hooks
    def make_optimizer(self, model: nn.Module, ctx: ClientContext) -> torch.optim.Optimizer:
        """A fresh local optimizer for this client (no state carried over from other clients).

        Every client of a rank trains the same model instance, so one optimizer object is
        kept and reset (state cleared, learning rate set) instead of being rebuilt: building
        one costs more than a small client's whole step on the cross-device workloads.
        """
        cfg = self.cfg
        if self._optimizer is None:
            if cfg.optimizer == "adam":
                self._optimizer = torch.optim.Adam(model.parameters(), lr=ctx.lr, weight_decay=cfg.weight_decay)
            else:
                self._optimizer = torch.optim.SGD(model.parameters(), lr=ctx.lr, momentum=cfg.momentum,
                                                  nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
        opt = self._optimizer
        opt.state.clear()
        for group in opt.param_groups:
            group["lr"] = ctx.lr
        return opt

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """The local objective on one mini-batch."""
        return task_loss(model(x), y)

    def local_update(self, model: nn.Module, ctx: ClientContext, epochs: Optional[int] = None) -> None:
        """``epochs`` (default: --local-epochs) epochs of mini-batch steps on ``loss``; records the
        training loss. Fine-tuning (``adapt``) calls it with its own number of epochs."""
        opt = self.make_optimizer(model, ctx)
        params = [p for p in model.parameters() if p.requires_grad]
        for epoch in range(self.cfg.local_epochs if epochs is None else epochs):
            for x, y in ctx.batches(epoch):
                opt.zero_grad(set_to_none=True)
                loss = self.loss(model, x, y, ctx)
                loss.backward()
                if self.cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
                opt.step()
                ctx.record(loss, y.shape[0])

    # The batched path (fedhpc.batched, --clients-at-once > 1), for a class that declares ``batchable``.
    def batched_local_update(self, group) -> torch.Tensor:
        """``local_update`` of K clients at once: their trained flat states (K, P) from ``group.starts``
        (a :class:`fedhpc.batched.GroupTraining`). Default: --local-epochs of SGD on ``batched_loss``;
        a method whose update has phases or frozen parts calls ``group.train`` as it calls
        ``train_epochs``."""
        return group.train(group.starts)

    def batched_downloaded(self, ctx: ClientContext) -> None:
        """Called in a batched group right after ``ctx``'s download, before the next client's: keep,
        in ``ctx.extra``, what the download loaded besides ``self.flat`` (Ditto: the personal model)."""

    def batched_hand_back(self, ctx: ClientContext) -> None:
        """Called as ``ctx``'s trained state is loaded back into ``self.flat``, before its upload: load
        what else the upload reads (Ditto: its trained personal model)."""

    def probe_forward(self, model: nn.Module, x: torch.Tensor) -> None:
        """Every forward local training runs on a batch ``x``; the engine calls it once before the
        first round on a one-sample batch to refuse a model whose BatchNorm cannot train on it.
        Methods with extra forwards (slimmed or resized sub-networks) run those too."""
        model(x)

    def client_weight(self, ctx: ClientContext) -> float:
        """Aggregation weight p_k (unnormalised): the client's number of training samples."""
        return float(ctx.num_train)

    def upload_spec(self) -> Dict[str, Upload]:
        """name -> :class:`Upload` of what every client sends (summed over the round's clients)."""
        return {"params": Upload(self.flat.numel, "parameters")}

    def upload(self, model: nn.Module, ctx: ClientContext) -> Dict[str, torch.Tensor]:
        """What this client sends; the engine adds ``client_weight * tensor`` to the round's sums."""
        return {"params": self.flat.flat}

    def download(self, ctx: ClientContext) -> None:
        """What the client starts from, and the count of what it receives this round.

        The model in ``self.flat`` is the global one; a device whose last downlink failed
        (channel model) starts from the model it kept instead.
        """
        self.restore_kept_model(ctx)
        ctx.ledger.add("down", "parameters", self.flat.numel * self.flat.flat.element_size())

    def restore_kept_model(self, ctx: ClientContext) -> bool:
        """With a channel: a device whose last downlink failed starts from the model it kept
        (loaded into ``self.flat``, the slot emptied). Returns whether it did."""
        if not self.channel_active:
            return False
        kept = self.client_state.get_slot(ctx.cid, "device_model")
        if kept is None:
            return False
        self.flat.load_(kept)
        # The device never received the global model: the model it starts from anchors its
        # update (FedProx's proximal term, MOON's positive pair), see anchor_state.
        ctx.extra["anchor"] = self.flat.flat.detach().clone()
        self.client_state.put_slot(ctx.cid, "device_model", None)
        return True

    def anchor_state(self, ctx: ClientContext) -> torch.Tensor:
        """The flat model ``ctx``'s device starts this round from, which anchors its local update:
        the kept model :meth:`restore_kept_model` restored, else the global model (the very
        tensor ``self.global_state``, so runs without a channel are unchanged)."""
        anchor = ctx.extra.get("anchor")
        return self.global_state if anchor is None else anchor

    def on_downlink_outage(self, model: nn.Module, ctx: ClientContext) -> None:
        """This round's broadcast did not reach the device: it keeps its local model (Mix2FLD
        Sec. II-C). Methods whose devices keep their own models anyway override this."""
        self.client_state.put_slot(ctx.cid, "device_model", self.flat.flat)

    def adapt(self, model: nn.Module, ctx: ClientContext) -> None:
        """Adapt the global model to a cold-start client that never took part in training
        (``--cold-start-fraction``), before it is evaluated on its own test split at the end.

        ``model`` holds the global state; ``ctx.data`` is the client's data. The default adapts
        nothing (the client uses the global model); personalised methods fine-tune here as
        their papers do for newly joining clients.
        """

    def client_model(self, cid: int) -> Optional[torch.Tensor]:
        """The flat model client ``cid`` would use now, or None for the global model.

        Evaluation on the clients' local test splits and the reference device's accuracy
        use it. Personalised methods return the client's own model from the client-state
        store; the default is the model the device was left with after a downlink outage
        (see the channel model in the engine), else the global model.
        """
        return self.kept_model(cid)

    def kept_model(self, cid: int) -> Optional[torch.Tensor]:
        """The flat model device ``cid`` kept when the last broadcast did not reach it (channel
        model), or None: the model it holds is the global one. What a device would evaluate or
        fine-tune from starts there."""
        return self.client_state.get_slot(cid, "device_model") if self.channel_active else None

    # ---------------------------------------------------------------- server-side hooks
    def aggregate(self, global_state: torch.Tensor, totals: Dict[str, torch.Tensor],
                  weight_total: float, rnd: RoundInfo) -> torch.Tensor:
        """New global state from the weighted sums over this round's clients (FedAvg).

        Runs on every rank in the same order, so collectives (e.g. the data-parallel server
        trainer) are allowed. ``weight_total`` is 0 when no upload arrived (every uploader
        was a straggler under the channel model): the global model then stays as it is.
        """
        if weight_total <= 0:
            return global_state
        return totals["params"] / weight_total

    def extra_metrics(self) -> Dict[str, float]:
        """Numbers of the algorithm's own to log with each round (identical on every rank):
        privacy measures, per-label figures... Merged into metrics.jsonl and TensorBoard."""
        return {}

    def convergence_state(self, global_state: torch.Tensor) -> Optional[torch.Tensor]:
        """The global quantity whose relative change decides convergence (``--stop-epsilon``):
        the global model's parameters by default; FD-style methods return their global outputs.

        BatchNorm's running statistics are left out: they follow the data, not the optimisation,
        and running variances near 1 would inflate the norm the change is divided by."""
        return global_state[:self.flat.num_params]  # parameters come first, buffers after

    def warn(self, message: str, category: type = UserWarning) -> None:
        """A warning the researcher must see, from rank 0 only: a Python warning (which tests
        and ``-W`` filters see) and a line on stderr (which a batch log keeps whatever the
        warning filters are)."""
        if self.comm.rank != 0:
            return
        warnings.warn(message, category, stacklevel=3)
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def relative_change(self, previous: torch.Tensor, current: torch.Tensor) -> float:
        """How much :meth:`convergence_state` moved since the last round with an update: the
        value logged as ``relative_change`` and compared with ``--stop-epsilon``.

        ``previous`` and ``current`` are float64 and of the same shape. The default is the
        whole state's |G_p - G_p-1| / |G_p-1| (Frobenius norms), Mix2FLD's rule for FL's
        G_mod; FD-style methods, whose rule must hold for every label, override it.
        """
        return float((current - previous).norm() / previous.norm().clamp_min(1e-30))

    def state_dict(self) -> Dict[str, Any]:
        """Server-side state to checkpoint (momentum buffers, control variates...).

        Device contract: tensors may live on ``self.device``; the engine copies them to the
        CPU to save, and :meth:`load_state_dict` receives them already moved to ``self.device``.
        """
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass
