"""Several of a rank's clients trained at once as one batched model (``clients_at_once`` > 1).

For small models one client's optimizer step is mostly Python and kernel-launch overhead.
Here K clients of a rank train together: their flat states are the rows of one (K, P)
tensor ``theta``; the model's forward runs once per step over all K clients, the K
per-client losses are summed and differentiated with ordinary autograd (client k's loss
depends on row k only, so the gradient of the sum is every client's own gradient), and one
functional SGD step updates all rows with a handful of whole-(K, P) kernels.

The forward over K clients is one of two, chosen per model (:func:`stacked_forward`):

* grouped kernels, for models whose parametrised modules are all ``nn.Linear`` / ``nn.Conv2d``:
  the model's own forward on the K batches folded into one (K*B, ...), each Linear a ``bmm``
  and each Conv2d one convolution with K times the groups. Checked once per model against
  vmap on a real batch, since folding is wrong for a forward that mixes samples;
* ``torch.func.vmap`` of ``functional_call`` otherwise (any model vmap supports).

Either way the autograd leaves are (K, *shape) views of ``theta`` (not ``theta`` itself):
differentiating through slices of one big leaf would materialise a (K, P) zero gradient per
parameter tensor, which cost more than the model's own backward on the small models this is for.

Reverse-mode autograd outside ``vmap`` (rather than ``vmap(grad(...))``) keeps FedMix's
second-order term expressible as it is in the sequential path: the input gradient is a
``torch.autograd.grad(..., create_graph=True)`` on the summed losses, whose slice k is
client k's own dL_k/dx_k.

Equal to the sequential path (within float rounding), client by client:

* batch order: each client's batches are the ones :meth:`ClientContext.batches` yields for
  it (same permutation, same augmentation stream), one epoch at a time;
* unequal sizes: a client with fewer steps in an epoch is *masked out* of the later steps
  (its parameters AND its momentum stay exactly as they are: ``torch.where``, not a
  multiplication by 0); a short last batch is padded and the padded rows get weight 0, so the
  loss is the mean over the real samples only (per-sample weights 1/n_real);
* optimizer: SGD as ``torch.optim.SGD`` runs it (weight decay added to the gradient, momentum
  buffer started at the first gradient, no dampening, ``--nesterov`` as torch does it), after
  the per-client ``clip_grad_norm_`` when ``--grad-clip`` > 0. Adam is refused (ConfigError).

Who is batched: an algorithm opts in with the class attribute ``batchable = True`` and a
hook ``batched_loss(group, x, y, weight) -> (K,)`` (see :class:`ClientGroup`); the
sequential ``loss`` stays the reference. A subclass that overrides ``loss``,
``local_update``, ``make_optimizer`` or ``mix_loss`` without declaring ``batchable`` itself is
refused, so a method never inherits a batched path that no longer matches its loss.

Dropout and BatchNorm are refused with a ConfigError naming the fix, not emulated: the
sequential path draws dropout masks from the global generator seeded per client and
BatchNorm updates running statistics per client, neither of which vmap reproduces
bit-for-bit. Only classification tasks are batched (next-character prediction, with its
per-position labels, recurrent models and embedding-space mixing, is refused).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError
from .models import model_option_params
from .round import ClientContext, RoundInfo
from .seeding import derive_seed, seed_torch

if TYPE_CHECKING:  # pragma: no cover
    from .algorithms.base import Algorithm
    from .engine import Engine
    from .flat import FlatModel

#: hooks whose override changes the local update: an override must come with its own opt-in
LOCAL_UPDATE_HOOKS = ("loss", "local_update", "make_optimizer", "mix_loss")


# --------------------------------------------------------------------------- what a hook sees

@dataclass
class ClientGroup:
    """The K clients of one batched step, as ``Algorithm.batched_loss`` sees them.

    ``forward(x)`` maps inputs (K, B, ...) to logits (K, B, C), row k through client k's
    weights. ``params`` are name -> (K, *shape) views of the stacked flat states (the
    differentiable leaves, in ``flat.entries`` order). ``active[k]`` says whether client k
    takes this step (False: all its rows are padding; the hook must not draw from its random
    streams then). ``real[k]`` is how many of the B rows of client k are real samples.
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: Dict[str, torch.Tensor]
    ctxs: List[ClientContext]
    active: List[bool]
    real: List[int]
    flat: "FlatModel"


def weighted_task_loss(logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-client cross-entropy (K,): sum_i weight_i * CE_i over each client's B rows.

    With weight 1/n_real on the real rows and 0 on padding this is each client's batch-mean
    loss, as :func:`fedhpc.algorithms.base.task_loss` computes it on the unpadded batch.
    """
    k, b = y.shape[0], y.shape[1]
    per_row = F.cross_entropy(logits.reshape(k * b, logits.shape[-1]), y.reshape(-1), reduction="none")
    return (per_row.view(k, b) * weight).sum(1)


def proximal_terms(group: ClientGroup, algo: "Algorithm", mu: float) -> torch.Tensor:
    """(mu/2) ||w_k - a_k||^2 for every client k (K,): FedProx's term, batched.

    a_k = ``algo.anchor_state(ctx_k)``, as the sequential ``add_proximal_term`` uses: the global
    model, or the model a device kept after a lost broadcast (channel model), per client.
    """
    states = [algo.anchor_state(ctx) for ctx in group.ctxs]
    if all(s is algo.global_state for s in states):
        # one anchor for all: broadcast the global model's views (no (K, P) copy per step)
        anchors = group.flat.param_views(algo.global_state)  # aligned with params (flat.entries order)
    else:
        stacked = torch.stack(states)  # (K, P): row k client k's own anchor
        k = stacked.shape[0]
        anchors = [stacked[:, e.offset:e.offset + e.numel].view((k,) + tuple(e.shape))
                   for e in group.flat.entries if e.is_param]
    sq = [(p - a).pow(2).flatten(1).sum(1) for p, a in zip(group.params.values(), anchors)]
    return 0.5 * mu * torch.stack(sq, 1).sum(1)


# --------------------------------------------------------------------------- who may be batched

def _owner(cls: type, attr: str) -> Optional[type]:
    for klass in cls.__mro__:
        if attr in klass.__dict__:
            return klass
    return None


def check_batchable(algo: "Algorithm", model: nn.Module, cfg) -> None:
    """Raise ConfigError unless ``clients_at_once`` > 1 can train this run exactly."""
    cls = type(algo)
    fix = "run with --clients-at-once 1 (the sequential path)"
    if not getattr(cls, "batchable", False) or not hasattr(cls, "batched_loss"):
        raise ConfigError(f"--algo {cfg.algo} does not support --clients-at-once > 1 (its local update is "
                          f"not declared batchable); {fix}")
    opt_in = _owner(cls, "batchable")
    for hook in LOCAL_UPDATE_HOOKS:
        owner = _owner(cls, hook)
        # The opt-in must sit in a class at least as derived as every override of the local update.
        if owner is not None and owner is not opt_in and issubclass(owner, opt_in):
            raise ConfigError(f"--algo {cfg.algo}: {owner.__name__}.{hook} overrides the local update of "
                              f"{opt_in.__name__}, which declared the batched path; {fix}")
    if cfg.optimizer != "sgd":
        raise ConfigError(f"--clients-at-once > 1 supports --optimizer sgd only, got {cfg.optimizer!r}; {fix}")
    # the advice names the model option that removes the layer only where the run's model has it
    options = model_option_params(algo.model_name)

    def without(layer: str, option: str, value: str) -> str:
        if option in options:
            return f"use --model-opt {option}={value} (the model without {layer})"
        return f"use a model without {layer} (the run's model {algo.model_named} always has it; e.g. --model cnn)"

    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ConfigError(f"--clients-at-once > 1 cannot reproduce per-client dropout masks (module "
                              f"{name!r}); {without('dropout', 'dropout', '0')} or {fix}")
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(f"--clients-at-once > 1 cannot keep per-client BatchNorm statistics (module "
                              f"{name!r}); {without('BatchNorm', 'norm', 'none')} or {fix}")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigError(f"--clients-at-once > 1 trains every parameter; {frozen[:3]} are frozen; {fix}")
    task = getattr(algo.data, "task", "classification")
    if task != "classification":
        # per-position labels (next-character prediction) and recurrent models: not batched here
        raise ConfigError(f"--clients-at-once > 1 batches classification tasks only; the dataset's task is "
                          f"{task!r}; {fix}")


# --------------------------------------------------------------------------- the batched model

def stacked_params(flat, theta: torch.Tensor) -> Dict[str, torch.Tensor]:
    """name -> (K, *shape) views of ``theta``'s parameter columns: leaves requiring grad that
    share ``theta``'s memory, so stepping ``theta`` in place moves them too."""
    k = theta.shape[0]
    return {e.name: theta[:, e.offset:e.offset + e.numel].view((k,) + tuple(e.shape)).requires_grad_(True)
            for e in flat.entries if e.is_param}


def vmap_forward(model: nn.Module, params: Dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """(K, B, ...) -> (K, B, C): ``torch.func.vmap`` of ``functional_call`` over the K clients.
    Works for any model whose forward vmap supports; the reference for the grouped kernels."""
    from torch.func import functional_call, vmap

    # Float buffers live in the flat state too, but nothing batchable updates them (BatchNorm
    # is refused): every client reads the model's own.
    buffers = dict(model.named_buffers())
    batched = vmap(lambda p, x: functional_call(model, (p, buffers), (x,)))
    return lambda x: batched(params, x)


#: modules the grouped kernels compute K clients of at once (exact types: a subclass may
#: use its weight elsewhere in its forward)
GROUPED_MODULES = (nn.Linear, nn.Conv2d)


def _grouped_linear(x, weight, bias=None):
    """F.linear of K clients' folded rows (K*R, ..., in) with weights (K, out, in): one bmm."""
    k = weight.shape[0]
    rows = x.reshape(k, -1, x.shape[-1])
    wt = weight.transpose(1, 2)
    out = torch.bmm(rows, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), rows, wt)
    return out.reshape(x.shape[:-1] + (weight.shape[1],))


def _grouped_conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv2d of K clients' folded images (K*B, C, H, W) with weights (K, O, C/g, kh, kw):
    one convolution with K times the groups, the clients side by side along the channels."""
    k, o = weight.shape[0], weight.shape[1]
    b = x.shape[0] // k
    side = x.reshape((k, b) + tuple(x.shape[1:])).transpose(0, 1).reshape((b, k * x.shape[1]) + tuple(x.shape[2:]))
    out = F.conv2d(side, weight.reshape((k * o,) + tuple(weight.shape[2:])),
                   None if bias is None else bias.reshape(k * o), stride, padding, dilation, groups * k)
    return out.reshape((b, k, o) + tuple(out.shape[2:])).transpose(0, 1).reshape((k * b, o) + tuple(out.shape[2:]))


class _GroupedKernels(torch.overrides.TorchFunctionMode):
    """Routes F.linear / F.conv2d calls whose weight carries a leading client dimension to the
    grouped kernels; every other op sees the folded batch (K*B, ...) as one batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            if weight.dim() == 3:
                return _grouped_linear(*args, **kwargs)
        elif func is F.conv2d:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            if weight.dim() == 5:
                return _grouped_conv2d(*args, **kwargs)
        return func(*args, **kwargs)


def grouped_forward(model: nn.Module, params: Dict[str, torch.Tensor]
                    ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """(K, B, ...) -> (K, B, C) with grouped kernels (bmm, grouped convolution): the model's own
    forward on the folded batch (K*B, ...), its Linear / Conv2d weights swapped for the (K, ...)
    stacks. None when a module holding parameters is not one of GROUPED_MODULES. The folding is
    only right for a forward that treats samples independently: :func:`train_group` checks it
    once per model against :func:`vmap_forward`."""
    slots = []
    for mod_name, module in model.named_modules():
        own = list(module._parameters)
        if not own:
            continue
        if type(module) not in GROUPED_MODULES:
            return None
        for pname in own:
            slots.append((module, pname, params[f"{mod_name}.{pname}" if mod_name else pname]))

    def forward(x: torch.Tensor) -> torch.Tensor:
        k, b = x.shape[0], x.shape[1]
        saved = [(m, n, m._parameters[n]) for m, n, _ in slots]
        try:
            for m, n, stacked in slots:
                m._parameters[n] = stacked  # a plain tensor in the slot: nn.Module reads it as is
            with _GroupedKernels():
                out = model(x.reshape((k * b,) + tuple(x.shape[2:])))
        finally:
            for m, n, original in saved:
                m._parameters[n] = original
        return out.reshape((k, b) + tuple(out.shape[1:]))

    return forward


#: per model: whether the grouped kernels reproduced vmap on a real batch (checked once)
_GROUPED_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def stacked_forward(model: nn.Module, params: Dict[str, torch.Tensor], probe: torch.Tensor
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fastest exact forward for K clients: the grouped kernels when the model is built of
    GROUPED_MODULES and they agree with vmap on ``probe`` (K, B, ...) (a forward that mixes
    samples, e.g. a batch statistic, would not), else vmap."""
    grouped = grouped_forward(model, params)
    if grouped is None:
        return vmap_forward(model, params)
    if probe.shape[0] < 2:
        return grouped  # one client: the folded batch is its own batch, nothing to tell apart
    ok = _GROUPED_CHECKED.get(model)
    if ok is None:
        with torch.no_grad():
            want = vmap_forward(model, params)(probe)
            got = grouped(probe)
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        _GROUPED_CHECKED[model] = ok  # only a verdict over >= 2 clients is kept
    return grouped if ok else vmap_forward(model, params)


class StackedSGD:
    """``torch.optim.SGD`` (momentum, weight decay, Nesterov) on every row of a (K, P) state at
    once, after a per-client ``clip_grad_norm_``, with per-client masking.

    Only the first ``num_params`` columns (the parameters; FlatModel puts buffers after them)
    are stepped. A client whose ``active`` flag is False keeps its row and momentum bit for bit.
    """

    def __init__(self, theta: torch.Tensor, num_params: int, lr: float, momentum: float,
                 weight_decay: float, grad_clip: float, nesterov: bool = False):
        self.p = num_params
        self.lr, self.momentum, self.weight_decay, self.grad_clip = lr, momentum, weight_decay, grad_clip
        self.nesterov = nesterov
        # Zeros, not "unset": momentum * 0 + g == g exactly, torch's first-step buffer.
        self.buf = torch.zeros_like(theta[:, :num_params]) if momentum > 0 else None

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor]) -> None:
        """``active``: (K,) bool, or None when every client takes this step."""
        w = theta[:, :self.p]
        g = grad[:, :self.p]
        if self.grad_clip > 0:
            # clip_grad_norm_ per client: the 2-norm over all of its parameters' gradients
            norm = torch.linalg.vector_norm(g, 2, dim=1, keepdim=True)
            g = g * (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        if self.weight_decay != 0:
            g = g.add(w, alpha=self.weight_decay)
        if self.buf is not None:
            new_buf = self.buf.mul(self.momentum).add_(g)
            if active is None:
                self.buf = new_buf
            else:
                self.buf = torch.where(active[:, None], new_buf, self.buf)
            g = g.add(new_buf, alpha=self.momentum) if self.nesterov else new_buf
        new_w = w.add(g, alpha=-self.lr)
        if active is not None:
            new_w = torch.where(active[:, None], new_w, w)
        w.copy_(new_w)


# --------------------------------------------------------------------------- one epoch of batches

@dataclass
class EpochBatches:
    """Every client's batches of one epoch, padded to (K, S, B, ...)."""

    x: torch.Tensor        # (K, S, B, ...)
    y: torch.Tensor        # (K, S, B)
    weight: torch.Tensor   # (K, S, B): 1/n_real on real rows, 0 on padding
    real: List[List[int]]  # real[k][s]: real rows of client k at step s (0: masked-out step)
    steps: int
    counts: torch.Tensor   # (K, S) float64: ``real`` as a tensor (for the loss sums)


def epoch_batches(ctxs: List[ClientContext], epoch: int, batch_size: int) -> Optional[EpochBatches]:
    """The clients' own batches of ``epoch`` (ClientContext.batches: same order, same augmentation)."""
    per_client = [list(ctx.batches(epoch)) for ctx in ctxs]
    k = len(ctxs)
    steps = max(len(b) for b in per_client)
    if steps == 0:
        return None  # no client of the group has training data: nothing to step
    xs0 = next(b for b in per_client if b)[0][0]
    x = torch.zeros((k, steps * batch_size) + tuple(xs0.shape[1:]), dtype=xs0.dtype, device=xs0.device)
    y = torch.zeros((k, steps * batch_size), dtype=torch.long, device=xs0.device)
    weights, real = [], []
    for i, batches in enumerate(per_client):
        counts = [int(b[1].shape[0]) for b in batches]
        real.append(counts + [0] * (steps - len(counts)))
        row: List[float] = []
        for n in real[-1]:  # 1/n on a step's n real rows, 0 on its padding
            row += [1.0 / n] * n + [0.0] * (batch_size - n) if n else [0.0] * batch_size
        weights.append(row)
        if not batches:
            continue
        if all(n == batch_size for n in counts[:-1]):
            # batch s occupies rows [s*B, s*B + n) and only the last can be short: one copy
            total = sum(counts)
            x[i, :total] = torch.cat([b[0] for b in batches]) if len(batches) > 1 else batches[0][0]
            y[i, :total] = torch.cat([b[1] for b in batches]) if len(batches) > 1 else batches[0][1]
        else:
            for s, (bx, by) in enumerate(batches):
                x[i, s * batch_size: s * batch_size + counts[s]] = bx
                y[i, s * batch_size: s * batch_size + counts[s]] = by
    weight = torch.tensor(weights, dtype=xs0.dtype if xs0.is_floating_point() else torch.float32,
                          device=xs0.device).view(k, steps, batch_size)
    shape = (k, steps, batch_size)
    counts = torch.tensor(real, dtype=torch.float64, device=xs0.device)
    return EpochBatches(x.view(shape + tuple(xs0.shape[1:])), y.view(shape), weight, real, steps, counts)


# --------------------------------------------------------------------------- training a group

def train_group(algo: "Algorithm", model: nn.Module, flat, ctxs: List[ClientContext],
                starts: torch.Tensor) -> torch.Tensor:
    """Train the clients of ``ctxs`` from the flat states ``starts`` (K, P); returns the trained
    states (K, P) and adds each client's training loss to its ``ctx`` (as ``ctx.record`` does)."""
    cfg = algo.cfg
    theta = starts.detach().clone()
    params = stacked_params(flat, theta)
    forward = None
    leaves = list(params.values())
    # the leaves' gradients, written into one (K, P) tensor for the whole-state optimizer step
    grad = torch.zeros_like(theta)
    grad_views = [grad[:, e.offset:e.offset + e.numel].view_as(v)
                  for e, v in zip((e for e in flat.entries if e.is_param), leaves)]
    opt = StackedSGD(theta, flat.num_params, ctxs[0].lr, cfg.momentum, cfg.weight_decay, cfg.grad_clip,
                     getattr(cfg, "nesterov", False))  # getattr: configs from before --nesterov
    k = len(ctxs)
    loss_sums = torch.zeros(k, dtype=torch.float64, device=theta.device)
    for epoch in range(cfg.local_epochs):
        eb = epoch_batches(ctxs, epoch, cfg.batch_size)
        if eb is None:
            continue
        if forward is None:
            forward = stacked_forward(model, params, eb.x[:, 0])
        for s in range(eb.steps):
            real = [eb.real[i][s] for i in range(k)]
            active_list = [n > 0 for n in real]
            all_active = all(active_list)
            group = ClientGroup(forward, params, ctxs, active_list, real, flat)
            losses = algo.batched_loss(group, eb.x[:, s], eb.y[:, s], eb.weight[:, s])
            grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
            with torch.no_grad():
                for view, g in zip(grad_views, grads):
                    if g is None:  # a parameter this loss does not use: zero gradient, as in SGD
                        view.zero_()
                    else:
                        view.copy_(g)
            active = None if all_active else eb.counts[:, s] > 0
            opt.step(theta, grad, active)
            loss_sums.add_(losses.detach().double() * eb.counts[:, s])  # a masked-out client adds 0 * its 0 loss
        for i, ctx in enumerate(ctxs):
            ctx.samples += sum(eb.real[i])
    for i, ctx in enumerate(ctxs):
        ctx.loss_sum.add_(loss_sums[i])
    return theta.detach()


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
        ctxs, starts, downloads = [], [], []
        for cid in group_ids:
            client = engine.data.client(cid).training_on(engine.world.device)
            # the per-client seed as in the sequential loop: a download drawing from torch's
            # generator draws the same numbers here
            seed_torch(derive_seed(cfg.seed, "client", rnd.index, cid), engine.world.device)
            flat.load_(engine.global_state)
            ctx = ClientContext(algo, cid, client, rnd)
            before = algo.ledger.values.clone()
            algo.download(ctx)  # may load a model the device kept (channel model)
            downloads.append(algo.ledger.values - before)
            starts.append(flat.flat.detach().clone())
            ctxs.append(ctx)
        trained = train_group(algo, engine.model, flat, ctxs, torch.stack(starts))
        share = (time.perf_counter() - g0) / len(group_ids)
        for i, (cid, ctx) in enumerate(zip(group_ids, ctxs)):
            flat.load_(trained[i])
            traffic_before = (algo.ledger.values - downloads[i]) if engine.channel_active else None
            yield cid, ctx, traffic_before, time.perf_counter() - share
