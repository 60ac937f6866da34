"""The forward of K clients at once: (K, *shape) parameter views of the stacked states, grouped
kernels (one bmm / one grouped convolution a layer, per-client BatchNorm statistics and dropout
masks) or ``vmap`` of ``functional_call``, checked against each other once per model."""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..data.base import host_to_device
from ..errors import ConfigError


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
