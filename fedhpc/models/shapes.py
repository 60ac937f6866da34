"""Shape arithmetic the image models share: they compute their flatten sizes from the input shape."""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ConfigError


def image_shape(input_shape) -> Tuple[int, int, int]:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3:
        raise ConfigError(f"image models need input_shape (C, H, W); got {tuple(input_shape)}, which is no image "
                          f"(e.g. a sequence of character ids): use a model made for this data (--model auto "
                          f"takes the dataset's default)")
    if min(shape) < 1:
        raise ConfigError(f"image models need input_shape (C, H, W) with positive sizes; got {tuple(input_shape)}")
    return shape  # type: ignore[return-value]


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def pool_out(size: int, kernel: int = 2, stride: Optional[int] = None, padding: int = 0) -> int:
    stride = kernel if stride is None else stride
    return (size + 2 * padding - kernel) // stride + 1


def require_positive(name: str, size: int, input_shape) -> None:
    if size < 1:
        raise ConfigError(f"input_shape {tuple(input_shape)} is too small: {name} would be empty; use a model made "
                          f"for small inputs (--model mlp; --model cnn for images of 2x2 or more) or larger inputs "
                          f"(e.g. --data-opt shape=1x28x28 for the synthetic dataset)")


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def check_single_sample_batches(model: nn.Module, model_name: str, sizes: Sequence[int], batch_size: int,
                                first_sample: Callable[[int], torch.Tensor],
                                forward: Callable[[nn.Module, torch.Tensor], object]) -> None:
    """Refuse, before any round, a run in which a client's last batch (every batch at --batch-size 1)
    holds one sample and the model's BatchNorm then sees one value per channel (a 1x1 feature
    map: ResNet-18 on 32x32, MobileNet on 8x8). torch raises for that in training mode, so the
    run would stop in the first round that samples the client, after hours.

    ``sizes``: (client id, training samples) of the clients that train; ``first_sample(cid)``:
    that client's first input, as training sees it (batch of 1); ``forward(model, x)``: every
    forward local training runs (the algorithm's :meth:`probe_forward`).
    """
    if not has_batchnorm(model):
        return
    # at --batch-size 1 every batch holds one sample (n % 1 is 0 for every n)
    lone = [(cid, n) for cid, n in sizes if batch_size == 1 or n % batch_size == 1]
    if not lone:
        return
    cid, n = lone[0]
    probe = copy.deepcopy(model).train()  # BatchNorm statistics and the RNG stay as they are
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            forward(probe, first_sample(cid))
        except ValueError as e:
            if "Expected more than 1 value per channel" not in str(e):
                raise
            counts = [c for _, c in sizes]
            ok = next((b for b in range(batch_size + 1, max(2 * batch_size, 32) + 1)
                       if all(c % b != 1 for c in counts)), None)
            hint = f" (e.g. --batch-size {ok})" if ok else ""
            raise ConfigError(
                f"client {cid} has {n} training samples, so {'every' if batch_size == 1 else 'its last'} batch of "
                f"--batch-size {batch_size} holds one sample, and model {model_name!r} reaches a BatchNorm with a "
                f"1x1 feature map: one value per channel, which BatchNorm cannot train on ({len(lone)} client(s) "
                f"have such a batch). Use a --batch-size that leaves no client a single-sample batch{hint}, a model "
                f"made for inputs of this size, or one without BatchNorm") from None


def check_model_takes_inputs(model: nn.Module, model_name: str, data, device) -> None:
    """Refuse, before any round, inputs the model cannot take, with one forward each (evaluation
    mode, on one copy of the model, the RNG untouched):

    * one training input (``data.model_input_sample``): a text model (ids into an embedding)
      given images, an image model given character ids, ids beyond a model's vocabulary. torch
      would raise in the first round's first batch with an error about tensors that names
      neither the model nor the dataset;
    * where the data options crop training and evaluation batches differently (``resized_crop=224``
      with ``center_crop=0`` on 256-px images: 224-px training crops, whole 256-px test images),
      a zero input of the evaluation shape. A model that pools adaptively takes both (FixRes-style
      testing at a larger size is deliberate); one that flattens a fixed size would fail at the
      first evaluation, after a round of training.
    """
    sample = data.model_input_sample(train=True)
    train_shape, eval_shape = data.model_input_shape(train=True), data.model_input_shape(train=False)
    if sample is None and train_shape == eval_shape:
        return
    probe = copy.deepcopy(model).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if sample is not None:
            try:
                probe(sample.to(device))
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                kind = ("integer ids" if not sample.is_floating_point()
                        else f"{str(sample.dtype).replace('torch.', '')} values")
                raise ConfigError(
                    f"model {model_name!r} cannot take the {data.name} inputs ({kind} of shape "
                    f"{'x'.join(map(str, sample.shape[1:]))}): {type(e).__name__}: {_first_line(e)}. Use a model "
                    f"made for them: the {data.name} default is {data.default_model()!r} (--model auto)") from None
        if train_shape == eval_shape:
            return
        dtype = next((p.dtype for p in probe.parameters() if p.is_floating_point()), torch.float32)
        try:
            probe(torch.zeros((1,) + tuple(eval_shape), dtype=dtype, device=device))
        except (RuntimeError, ValueError) as e:
            raise ConfigError(
                f"model {model_name!r} is built for the training inputs, {'x'.join(map(str, train_shape))}, and "
                f"cannot take the evaluation inputs, {'x'.join(map(str, eval_shape))} ({type(e).__name__}: "
                f"{_first_line(e)}): the data options crop training and evaluation "
                f"batches to different sizes. Make them agree (e.g. --data-opt center_crop={train_shape[-1]} "
                f"with resized_crop={train_shape[-1]}) or use a model that pools adaptively") from None


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else ""
