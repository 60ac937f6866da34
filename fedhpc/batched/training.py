"""Training a group of clients at once: their stacked model and optimiser, one phase of epochs
(:class:`GroupTraining`, what ``batched_local_update`` calls), and the engine's loop over groups
(:func:`train_in_groups`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..data.base import ClientData
from ..round import ClientContext, RoundInfo
from ..seeding import derive_seed, seed_torch
from .epochs import _span, epoch_batches
from .group import ClientGroup
from .kernels import StepRows, device_generator, stacked_buffers, stacked_forward, stacked_params
from .optim import StackedAdam, StackedSGD

if TYPE_CHECKING:  # pragma: no cover
    from ..algorithms.base import Algorithm
    from ..engine import Engine


def client_rng_states(cfg, ctxs: List[ClientContext], device: torch.device) -> List[torch.Tensor]:
    """Each client's generator state as its sequential training starts: torch's generator of
    ``device`` seeded as the sequential loop seeds it for the client (for a download that draws
    nothing; :func:`train_in_groups` takes the states after the real downloads instead)."""
    gen, states = device_generator(device), []
    saved = gen.get_state()
    for ctx in ctxs:
        seed_torch(derive_seed(cfg.seed, "client", ctx.round.index, ctx.cid), device)
        states.append(gen.get_state())
    gen.set_state(saved)
    return states


def _draws_masks(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


class StackedModel:
    """K clients' copies of ``model`` in training, from the flat states ``starts`` (K, P): the
    (K, *shape) parameter views, BatchNorm's running statistics apart (see :func:`stacked_buffers`)
    and a fresh :class:`StackedSGD` (a fresh optimiser, as each sequential phase has).

    Trained are the parameters that require grad in ``model`` now, as ``train_epochs`` gives the
    optimiser only those: a parameter frozen by the caller (``requires_grad`` False, e.g. under
    :func:`fedhpc.algorithms.personal.frozen`) is read by the forward but takes no gradient and is
    never stepped (no momentum, no weight decay), and a BatchNorm module the caller put in eval mode
    normalises with its clients' running statistics and leaves them as they are."""

    def __init__(self, algo: "Algorithm", model: nn.Module, flat, starts: torch.Tensor, lr: float,
                 step: StepRows):
        cfg = algo.cfg
        self.model, self.flat, self.step_rows = model, flat, step
        self.theta = starts.detach().clone()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.params = stacked_params(flat, self.theta, trainable)
        # float buffers (BatchNorm's running statistics) apart from theta: see stacked_buffers
        self.buffer_rows = self.theta[:, flat.num_params:].clone()
        self.buffers = stacked_buffers(flat, self.buffer_rows)
        trained = [e for e in flat.entries if e.is_param and e.name in trainable]
        self.leaves = [self.params[e.name] for e in trained]
        # the leaves' gradients, written into one (K, P) tensor for the whole-state optimizer step;
        # a frozen parameter's columns stay 0 (so they add nothing to a clipped gradient's norm)
        self.grad = torch.zeros_like(self.theta)
        self.grad_views = [self.grad[:, e.offset:e.offset + e.numel].view_as(v) for e, v in zip(trained, self.leaves)]
        self.trained = trained
        columns = None
        if len(trained) < sum(e.is_param for e in flat.entries):
            columns = self._columns_of(trained)
        self._columns_with_gradient: Dict[Tuple[int, ...], torch.Tensor] = {}  # by the leaves without one
        if cfg.optimizer == "adam":
            self.opt = StackedAdam(self.theta, flat.num_params, lr, cfg.weight_decay, cfg.grad_clip, columns)
        else:
            self.opt = StackedSGD(self.theta, flat.num_params, lr, cfg.momentum, cfg.weight_decay, cfg.grad_clip,
                                  getattr(cfg, "nesterov", False), columns)  # getattr: configs from before --nesterov
        self._forward: Optional[Callable[..., torch.Tensor]] = None

    def forward(self, probe: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The K clients' forward (:func:`stacked_forward`, chosen once, on the first batch ``probe``)."""
        if self._forward is None:
            self._forward = stacked_forward(self.model, self.params, probe, self.buffers, self.step_rows)
        return self._forward

    def step(self, losses: torch.Tensor, active: Optional[torch.Tensor],
             skipped: Optional[torch.Tensor] = None) -> None:
        """One optimizer step of every client on the gradient of its own loss (``losses`` (K,));
        ``active`` (K,) bool, or None when every client takes the step; ``skipped`` (K, num_params)
        bool: client k's parameters that took no part in its loss (ClientGroup.skip), not stepped."""
        self.apply(self.gradient(losses), active, skipped)

    def gradient(self, losses: torch.Tensor) -> Optional[torch.Tensor]:
        """Write the gradient of each client's loss (``losses`` (K,)) at the current states into
        ``self.grad`` (K, P); returns the step's columns: those of the parameters the losses use,
        or None when they use all."""
        grads = torch.autograd.grad(losses.sum(), self.leaves, allow_unused=True)
        unused: Tuple[int, ...] = ()  # the leaves the loss does not use
        with torch.no_grad():
            for i, (view, g) in enumerate(zip(self.grad_views, grads)):
                if g is None:
                    view.zero_()  # adds nothing to a clipped gradient's norm
                    unused += (i,)
                else:
                    view.copy_(g)
        columns = None
        if unused:
            # a parameter the loss does not use takes no step at all, as torch's optimisers skip a
            # None gradient: no weight decay, no momentum, no Adam moments
            columns = self._columns_with_gradient.get(unused)
            if columns is None:
                columns = self._columns_of([e for i, e in enumerate(self.trained) if i not in unused])
                self._columns_with_gradient[unused] = columns
        return columns

    def apply(self, columns: Optional[torch.Tensor], active: Optional[torch.Tensor],
              skipped: Optional[torch.Tensor] = None) -> None:
        """The optimiser's step on ``self.grad`` (what :meth:`gradient` wrote, or a method's own
        combination of gradients: Per-FedAvg's meta-gradient); arguments as :meth:`step`'s."""
        if skipped is not None:
            if columns is None and self.opt.columns is not None:
                columns = self.opt.columns[0]
            columns = ~skipped if columns is None else columns[None, :] & ~skipped
        self.opt.step(self.theta, self.grad, active, columns)

    def _columns_of(self, entries) -> torch.Tensor:
        """(num_params,) bool: True on the columns of the flat state's ``entries``."""
        columns = torch.zeros(self.flat.num_params, dtype=torch.bool, device=self.theta.device)
        for e in entries:
            columns[e.offset:e.offset + e.numel] = True
        return columns

    def states(self) -> torch.Tensor:
        """The trained flat states (K, P), running statistics written back."""
        theta = self.theta.detach()
        theta[:, self.flat.num_params:] = self.buffer_rows
        return theta


def train_group(algo: "Algorithm", model: nn.Module, flat, ctxs: List[ClientContext],
                starts: torch.Tensor, rng_states: Optional[List[torch.Tensor]] = None, *,
                epochs: Optional[int] = None, first_epoch: int = 0,
                loss: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
    """Train the clients of ``ctxs`` from the flat states ``starts`` (K, P); returns the trained
    states (K, P) and adds each client's training loss to its ``ctx`` (as ``ctx.record`` does).
    ``rng_states``: each client's generator state (of the model's device) as its training starts,
    for dropout masks, advanced in place as they are drawn (default :func:`client_rng_states`).

    One phase of the sequential ``train_epochs``: a fresh optimiser over the parameters that require
    grad in ``model`` (see :class:`StackedModel`), ``epochs`` epochs (default --local-epochs)
    numbered from ``first_epoch`` for the batch order, each step on ``loss(group, x, y, weight)``
    (K,) (default ``algo.batched_loss``)."""
    cfg = algo.cfg
    loss = loss or algo.batched_loss
    draws = _draws_masks(model)
    if draws and rng_states is None:
        rng_states = client_rng_states(cfg, ctxs, starts.device)
    step = StepRows(rng_states if draws else None)
    stacked = StackedModel(algo, model, flat, starts, ctxs[0].lr, step)
    k = len(ctxs)
    loss_sums = torch.zeros(k, dtype=torch.float64, device=starts.device)
    for epoch in range(first_epoch, first_epoch + (cfg.local_epochs if epochs is None else epochs)):
        eb = epoch_batches(ctxs, epoch, cfg.batch_size)
        if eb is None:
            continue
        forward = stacked.forward(eb.x[:, 0])
        for s in range(eb.steps):
            real = [eb.real[i][s] for i in range(k)]
            step.set(real, cfg.batch_size)
            active_list = [n > 0 for n in real]
            group = ClientGroup(forward, stacked.params, ctxs, active_list, real, flat, stacked.buffers,
                                rng=step.rng)
            losses = loss(group, eb.x[:, s], eb.y[:, s], eb.weight[:, s])
            stacked.step(losses, None if all(active_list) else eb.counts[:, s] > 0, group.skipped)
            loss_sums.add_(losses.detach().double() * eb.counts[:, s])  # a masked-out client adds 0 * its 0 loss
        for i, ctx in enumerate(ctxs):
            ctx.samples += sum(eb.real[i])
    group_sums = _span([ctx.loss_sum.view(1) for ctx in ctxs])
    if group_sums is not None:  # the elements of one tensor (train_in_groups' contexts): one kernel
        group_sums.add_(loss_sums)
    else:
        for i, ctx in enumerate(ctxs):
            ctx.loss_sum.add_(loss_sums[i])
    step.set(None, 0)
    return stacked.states()


class GroupTraining:
    """The K clients of one batched group, as ``Algorithm.batched_local_update`` trains them.

    ``starts`` (K, P): their flat states as their downloads left them. ``train(states, ...)`` is
    :func:`train_group` on them: one call per phase of the sequential update (each with a fresh
    optimiser over what is not frozen). ``stacked(model, flat, states)``: another model of each
    client's, stepped inside a phase's loss (Ditto's personal models). All of them draw dropout
    masks from the same per-client generator states ``rng``, so each client's stream runs on from
    phase to phase and model to model as it does in its sequential training."""

    def __init__(self, algo: "Algorithm", model: nn.Module, flat, ctxs: List[ClientContext],
                 starts: torch.Tensor, rng: Optional[List[torch.Tensor]] = None):
        self.algo, self.model, self.flat, self.ctxs, self.starts = algo, model, flat, ctxs, starts
        if rng is None and _draws_masks(model):
            rng = client_rng_states(algo.cfg, ctxs, starts.device)
        self.rng = rng

    def train(self, states: torch.Tensor, epochs: Optional[int] = None, first_epoch: int = 0,
              loss: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        return train_group(self.algo, self.model, self.flat, self.ctxs, states, self.rng,
                           epochs=epochs, first_epoch=first_epoch, loss=loss)

    def stacked(self, model: nn.Module, flat, states: torch.Tensor) -> StackedModel:
        """``model``'s K copies from ``states``; its forward needs each call's rows
        (``forward(x, real=group.real)``), its own StepRows being never set."""
        return StackedModel(self.algo, model, flat, states, self.ctxs[0].lr, StepRows(self.rng))


def train_in_groups(engine: "Engine", rnd: RoundInfo, clients: List[int], clients_at_once: int
                    ) -> Iterator[Tuple[int, ClientContext, Optional[torch.Tensor], float]]:
    """The engine's per-client loop, ``clients_at_once`` clients at a time.

    Yields ``(cid, ctx, traffic_before, c0)`` in ``clients`` order, exactly as the sequential
    loop does, with ``engine.model`` holding the client's trained weights, so uploads, the
    ledger, the channel model and saved client models are the sequential path's code.
    ``traffic_before`` is the ledger as it would have been just before this client's
    download had it trained alone (its own download plus what it books next is its payload);
    ``c0`` is a start time giving each client an equal share of its group's training time.
    """
    cfg, algo, flat = engine.cfg, engine.algo, engine.flat
    for first in range(0, len(clients), clients_at_once):
        group_ids = clients[first:first + clients_at_once]
        g0 = time.perf_counter()
        ctxs, starts, downloads, rng = [], [], [], []
        gen = device_generator(engine.world.device)
        draws = _draws_masks(engine.model)
        on_device = ClientData.all_training_on([engine.data.client(cid) for cid in group_ids], engine.world.device)
        # the clients' training-loss sums: the elements of one tensor (one zeroing, one add a phase)
        client_loss_sums = torch.zeros(len(group_ids), dtype=torch.float64, device=engine.world.device)
        for cid, client in zip(group_ids, on_device):
            # the per-client seed as in the sequential loop: a download drawing from torch's
            # generator draws the same numbers here
            seed_torch(derive_seed(cfg.seed, "client", rnd.index, cid), engine.world.device)
            flat.load_(engine.global_state)
            ctx = ClientContext(algo, cid, client, rnd, client_loss_sums[len(ctxs)])
            before = algo.ledger.values.clone()
            algo.download(ctx)  # may load a model the device kept (channel model)
            algo.batched_downloaded(ctx)  # what else the download loaded, kept before the next one's
            downloads.append(algo.ledger.values - before)
            starts.append(flat.flat.detach().clone())
            ctxs.append(ctx)
            if draws:  # where the client's training starts drawing dropout masks, as in the sequential loop
                rng.append(gen.get_state())
        trained = algo.batched_local_update(GroupTraining(algo, engine.model, flat, ctxs, torch.stack(starts),
                                                         rng if draws else None))
        ClientContext.settle_losses(ctxs)  # the engine's non-finite guard: one device sync for the group
        share = (time.perf_counter() - g0) / len(group_ids)
        for i, (cid, ctx) in enumerate(zip(group_ids, ctxs)):
            flat.load_(trained[i])
            algo.batched_hand_back(ctx)  # what else its upload reads (Ditto: its personal model)
            if draws:  # torch's generator where the client's sequential training leaves it, for its upload
                gen.set_state(rng[i])
            traffic_before = (algo.ledger.values - downloads[i]) if engine.channel_active else None
            yield cid, ctx, traffic_before, time.perf_counter() - share
