"""Data-parallel server training: every rank a shard of every server batch.

Some algorithms train a model on the server: FLD / MixFLD / Mix2FLD convert the
devices' per-label outputs into a model by K_s SGD iterations on seed samples
(Mix2FLD paper, Eq. 5), XorMixFL trains on its own data plus decoded samples,
FD-style and FedAlign-style server steps, the Hessian analysis. Run on rank 0
alone, that work would leave every other rank idle; :class:`ServerTrainer`
spreads it over all ranks and gives the same weights, bit for bit, on 1, 2 or 3
ranks (see below).

The rules, which the tests re-implement independently:

* Preconditions. Every rank holds the same server dataset (the caller gathered it
  once, in a rank-independent order) and the same weights: a model whose
  parameters and float buffers are views into a :class:`fedhpc.flat.FlatModel`.
* Batches. Pass ``e`` over the ``n`` samples uses ``torch.randperm(n, generator=
  torch.Generator().manual_seed(derive_seed(seed, "server_batches", e)))`` cut
  into consecutive batches of ``batch_size`` (the last one smaller, or dropped
  with ``drop_last``). ``steps`` counts optimizer steps (K_s) and runs as many
  passes as needed, the last one cut short; ``epochs`` runs whole passes.
* Micro-batches. A batch of B samples is cut into consecutive micro-batches of
  ``micro_batch`` samples (the last one smaller), except that a last one of a single
  sample is joined to the one before it (that one then has ``micro_batch + 1``): BatchNorm
  cannot normalise one sample in training mode, and a batch that trains whole must not
  fail for how it was cut (:func:`micro_batch_bounds`; ``micro_batch=1`` asks for
  single-sample micro-batches and keeps them). Micro-batch ``j`` runs on rank
  ``j % size``. Its size does not depend on the rank count, so neither does any
  computation inside it: before it runs, the device's default generator (CPU:
  ``torch.default_generator``, CUDA: the device's) is seeded with
  ``derive_seed(seed, "server_micro", step, j)`` (dropout masks), the
  ``transform``'s generator with ``derive_seed(seed, "server_augment", step, j)``
  (augmentation), and BatchNorm normalises with the micro-batch's own statistics
  (ghost batches of ``micro_batch`` samples, a joined last one of ``micro_batch + 1``;
  ``micro_batch >= batch_size`` gives plain BatchNorm).
* Gradient. g = (1/B) * sum over the batch of d loss_i / d w, with ``loss_fn``
  returning per-sample losses. Every micro-batch's float32 gradient is computed
  identically on any rank count, so the only rank-dependent step is how the sum
  is grouped; it goes into a :class:`fedhpc.reproducible_sum.ReproducibleSum`
  (with the BatchNorm buffer updates and the loss sum), whose result does not
  depend on the grouping, aligned and sum-all-reduced once per step. A float64
  sum of the float32 gradients rounds back to the same float32 almost always,
  but not always (~1e-9 per weight and step), and a one-ulp difference grows
  with the steps; this one has the same bits always. The all-reduce carries
  three float64 words per weight, after an int8 one (the digit positions);
  server models are small next to the compute of a step.
* Clipping (``grad_clip > 0``): on the reduced gradient, torch's rule
  g *= min(1, c / (||g||_2 + 1e-6)).
* BatchNorm running statistics. Every micro-batch starts from the pre-step
  buffers; the new buffers are the pre-step ones plus the mean over the batch's
  micro-batches of their updates: with momentum m, running_mean <- (1 - m) *
  running_mean + m * mean_j(mean of micro-batch j), and likewise running_var
  with the micro-batches' unbiased variances. ``num_batches_tracked`` counts
  optimizer steps (+1 per step: one step is one batch). Other integer buffers are
  left as they were before the fit.
* Optimizer: created fresh in every ``fit`` call (``sgd`` with momentum,
  Nesterov and weight decay, or ``adam``), so a fit depends only on its inputs;
  a caller that wants momentum to persist asks for more steps in one call.
* Side effects: the caller's RNG state, the model's train/eval mode and its
  ``.grad`` fields are restored on return.
* Failures: an exception raised on some ranks only (say in a loss on the ranks
  that have a micro-batch) never leaves the others waiting in an all-reduce:
  every rank raises at the end of the fit, the failing ones their own error,
  the others that error naming the rank (:meth:`fedhpc.world.World.raise_together`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..data.base import BatchTransform, default_transform
from ..errors import ConfigError, DataError, NonFiniteLossError
from ..flat import FlatModel
from ..reproducible_sum import MAX_TERMS, ReproducibleSum, storage_numel
from ..seeding import derive_seed

# loss_fn(logits, targets_mb, extra_mb) -> per-sample losses, shape [mb]
LossFn = Callable[[torch.Tensor, torch.Tensor, Optional[object]], torch.Tensor]
Extra = Union[None, torch.Tensor, Sequence[torch.Tensor]]

OPTIMIZERS = ("sgd", "adam")


@dataclass
class ServerTrainConfig:
    """How long and how the server trains. Exactly one of ``steps`` / ``epochs`` is > 0."""

    steps: int = 0                # optimizer steps (K_s in Mix2FLD)
    epochs: int = 0               # or whole passes over the data (XorMixFL)
    batch_size: int = 64
    micro_batch: int = 16         # samples per micro-batch: the unit of work spread over ranks
    lr: float = 0.01
    optimizer: str = "sgd"        # sgd | adam
    momentum: float = 0.0         # sgd
    weight_decay: float = 0.0     # L2 added to the gradient (torch's SGD / Adam convention)
    grad_clip: float = 0.0        # max L2 norm of the batch gradient; 0 = off
    nesterov: bool = False        # sgd
    betas: Tuple[float, float] = (0.9, 0.999)  # adam
    eps: float = 1e-8             # adam
    drop_last: bool = False       # drop each pass's last, smaller batch

    def validate(self) -> None:
        if (self.steps > 0) == (self.epochs > 0) or self.steps < 0 or self.epochs < 0:
            raise ConfigError(f"server training needs exactly one of steps and epochs > 0; got steps="
                              f"{self.steps}, epochs={self.epochs}: set one of them and leave the other at 0")
        for name in ("batch_size", "micro_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"server training {name} must be >= 1; got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"server optimizer {self.optimizer!r} is unknown; use one of {OPTIMIZERS}")
        if not (self.lr >= 0 and self.weight_decay >= 0 and self.grad_clip >= 0):
            raise ConfigError(f"server lr, weight_decay and grad_clip must be >= 0; got lr={self.lr}, "
                              f"weight_decay={self.weight_decay}, grad_clip={self.grad_clip}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"server momentum must be in [0, 1); got {self.momentum}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ConfigError("server nesterov needs optimizer 'sgd' with momentum > 0")


def default_loss(logits: torch.Tensor, targets: torch.Tensor, extra: Extra = None) -> torch.Tensor:
    """Per-sample cross-entropy: hard labels (integer) or soft probabilities (float, last dim = classes).

    Sequence outputs (B, T, V) give each sample the mean over its T positions, so
    sum / B is the usual token mean when all sequences have the same length.
    """
    b, v = logits.shape[0], logits.shape[-1]
    if targets.is_floating_point():
        per = -(targets * F.log_softmax(logits, dim=-1)).sum(-1)
    else:
        per = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1).long(), reduction="none")
    return per.reshape(b, -1).mean(1)


def server_batches(n: int, cfg: ServerTrainConfig, seed: int) -> Iterator[torch.Tensor]:
    """Index tensors (CPU, int64) of the fit's batches in order; see the module docstring."""
    per_pass = n // cfg.batch_size if cfg.drop_last else math.ceil(n / cfg.batch_size)
    if per_pass == 0:
        raise ConfigError(f"server training with drop_last has no full batch: {n} samples < batch_size "
                          f"{cfg.batch_size}; lower batch_size or turn drop_last off")
    total = cfg.steps or cfg.epochs * per_pass
    epoch = 0
    while total > 0:
        g = torch.Generator().manual_seed(derive_seed(seed, "server_batches", epoch))
        perm = torch.randperm(n, generator=g)
        for k in range(min(per_pass, total)):
            yield perm[k * cfg.batch_size: (k + 1) * cfg.batch_size]
        total -= per_pass
        epoch += 1


def micro_batch_bounds(batch: int, micro_batch: int) -> List[Tuple[int, int]]:
    """(start, stop) of each micro-batch of a batch of ``batch`` samples; see the module docstring.

    A function of the two sizes alone, so every rank cuts a batch the same way whatever the
    rank count. A trailing single sample (e.g. 13 = 4 + 4 + 4 + 1) joins the micro-batch before
    it (4 + 4 + 5): alone, it would stop a BatchNorm model in training mode ("Expected more than
    1 value per channel") on a batch that trains whole. The gradient is a sum over samples, so
    without BatchNorm the cut changes nothing but float rounding.
    """
    starts = list(range(0, batch, micro_batch))
    if micro_batch > 1 and len(starts) > 1 and batch - starts[-1] == 1:  # micro_batch=1 asked for ones
        starts.pop()
    return list(zip(starts, starts[1:] + [batch]))


def _take(t: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``idx`` of ``t`` (wherever it lives) on ``device``: only this rank's rows move."""
    if idx.device != t.device:
        idx = idx.to(t.device)
    return t.index_select(0, idx).to(device, non_blocking=True)


class ServerTrainer:
    """Trains ``model`` (whose weights live in ``flat``) on server data, data-parallel over ``world``.

    ``device`` is where the model lives and micro-batches are moved to; by default
    the device of ``flat``'s buffer. One trainer can serve many ``fit`` calls.
    """

    def __init__(self, world, model: nn.Module, flat: FlatModel, device: Optional[torch.device] = None):
        self.world, self.model, self.flat = world, model, flat
        self.device = torch.device(device) if device is not None else flat.flat.device

    def _integer_buffers(self):
        """(buffer, counts_steps) for every integer buffer; BatchNorm's step counter counts steps."""
        out = []
        for mod in self.model.modules():
            for name, b in mod.named_buffers(recurse=False):
                if not b.is_floating_point():
                    out.append((b, name == "num_batches_tracked" and
                                isinstance(mod, nn.modules.batchnorm._NormBase)))
        return out

    # ---------------------------------------------------------------- RNG
    def _generator(self) -> torch.Generator:
        """The generator dropout & co. draw from on the training device."""
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return torch.cuda.default_generators[index]
        return torch.default_generator

    # ---------------------------------------------------------------- checks
    @staticmethod
    def _check_data(x: torch.Tensor, targets: torch.Tensor, extra: Extra) -> int:
        n = int(x.shape[0])
        if n == 0:
            raise DataError("server training got an empty dataset (0 samples); gather the server's "
                            "samples before calling fit")
        extras = [] if extra is None else [extra] if isinstance(extra, torch.Tensor) else list(extra)
        for what, t in [("targets", targets)] + [(f"extra[{i}]", e) for i, e in enumerate(extras)]:
            if int(t.shape[0]) != n:
                raise DataError(f"server training {what} has {t.shape[0]} rows but x has {n}; "
                                f"pass tensors aligned sample by sample")
        return n

    # ---------------------------------------------------------------- training
    def fit(self, x: torch.Tensor, targets: torch.Tensor, cfg: ServerTrainConfig, seed: int,
            loss_fn: Optional[LossFn] = None, transform: Optional[BatchTransform] = None,
            extra: Extra = None) -> dict:
        """Train in place on (x, targets); every rank ends with the same weights.

        ``loss_fn(logits, targets_mb, extra_mb)`` returns per-sample losses (shape
        [mb]); default :func:`default_loss`. ``extra`` (a tensor or a sequence of
        tensors aligned with x, e.g. per-sample teacher outputs) is sliced per
        micro-batch like ``targets``. ``transform(x_mb, True, generator)`` turns
        stored inputs into model input on the device (default: uint8 -> [0, 1]).

        Returns ``{"loss": mean per-sample training loss over the fit, "samples":
        samples processed (all ranks together), "steps", "seconds"}``.
        """
        cfg.validate()
        n = self._check_data(x, targets, extra)
        loss_fn = loss_fn or default_loss
        transform = transform or default_transform
        world, model, flat, dev = self.world, self.model, self.flat, self.device
        P, N = flat.num_params, flat.numel
        has_buffers = N > P  # FlatModel lays out parameters first, then float buffers
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise ConfigError("server training got a model with no trainable parameters")

        # Gradients live in one flat buffer laid out like the parameters: backward adds
        # into its views in place, and the reduced gradient is one copy back.
        grad = torch.zeros(P, dtype=flat.flat.dtype, device=dev)
        views = flat.param_views(grad)
        saved_grads = [p.grad for p in params]
        grad_pairs = [(p, v) for p, v in zip(params, views) if p.requires_grad]
        for p, v in grad_pairs:
            p.grad = v
        # The step's one sum all-reduce: a reproducible sum of [0, P) the gradient, [P, N) the
        # buffer updates and N the loss, then the count of ranks that failed.
        if math.ceil(cfg.batch_size / cfg.micro_batch) > MAX_TERMS:
            raise ConfigError(f"server training: batch_size / micro_batch may be at most {MAX_TERMS} "
                              f"micro-batches per step; raise micro_batch")
        comm = torch.zeros(storage_numel(N + 1) + 1, dtype=torch.float64, device=dev)
        acc = ReproducibleSum(N + 1, math.ceil(cfg.batch_size / cfg.micro_batch), out=comm[:-1])
        loss_total = torch.zeros((), dtype=torch.float64, device=dev)
        buf_pre = flat.flat[P:].clone() if has_buffers else None
        int_buffers = self._integer_buffers()
        int_pre = [b.clone() for b, _ in int_buffers]
        aug = torch.Generator(device=dev)
        gen = self._generator()
        rng_state = gen.get_state()
        was_training = model.training
        opt = self._optimizer(trainable, cfg)
        mb_size, samples, step = cfg.micro_batch, 0, 0
        # A micro-batch that fails on this rank alone (the last batch of a pass may leave other
        # ranks without one) must not leave them in the all-reduce: this rank stops its work but
        # keeps joining the steps, a failure count rides along, and every rank raises together
        # at the end (World.raise_together), read with the loss in the fit's one device sync.
        failure: Optional[Exception] = None
        failures = torch.zeros((), dtype=torch.float64, device=dev)

        def run_my_micro_batches(step: int, idx: torch.Tensor, bounds: List[Tuple[int, int]]) -> None:
            """This rank's micro-batches of one batch: gradients, buffer updates and losses into acc."""
            for j in range(world.rank, len(bounds), world.size):
                mb = idx[bounds[j][0]: bounds[j][1]]
                if has_buffers:  # every micro-batch starts from the pre-step statistics
                    flat.flat[P:].copy_(buf_pre)
                for pre, (b, _) in zip(int_pre, int_buffers):
                    b.copy_(pre)
                gen.manual_seed(derive_seed(seed, "server_micro", step, j))
                aug.manual_seed(derive_seed(seed, "server_augment", step, j))
                xb = transform(_take(x, mb, dev), True, aug)
                eb = self._slice_extra(extra, mb)
                losses = loss_fn(model(xb), _take(targets, mb, dev), eb)
                if losses.shape != (mb.numel(),):
                    raise ConfigError(f"server loss_fn must return per-sample losses of shape "
                                      f"[{mb.numel()}]; got {tuple(losses.shape)} (do not reduce "
                                      f"with mean or sum: the trainer sums and divides by the batch size)")
                grad.zero_()
                losses.sum().backward()
                for p, v in grad_pairs:
                    if p.grad is not v:  # a backward that replaced .grad instead of adding to it
                        v.copy_(p.grad)
                        p.grad = v
                acc.add_(grad)
                if has_buffers:  # the difference of two float32 numbers is exact in float64
                    acc.add_(flat.flat[P:].double() - buf_pre.double(), start=P)
                acc.add_(losses.detach().sum(), start=N)

        start = time.perf_counter()
        try:
            model.train()
            for step, idx in enumerate(server_batches(n, cfg, seed)):
                B = int(idx.numel())
                bounds = micro_batch_bounds(B, mb_size)  # the same on every rank
                n_micro = len(bounds)
                acc.zero_()  # the bins are comm[:-1]
                comm[-1] = 0.0
                if has_buffers:
                    buf_pre.copy_(flat.flat[P:])
                for pre, (b, _) in zip(int_pre, int_buffers):
                    pre.copy_(b)
                if failure is None:
                    try:
                        run_my_micro_batches(step, idx, bounds)
                    except Exception as e:
                        failure = e
                if failure is not None:
                    comm[-1] = 1.0
                acc.align_(world)
                world.all_reduce_sum_(comm)
                failures += comm[-1]
                total = acc.sum()
                total[:P].div_(B)
                if cfg.grad_clip > 0:
                    total[:P].mul_((cfg.grad_clip / (total[:P].norm() + 1e-6)).clamp_(max=1.0))
                grad.copy_(total[:P])
                opt.step()
                if has_buffers:
                    flat.flat[P:].copy_(buf_pre + total[P:N] / n_micro)
                for pre, (b, counts_steps) in zip(int_pre, int_buffers):
                    b.copy_(pre + 1 if counts_steps else pre)
                loss_total += total[N]
                samples += B
            loss_sum, failed = torch.stack([loss_total, failures]).tolist()  # one device sync, at the end
            if failed > 0:
                world.raise_together(failure, "server training")
            mean_loss = loss_sum / samples
        finally:
            gen.set_state(rng_state)
            model.train(was_training)
            for p, g in zip(params, saved_grads):
                p.grad = g
        if not math.isfinite(mean_loss):
            raise NonFiniteLossError(f"server training loss became {mean_loss} within {step + 1} steps "
                                     f"(lr {cfg.lr}); lower the server lr or set grad_clip")
        return {"loss": mean_loss, "samples": samples, "steps": step + 1,
                "seconds": time.perf_counter() - start}

    def _slice_extra(self, extra: Extra, mb: torch.Tensor):
        if extra is None:
            return None
        if isinstance(extra, torch.Tensor):
            return _take(extra, mb, self.device)
        return tuple(_take(e, mb, self.device) for e in extra)

    @staticmethod
    def _optimizer(params, cfg: ServerTrainConfig) -> torch.optim.Optimizer:
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                    weight_decay=cfg.weight_decay)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
