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
  the per-client ``clip_grad_norm_`` when ``--grad-clip`` > 0; ``--optimizer adam`` as
  ``torch.optim.Adam`` runs it (:class:`StackedAdam`: each client's own step count, so its bias
  corrections are those of its own steps).

Who is batched: an algorithm opts in with the class attribute ``batchable = True`` and a
hook ``batched_loss(group, x, y, weight) -> (K,)`` (see :class:`ClientGroup`); the
sequential ``loss`` stays the reference. Today: FedAvg, FedProx, NaiveMix, FedMix, LocalMix,
GlobalMix, Mixup, MOON, FedAlign, StochDepth (each client's own dropped blocks: ``ClientGroup.skip``),
GradAug (each client's sub-networks on its own: :func:`client_stream`), and the personalised
FedPer, LG-FedAvg, FedSim, pMixFed (-Dynamic), FedBABU, FedAlt, Ditto and Per-FedAvg (its
meta-steps in its ``batched_local_update``), whose ``download`` builds the model a client trains
(personal layers, pMixFed's mix) before the batched steps start, as it does before the sequential ones; and the FD
family's devices (FD on its own model and teacher table, FLD / MixFLD / Mix2FLD on the global
model), each adding its own per-label output sums (Eq. 2) as one stacked table
(:class:`fedhpc.exchanges.label_outputs.GroupLabelOutputs`). A subclass that overrides a hook of
the local update (``LOCAL_UPDATE_HOOKS``: ``loss``, ``local_update``, ``make_optimizer``,
``mix_loss``, the personalised family's phases, Per-FedAvg's meta-gradient...) without declaring
``batchable`` itself is refused, so a method never inherits a batched path that no longer matches its
loss; a method refused may say why (``not_batchable_because``: the one-shot methods, whose devices
do not train).

An update with phases, frozen parts or a second model overrides ``batched_local_update(group)``
(default: one :func:`train_group` call), mirroring its ``local_update`` with
:class:`GroupTraining`: ``group.train(states, epochs, first_epoch, loss)`` is one phase of the
sequential ``train_epochs`` (a fresh stacked optimiser, epochs numbered from ``first_epoch``), over
the parameters that require grad in the model *now*: run under the same ``frozen(...)`` as the
sequential phase, a frozen parameter takes no gradient, no momentum and no weight decay, and a
frozen BatchNorm normalises with each client's running statistics and leaves them as they are.
FedBABU trains one phase with its head frozen, FedAlt its personal phase then its shared phase.
``group.stacked(model, flat, states)`` is another model of each client's, stepped inside a phase's
loss: Ditto's personal models, whose steps precede each global step on the same batch, from the
same dropout streams (``batched_downloaded`` / ``batched_hand_back`` carry such a model's start
and trained state past the other clients' downloads to each client's upload).

Dropout and BatchNorm, on the grouped kernels (every parametrised module a Linear, Conv2d or
BatchNorm1d/2d/3d; the vmap path refuses them with a ConfigError naming the fix):

* dropout (``nn.Dropout``, ``Dropout1d/2d/3d``): the sequential path draws client k's masks
  from torch's default generator of the model's device, seeded for the client before its
  download (``seed_torch(derive_seed(seed, "client", round, cid))``). Here each client's
  generator state is taken just after its download and every dropout call draws client k's
  mask with that state swapped in, by the same function on a tensor of ones of client k's real
  rows (so the same shape, the same op and the same stream position as its sequential step),
  then puts the advanced state back: masks bit for bit the sequential ones, on any device.
  A client masked out of a step draws nothing; after the group trains, torch's generator is
  left at each client's own state while its upload is taken, as the sequential loop leaves it;
* BatchNorm: each client's batch statistics over its own real rows (padding excluded) and its
  running statistics as rows of a stacked (K, C) buffer, updated as ``F.batch_norm`` updates
  them (momentum, unbiased variance), and written back into the client's flat state. Equal to
  the sequential path within float rounding (the statistics are reduced in another order).

Either needs to know which rows of a forward's input are real: a hook's ``group.forward(x)`` on a
(K, B, ...) batch of the step's B rows reads the step's counts; another row count must pass its
own (``group.forward(x, real=[...])``), or a model with dropout or BatchNorm refuses the call.
Only classification tasks are batched (next-character prediction, with its per-position labels,
recurrent models and embedding-space mixing, is refused).
"""

from __future__ import annotations

import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .data.base import ClientData, host_to_device
from .errors import ConfigError
from .models import model_option_params
from .round import ClientContext, RoundInfo
from .seeding import derive_seed, seed_torch

if TYPE_CHECKING:  # pragma: no cover
    from .algorithms.base import Algorithm
    from .engine import Engine
    from .flat import FlatModel

#: hooks whose override changes the local update: an override must come with its own opt-in
#: (train_epochs / joint_update / personal_phase / personal_step: the personalised family's local
#: update, fedhpc.algorithms.personal; meta_gradient / sgd_step: Per-FedAvg's meta-step;
#: batched_local_update: the batched path's own)
LOCAL_UPDATE_HOOKS = ("loss", "local_update", "make_optimizer", "mix_loss", "train_epochs", "joint_update",
                      "personal_phase", "personal_step", "meta_gradient", "sgd_step", "batched_local_update")


# --------------------------------------------------------------------------- what a hook sees

@dataclass
class ClientGroup:
    """The K clients of one batched step, as ``Algorithm.batched_loss`` sees them.

    ``forward(x)`` maps inputs (K, B, ...) to logits (K, B, C), row k through client k's
    weights (``forward(x, real=[n_1, ..., n_K])`` for a batch other than the step's, so that
    dropout and BatchNorm know each client's real rows). ``params`` are name -> (K, *shape) views of the stacked flat states (the
    differentiable leaves, in ``flat.entries`` order). ``active[k]`` says whether client k
    takes this step (False: all its rows are padding; the hook must not draw from its random
    streams then). ``real[k]`` is how many of the B rows of client k are real samples.
    ``buffers``: name -> (K, *shape) views of the clients' running statistics (BatchNorm), which a
    training forward updates. ``skip(clients, columns)``: those clients' parameters at ``columns`` took
    no part in this step's loss (a residual block they dropped), so they take no step (see :meth:`skip`).
    ``rng``: each client's generator state (its dropout stream; None when the model draws nothing),
    for a pass a hook runs for one client on its own (:func:`client_stream`).
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: Dict[str, torch.Tensor]
    ctxs: List[ClientContext]
    active: List[bool]
    real: List[int]
    flat: "FlatModel"
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    #: (K, num_params) bool, True where client k's parameter took no part in the step (set by skip)
    skipped: Optional[torch.Tensor] = None
    rng: Optional[List[torch.Tensor]] = None

    def skip(self, clients: List[int], columns: torch.Tensor) -> None:
        """The parameters at ``columns`` ((num_params,) bool on the states' device, e.g.
        ``flat.mask(names)[:flat.num_params]``) of the clients at positions ``clients`` took no part in
        this step's loss: their sequential steps would see these gradients None, which torch's
        optimisers skip (no step, no momentum, no weight decay, no Adam moments or step count); the
        stacked step keeps them so for those clients alone (their gradient rows, zero, add nothing to
        a clipped gradient's norm, as a None gradient does)."""
        if self.skipped is None:
            self.skipped = torch.zeros(len(self.ctxs), self.flat.num_params, dtype=torch.bool, device=columns.device)
        for k in clients:
            self.skipped[k] |= columns


@contextmanager
def client_weights(model: nn.Module, stacked: Dict[str, torch.Tensor], k: int) -> Iterator[nn.Module]:
    """``model`` holding client k's weights, row k of the batched path's (K, *shape) parameter views
    (``ClientGroup.params``), for a pass the grouped kernels do not compute (FedAlign's slimmed last
    block, GradAug's sub-networks); gradients flow back to the views. Buffers stay the model's own."""
    saved = []
    try:
        for mod_name, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    saved.append((module._parameters, pname, p))
                    module._parameters[pname] = stacked[f"{mod_name}.{pname}" if mod_name else pname][k]
        yield model
    finally:
        for slot, pname, p in saved:
            slot[pname] = p


@contextmanager
def _generator_at(states: List[torch.Tensor], k: int, device: torch.device) -> Iterator[None]:
    """torch's generator of ``device`` at ``states[k]`` (client k's stream) for the block; the advanced
    state goes back to ``states[k]`` and the generator to where it was, so the next client's draws,
    and whatever draws after the group, continue their own streams."""
    gen = device_generator(device)
    saved = gen.get_state()
    gen.set_state(states[k])
    try:
        yield
    finally:
        states[k] = gen.get_state()
        gen.set_state(saved)


@contextmanager
def client_stream(group: ClientGroup, k: int, device: torch.device) -> Iterator[None]:
    """torch's generator of ``device`` at client ``k``'s state (``group.rng[k]``), for a pass of client
    k's own (a sub-network under :func:`client_weights`): its dropout masks continue client k's stream
    as its sequential step's next forward does. Nothing to swap when the model draws nothing
    (``group.rng`` None)."""
    if group.rng is None:
        yield
        return
    with _generator_at(group.rng, k, device):
        yield


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
        # (K, P): row k client k's own anchor, read as (K, *shape) views (never differentiated)
        anchors = list(stacked_params(group.flat, torch.stack(states), trainable=set()).values())
    sq = [(p - a).pow(2).flatten(1).sum(1) for p, a in zip(group.params.values(), anchors)]
    return 0.5 * mu * torch.stack(sq, 1).sum(1)


def add_proximal_terms(losses: torch.Tensor, group: ClientGroup, algo: "Algorithm", mu: float) -> torch.Tensor:
    """``losses`` (K,) plus :func:`proximal_terms`; ``losses`` when mu is 0 (the batched twin of
    :func:`fedhpc.algorithms.fedprox.add_proximal_term`: "+ FedProx" options of the mixing methods)."""
    return losses if mu == 0 else losses + proximal_terms(group, algo, mu)


# --------------------------------------------------------------------------- who may be batched

def _owner(cls: type, attr: str) -> Optional[type]:
    for klass in cls.__mro__:
        if attr in klass.__dict__:
            return klass
    return None


#: the fix every refusal of the batched path names
_RUN_SEQUENTIALLY = "run with --clients-at-once 1 (the sequential path)"


def method_refusal(cls: type, name: str) -> Optional[str]:
    """Why the method ``cls`` (registered as ``name``) cannot train clients at once whatever the run,
    or None when it declares the batched path (then the model and optimiser decide: check_batchable).
    The launcher's list of algorithms marks the methods this passes."""
    fix = _RUN_SEQUENTIALLY
    if not getattr(cls, "batchable", False) or not hasattr(cls, "batched_loss"):
        why = getattr(cls, "not_batchable_because", None)  # a method that says why it stays sequential
        return (f"--algo {name} does not support --clients-at-once > 1 (its local update is "
                f"not declared batchable{': ' + why if why else ''}); {fix}")
    opt_in = _owner(cls, "batchable")
    for hook in LOCAL_UPDATE_HOOKS:
        owner = _owner(cls, hook)
        # The opt-in must sit in a class at least as derived as every override of the local update.
        if owner is not None and owner is not opt_in and issubclass(owner, opt_in):
            return (f"--algo {name}: {owner.__name__}.{hook} overrides the local update of "
                    f"{opt_in.__name__}, which declared the batched path; {fix}")
    return None


def check_batchable(algo: "Algorithm", model: nn.Module, cfg) -> None:
    """Raise ConfigError unless ``clients_at_once`` > 1 can train this run exactly."""
    refusal = method_refusal(type(algo), cfg.algo)
    if refusal:
        raise ConfigError(refusal)
    fix = _RUN_SEQUENTIALLY
    if cfg.optimizer not in ("sgd", "adam"):
        raise ConfigError(f"--clients-at-once > 1 supports --optimizer sgd and adam, got {cfg.optimizer!r}; {fix}")
    # the advice names the model option that removes the layer only where the run's model has it
    options = model_option_params(algo.model_name)

    def without(layer: str, option: str, value: str) -> str:
        if option in options:
            return f"use --model-opt {option}={value} (the model without {layer})"
        return f"use a model without {layer} (the run's model {algo.model_named} always has it; e.g. --model cnn)"

    # dropout and BatchNorm are batched on the grouped kernels only (per-client masks and statistics)
    ungrouped = next((n for n, m in model.named_modules() if any(p is not None for p in m._parameters.values())
                      and type(m) not in GROUPED_MODULES + GROUPED_NORMS), None)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            if type(module) not in CLIENT_DROPOUTS:
                raise ConfigError(f"--clients-at-once > 1 reproduces the masks of nn.Dropout and Dropout1d/2d/3d "
                                  f"only, not {type(module).__name__} (module {name!r}); "
                                  f"{without('dropout', 'dropout', '0')} or {fix}")
            if ungrouped is not None:
                raise ConfigError(f"--clients-at-once > 1 reproduces per-client dropout masks (module {name!r}) "
                                  f"only in models whose layers with weights are all Linear, Conv2d or BatchNorm, "
                                  f"and {ungrouped!r} is a {type(dict(model.named_modules())[ungrouped]).__name__}; "
                                  f"{without('dropout', 'dropout', '0')} or {fix}")
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if type(module) not in GROUPED_NORMS or ungrouped is not None:
                what = (f"{type(module).__name__} is not one of BatchNorm1d/2d/3d" if type(module) not in GROUPED_NORMS
                        else f"{ungrouped!r} is a {type(dict(model.named_modules())[ungrouped]).__name__}")
                raise ConfigError(f"--clients-at-once > 1 keeps per-client BatchNorm statistics (module {name!r}) "
                                  f"only in models whose layers with weights are all Linear, Conv2d or "
                                  f"BatchNorm1d/2d/3d, and {what}; {without('BatchNorm', 'norm', 'none')} or {fix}")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigError(f"--clients-at-once > 1 trains every parameter; {frozen[:3]} are frozen; {fix}")
    task = getattr(algo.data, "task", "classification")
    if task != "classification":
        # per-position labels (next-character prediction) and recurrent models: not batched here
        raise ConfigError(f"--clients-at-once > 1 batches classification tasks only; the dataset's task is "
                          f"{task!r}; {fix}")


# --------------------------------------------------------------------------- the batched model

def stacked_params(flat, theta: torch.Tensor, trainable: Optional[set] = None) -> Dict[str, torch.Tensor]:
    """name -> (K, *shape) views of ``theta``'s parameter columns: leaves requiring grad that
    share ``theta``'s memory, so stepping ``theta`` in place moves them too. ``trainable``: the
    names that require grad (default all); the others are plain views (read, not differentiated)."""
    k = theta.shape[0]
    return {e.name: theta[:, e.offset:e.offset + e.numel].view((k,) + tuple(e.shape))
            .requires_grad_(trainable is None or e.name in trainable)
            for e in flat.entries if e.is_param}


def stacked_buffers(flat, buffers: torch.Tensor) -> Dict[str, torch.Tensor]:
    """name -> (K, *shape) views of ``buffers`` (K, numel - num_params), the float buffers'
    columns of the stacked states (BatchNorm's running statistics), in ``flat.entries`` order.
    Kept apart from ``theta``: updated in place during a forward, they must not share the
    version counter of the parameter leaves autograd saved."""
    k = buffers.shape[0]
    return {e.name: buffers[:, e.offset - flat.num_params:e.offset - flat.num_params + e.numel].view((k,) + tuple(e.shape))
            for e in flat.entries if not e.is_param}


def vmap_forward(model: nn.Module, params: Dict[str, torch.Tensor],
                 buffers: Optional[Dict[str, torch.Tensor]] = None) -> Callable[..., torch.Tensor]:
    """(K, B, ...) -> (K, B, C): ``torch.func.vmap`` of ``functional_call`` over the K clients.
    Works for any model whose forward vmap supports; the reference for the grouped kernels.
    ``buffers``: (K, ...) stacked float buffers (read only: the model's dropout and BatchNorm are
    in eval mode whenever this path runs them, see :func:`stacked_forward`); without them every
    client reads the model's own."""
    from torch.func import functional_call, vmap

    own = dict(model.named_buffers())
    if buffers is None:
        batched = vmap(lambda p, x: functional_call(model, (p, own), (x,)))
        return lambda x, real=None: batched(params, x)
    fixed = {n: b for n, b in own.items() if n not in buffers}  # integer buffers (num_batches_tracked)
    batched = vmap(lambda p, b, x: functional_call(model, (p, {**fixed, **b}), (x,)))
    return lambda x, real=None: batched(params, buffers, x)


#: modules the grouped kernels compute K clients of at once (exact types: a subclass may
#: use its weight elsewhere in its forward)
GROUPED_MODULES = (nn.Linear, nn.Conv2d)
#: normalisation layers the grouped kernels compute per client (statistics over each client's rows)
GROUPED_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: dropout layers whose masks are drawn per client from each client's own generator state
CLIENT_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_DROPOUT_FUNCTIONS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)


def stochastic_layers(model: nn.Module) -> bool:
    """Whether the model has a layer whose training forward depends on more than each sample on
    its own: active dropout (random masks) or BatchNorm (batch statistics)."""
    return any((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or isinstance(m, nn.modules.batchnorm._BatchNorm)
               for m in model.modules())


def device_generator(device: torch.device) -> torch.Generator:
    """torch's default generator of ``device``: the one :func:`fedhpc.seeding.seed_torch` seeds per
    client and the sequential path's dropout draws from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


class StepRows:
    """What dropout and BatchNorm need to know of the current batched step: each client's real rows
    (``real``, of ``batch`` rows per client; None outside a step) and each client's generator state
    (``rng``, advanced in place as its masks are drawn; None when the model draws nothing)."""

    def __init__(self, rng: Optional[List[torch.Tensor]] = None):
        self.rng = rng
        self.real: Optional[List[int]] = None
        self.batch = 0
        self._rows: Optional[torch.Tensor] = None

    def set(self, real: List[int], batch: int) -> None:
        self.real, self.batch, self._rows = real, batch, None

    def rows(self, device) -> torch.Tensor:
        """``real`` as a (K,) tensor on ``device`` (made once per step)."""
        if self._rows is None or self._rows.device != device:
            self._rows = host_to_device(torch.tensor(self.real, dtype=torch.long), device)
        return self._rows


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


def _client_dropout(func, args, kwargs, k: int, step: "StepRows"):
    """A dropout call on K clients' folded rows (K*B, ...): client k's mask drawn by ``func`` itself on
    ones of client k's real rows, from client k's generator state (then advanced), as its sequential
    step draws it; padded rows get mask 0. ``input * mask`` is then the sequential ``input * noise``."""
    x = args[0] if args else kwargs["input"]
    rest = args[1:]
    if step is None or step.real is None or step.rng is None:
        raise RuntimeError("a dropout layer ran in a batched forward without the step's rows and client "
                           "generators (fedhpc.batched.StepRows)")
    b = x.shape[0] // k
    mask = torch.zeros((k, b) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    for i, n in enumerate(step.real):
        if n == 0:
            continue  # a client masked out of the step draws nothing, as it takes no step
        with _generator_at(step.rng, i, x.device):
            ones = torch.ones((n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            mask[i, :n] = func(ones, *rest, **{key: v for key, v in kwargs.items() if key != "input"})
    return x * mask.view_as(x)


def _grouped_batch_norm(x, k: int, step: Optional["StepRows"], running_mean, running_var, weight, bias,
                        training: bool, momentum: float, eps: float):
    """F.batch_norm of K clients' folded rows (K*B, C, *S), client k's statistics over its own real
    rows (training) or its own running statistics (K, C) (eval); training updates the running rows
    of the clients that take the step, as F.batch_norm updates a client's (unbiased variance)."""
    b = x.shape[0] // k
    xs = x.reshape((k, b) + tuple(x.shape[1:]))
    c, spatial = x.shape[1], xs.dim() - 3
    per_channel = (k, 1, c) + (1,) * spatial
    if training:
        if step is not None and step.real is not None and step.batch == b:
            rows = step.rows(x.device)
        else:
            rows = torch.full((k,), b, dtype=torch.long, device=x.device)
        real = (torch.arange(b, device=x.device) < rows[:, None]).to(x.dtype).view((k, b, 1) + (1,) * spatial)
        dims = (1,) + tuple(range(3, 3 + spatial))
        count = (rows * math.prod(x.shape[2:])).to(x.dtype)
        denom = count.clamp_min(1).view(k, 1)
        mean = (xs * real).sum(dims) / denom
        centered = xs - mean.view(per_channel)
        var = (centered * centered * real).sum(dims) / denom
        # padded rows leave as 0: normalised by statistics they took no part in, they would grow
        # layer after layer (inf, then NaN gradients through the client's weights)
        out = torch.where(real > 0, centered * torch.rsqrt(var + eps).view(per_channel), 0.0)
        if running_mean is not None:
            with torch.no_grad():
                takes = (rows > 0).view(k, 1)
                unbiased = var * (count / (count - 1).clamp_min(1)).view(k, 1)
                running_mean.copy_(torch.where(takes, running_mean * (1 - momentum) + mean.detach() * momentum,
                                               running_mean))
                running_var.copy_(torch.where(takes, running_var * (1 - momentum) + unbiased.detach() * momentum,
                                              running_var))
    else:
        out = (xs - running_mean.view(per_channel)) * torch.rsqrt(running_var.view(per_channel) + eps)
    if weight is not None:
        out = out * weight.view(per_channel)
    if bias is not None:
        out = out + bias.view(per_channel)
    return out.reshape(x.shape)


class _GroupedKernels(torch.overrides.TorchFunctionMode):
    """Routes F.linear / F.conv2d / F.batch_norm calls whose weights (or statistics) carry a leading
    client dimension to the grouped kernels, and dropout calls in training to per-client masks;
    every other op sees the folded batch (K*B, ...) as one batch."""

    def __init__(self, k: int = 0, step: Optional[StepRows] = None):
        super().__init__()
        self.k, self.step = k, step

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
        elif func is F.batch_norm:
            names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
            a = dict(zip(names, (None, None, None, None, None, False, 0.1, 1e-5)))
            a.update(zip(names, args))
            a.update(kwargs)
            if any(t is not None and t.dim() == 2 for t in (a["running_mean"], a["weight"])):
                return _grouped_batch_norm(a["input"], self.k, self.step, a["running_mean"], a["running_var"],
                                           a["weight"], a["bias"], a["training"], a["momentum"], a["eps"])
        elif func in _DROPOUT_FUNCTIONS and self.k:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and p > 0:
                return _client_dropout(func, args, kwargs, self.k, self.step)
        return func(*args, **kwargs)


def grouped_forward(model: nn.Module, params: Dict[str, torch.Tensor],
                    buffers: Optional[Dict[str, torch.Tensor]] = None, step: Optional[StepRows] = None
                    ) -> Optional[Callable[..., torch.Tensor]]:
    """(K, B, ...) -> (K, B, C) with grouped kernels (bmm, grouped convolution): the model's own
    forward on the folded batch (K*B, ...), its Linear / Conv2d / BatchNorm weights swapped for the
    (K, ...) stacks and BatchNorm's running statistics for the rows of ``buffers``. None when a
    module holding parameters is not one of GROUPED_MODULES / GROUPED_NORMS. The folding is only
    right for a forward that treats samples independently (BatchNorm and dropout apart, which the
    kernels compute per client): :func:`stacked_forward` checks it once per model against
    :func:`vmap_forward`. ``step``: the step's real rows and client generators (dropout, BatchNorm)."""
    slots = []
    for mod_name, module in model.named_modules():
        own = [n for n, p in module._parameters.items() if p is not None]  # (a Conv2d without bias holds None)
        if not own:
            continue
        if type(module) not in GROUPED_MODULES + GROUPED_NORMS:
            return None
        for pname in own:
            slots.append((module._parameters, pname, params[f"{mod_name}.{pname}" if mod_name else pname]))
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and buffers is not None:
            for bname in ("running_mean", "running_var"):
                if module._buffers.get(bname) is not None:
                    slots.append((module._buffers, bname, buffers[f"{mod_name}.{bname}" if mod_name else bname]))
    stochastic = [m for m in model.modules() if isinstance(m, (nn.modules.dropout._DropoutNd,
                                                               nn.modules.batchnorm._BatchNorm))]

    def forward(x: torch.Tensor, real: Optional[List[int]] = None, **model_kwargs):
        k, b = x.shape[0], x.shape[1]
        rows = step
        if real is not None:  # this call's own rows (the step's stay as they are for its other calls)
            rows = StepRows(step.rng if step is not None else None)
            rows.set([int(n) for n in real], b)
        elif step is not None and any(m.training for m in stochastic) and (step.real is None or step.batch != b):
            raise RuntimeError(f"a batched forward of {b} rows per client through a model with dropout or "
                               f"BatchNorm needs each client's real rows: call group.forward(x, real=[...])")
        saved = [(slot, n, slot[n]) for slot, n, _ in slots]
        try:
            for slot, n, stacked in slots:
                slot[n] = stacked  # a plain tensor in the slot: nn.Module reads it as is
            with _GroupedKernels(k, rows):
                out = model(x.reshape((k * b,) + tuple(x.shape[2:])), **model_kwargs)
        finally:
            for slot, n, original in saved:
                slot[n] = original
        return _unfold(out, k, b)

    return forward


def _unfold(out, k: int, b: int):
    """A folded forward's output back to per-client rows: every tensor (K*B, ...) -> (K, B, ...), through
    the tuples and dicts a model returns (``model(x, return_features=True)``: logits and a feature dict)."""
    if isinstance(out, torch.Tensor):
        return out.reshape((k, b) + tuple(out.shape[1:]))
    if isinstance(out, dict):
        return {name: _unfold(v, k, b) for name, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_unfold(v, k, b) for v in out)
    return out


#: per model: whether the grouped kernels reproduced vmap on a real batch (checked once)
_GROUPED_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


class _StochasticLayersInEval:
    """Dropout and BatchNorm in eval mode for the grouped-vs-vmap check: no mask drawn from any
    generator, no statistic updated, and what is compared is whether the rest of the forward
    treats samples independently."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, (nn.modules.dropout._DropoutNd,
                                                                     nn.modules.batchnorm._BatchNorm))]

    def __enter__(self):
        self.was = [m.training for m in self.modules]
        for m in self.modules:
            m.training = False

    def __exit__(self, *exc):
        for m, was in zip(self.modules, self.was):
            m.training = was


def stacked_forward(model: nn.Module, params: Dict[str, torch.Tensor], probe: torch.Tensor,
                    buffers: Optional[Dict[str, torch.Tensor]] = None, step: Optional[StepRows] = None
                    ) -> Callable[..., torch.Tensor]:
    """The fastest exact forward for K clients: the grouped kernels when the model is built of
    GROUPED_MODULES (and GROUPED_NORMS) and they agree with vmap on ``probe`` (K, B, ...) (a
    forward that mixes samples other than by BatchNorm would not), else vmap, which a model with
    dropout or BatchNorm cannot take (ConfigError)."""
    grouped = grouped_forward(model, params, buffers, step)
    stochastic = stochastic_layers(model)
    if grouped is None:
        if stochastic:
            raise ConfigError("--clients-at-once > 1: a model with dropout or BatchNorm needs the grouped kernels "
                              "(layers with weights all Linear, Conv2d or BatchNorm); run with --clients-at-once 1")
        return vmap_forward(model, params)
    if probe.shape[0] < 2:
        return grouped  # one client: the folded batch is its own batch, nothing to tell apart
    ok = _GROUPED_CHECKED.get(model)
    if ok is None:
        with torch.no_grad(), _StochasticLayersInEval(model):
            want = vmap_forward(model, params, buffers)(probe)
            got = grouped(probe)
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        _GROUPED_CHECKED[model] = ok  # only a verdict over >= 2 clients is kept
    if ok:
        return grouped
    if stochastic:
        raise ConfigError("--clients-at-once > 1: this model's forward mixes the samples of a batch beyond "
                          "BatchNorm, so its clients cannot be folded into one batch, and with dropout or "
                          "BatchNorm the vmap path cannot take it; run with --clients-at-once 1")
    return vmap_forward(model, params)


class _StackedOptimizer:
    """What ``torch.optim.SGD`` and ``Adam`` share on a stacked (K, P) state: only the first
    ``num_params`` columns (the parameters; FlatModel puts buffers after them) are stepped, after a
    per-client ``clip_grad_norm_`` and the L2 weight decay added to the gradient; a client whose
    ``active`` flag is False keeps its row and its optimiser state bit for bit. ``columns``
    (num_params,) bool: the parameters the optimiser was given (default all); the others are
    frozen, kept bit for bit like a masked-out client (no state, no weight decay), as a parameter
    left out of torch's optimiser's list is. A step's own ``columns`` narrows them for that step (the
    parameters whose gradient is None then: torch's optimisers skip those): (num_params,) for every
    client, or (K, num_params), a row per client (a block one client dropped)."""

    def __init__(self, num_params: int, lr: float, weight_decay: float, grad_clip: float,
                 columns: Optional[torch.Tensor] = None):
        self.p = num_params
        self.lr, self.weight_decay, self.grad_clip = lr, weight_decay, grad_clip
        self.columns = None if columns is None else columns[None, :]

    def gradient(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
                 columns: Optional[torch.Tensor] = None):
        """(weights view, the gradient the update uses, which entries move: None for all)."""
        w = theta[:, :self.p]
        g = grad[:, :self.p]
        # which entries move: the active clients' rows, the step's or the optimiser's columns (None: all)
        moves = None if active is None else active[:, None]
        columns = self.columns if columns is None else (columns if columns.dim() == 2 else columns[None, :])
        if columns is not None:
            moves = columns if moves is None else moves & columns
        if self.grad_clip > 0:
            # clip_grad_norm_ per client: the 2-norm over all of its parameters' gradients
            norm = torch.linalg.vector_norm(g, 2, dim=1, keepdim=True)
            g = g * (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        if self.weight_decay != 0:
            g = g.add(w, alpha=self.weight_decay)
        return w, g, moves

    @staticmethod
    def keep(moves: Optional[torch.Tensor], new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return new if moves is None else torch.where(moves, new, old)


class StackedSGD(_StackedOptimizer):
    """``torch.optim.SGD`` (momentum, weight decay, Nesterov) on every row of a (K, P) state at
    once, with per-client masking (see :class:`_StackedOptimizer`)."""

    def __init__(self, theta: torch.Tensor, num_params: int, lr: float, momentum: float,
                 weight_decay: float, grad_clip: float, nesterov: bool = False,
                 columns: Optional[torch.Tensor] = None):
        super().__init__(num_params, lr, weight_decay, grad_clip, columns)
        self.momentum, self.nesterov = momentum, nesterov
        # Zeros, not "unset": momentum * 0 + g == g exactly, torch's first-step buffer.
        self.buf = torch.zeros_like(theta[:, :num_params]) if momentum > 0 else None

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
             columns: Optional[torch.Tensor] = None) -> None:
        """``active``: (K,) bool, or None when every client takes this step; ``columns``: see the base."""
        w, g, moves = self.gradient(theta, grad, active, columns)
        if self.buf is not None:
            new_buf = self.buf.mul(self.momentum).add_(g)
            self.buf = self.keep(moves, new_buf, self.buf)
            g = g.add(new_buf, alpha=self.momentum) if self.nesterov else new_buf
        w.copy_(self.keep(moves, w.add(g, alpha=-self.lr), w))


class StackedAdam(_StackedOptimizer):
    """``torch.optim.Adam`` as the sequential path builds it (``--optimizer adam``: betas (0.9,
    0.999), eps 1e-8, no AMSGrad, weight decay added to the gradient) on every row of a (K, P)
    state at once, with per-client masking (see :class:`_StackedOptimizer`).

    Each client counts its own steps: one masked out of a step (fewer batches than the group's
    largest client) takes no step, so its bias corrections 1 - beta^t are those of its own t, as
    in its sequential training. They are computed in float64, as torch computes them from its
    Python step count, and applied per row. torch counts per parameter: one without a gradient at
    a step is skipped and its count stays. From the first step that leaves some parameters out
    (a step's own ``columns``: no gradient, or a block a client dropped) the counts are kept per
    entry, (K, num_params), so each parameter's bias corrections are those of its own steps."""

    betas = (0.9, 0.999)
    eps = 1e-8

    def __init__(self, theta: torch.Tensor, num_params: int, lr: float, weight_decay: float,
                 grad_clip: float, columns: Optional[torch.Tensor] = None):
        super().__init__(num_params, lr, weight_decay, grad_clip, columns)
        self.exp_avg = torch.zeros_like(theta[:, :num_params])
        self.exp_avg_sq = torch.zeros_like(theta[:, :num_params])
        self.steps = torch.zeros(theta.shape[0], 1, dtype=torch.float64, device=theta.device)

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, active: Optional[torch.Tensor],
             columns: Optional[torch.Tensor] = None) -> None:
        """``active``: (K,) bool, or None when every client takes this step; ``columns``: see the base."""
        beta1, beta2 = self.betas
        w, g, moves = self.gradient(theta, grad, active, columns)
        exp_avg = self.exp_avg.lerp(g, 1 - beta1)
        exp_avg_sq = self.exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
        if columns is not None and self.steps.shape[1] == 1:
            self.steps = self.steps.expand(-1, self.p).clone()  # counts per entry from now on
        if self.steps.shape[1] == 1:
            self.steps += 1 if active is None else active[:, None].to(self.steps.dtype)
        else:
            self.steps += 1 if moves is None else moves.to(self.steps.dtype)
        t = self.steps.clamp(min=1)  # a client not stepped yet: any value, its row is kept below
        step_size = (self.lr / (1 - beta1 ** t)).to(w.dtype)
        bias_correction2_sqrt = (1 - beta2 ** t).sqrt().to(w.dtype)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        self.exp_avg = self.keep(moves, exp_avg, self.exp_avg)
        self.exp_avg_sq = self.keep(moves, exp_avg_sq, self.exp_avg_sq)
        w.copy_(self.keep(moves, w - step_size * (exp_avg / denom), w))


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


def _span(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one tensor ``parts`` (of one dtype and row shape, at least one row in all) are the rows of,
    in order, as a view, when they lie one after another in one storage; else None."""
    parts = [p for p in parts if p.shape[0] > 0]
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(p.is_contiguous() for p in parts) and len({p.untyped_storage().data_ptr() for p in parts}) == 1 \
            and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])):
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride(), first.storage_offset())
    return None


def _joined(parts: List[torch.Tensor]) -> torch.Tensor:
    """``parts`` as one tensor along rows: read in place when they lie one after another in one storage
    (a group's training rows moved together: ClientData.all_training_on), else a copy."""
    span = _span(parts)
    return span if span is not None else torch.cat(parts)


def epoch_batches(ctxs: List[ClientContext], epoch: int, batch_size: int) -> Optional[EpochBatches]:
    """The clients' own batches of ``epoch`` (ClientContext.batches: same order, same augmentation).

    A client's batches are consecutive chunks of its permutation, so rows [s*B, s*B + n_s) of its
    padded row hold batch s and only the last batch can be short. Without augmentation the group's
    epoch is one gather: the clients' training rows joined and transformed (row-wise then), a zero
    row after them, and one index of (K, S*B) positions, each client's permutation and then the zero
    row for its padding (a few kernels a group; batch by batch took a few a step and client). With
    augmentation the batches come from ``ctx.batches``, whose generator draws batch by batch."""
    k = len(ctxs)
    sizes = [ctx.num_train for ctx in ctxs]
    steps = max(-(-n // batch_size) for n in sizes)
    if steps == 0:
        return None  # no client of the group has training data: nothing to step
    width = steps * batch_size
    real: List[List[int]] = []
    weights: List[List[float]] = []
    for n in sizes:
        counts = [min(batch_size, n - s) for s in range(0, n, batch_size)]
        real.append(counts + [0] * (steps - len(counts)))
        row: List[float] = []
        for c in real[-1]:  # 1/c on a step's c real rows, 0 on its padding
            row += [1.0 / c] * c + [0.0] * (batch_size - c) if c else [0.0] * batch_size
        weights.append(row)
    transform = ctxs[0].algo.data.transform
    if ctxs[0].algo.data.augments:
        x = y = None
        for i, ctx in enumerate(ctxs):
            if sizes[i] == 0:
                continue
            batches = list(ctx.batches(epoch, batch_size))
            bx, by = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            if x is None:
                x = torch.zeros((k, width) + tuple(bx.shape[1:]), dtype=bx.dtype, device=bx.device)
                y = torch.zeros((k, width), dtype=torch.long, device=bx.device)
            x[i, :sizes[i]] = bx
            y[i, :sizes[i]] = by
    else:
        xs = transform(_joined([ctx.data.x for ctx in ctxs]), True, None)
        ys = _joined([ctx.data.y for ctx in ctxs])
        index = torch.full((k, width), sum(sizes), dtype=torch.long)  # the zero row, for padding
        start = 0
        for i, ctx in enumerate(ctxs):
            index[i, :sizes[i]] = ctx.permutation(epoch) + start
            start += sizes[i]
        index = host_to_device(index, xs.device)  # one copy for the group
        x = torch.cat([xs, xs.new_zeros((1,) + tuple(xs.shape[1:]))])[index]
        y = torch.cat([ys, ys.new_zeros(1)])[index].to(torch.long)
    weight = host_to_device(torch.tensor(weights, dtype=x.dtype if x.is_floating_point() else torch.float32),
                            x.device).view(k, steps, batch_size)
    shape = (k, steps, batch_size)
    counts = host_to_device(torch.tensor(real, dtype=torch.float64), x.device)
    return EpochBatches(x.view(shape + tuple(x.shape[2:])), y.view(shape), weight, real, steps, counts)


# --------------------------------------------------------------------------- training a group

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
