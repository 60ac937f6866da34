"""Who may train clients at once: a method's opt-in (and the overrides that void it), then the
run's model, optimiser and task (:func:`check_batchable`, whose refusals name the fix)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from ..errors import ConfigError
from ..models import model_option_params
from .kernels import CLIENT_DROPOUTS, GROUPED_MODULES, GROUPED_NORMS

if TYPE_CHECKING:  # pragma: no cover
    from ..algorithms.base import Algorithm


#: hooks whose override changes the local update: an override must come with its own opt-in
#: (train_epochs / joint_update / personal_phase / personal_step: the personalised family's local
#: update, fedhpc.algorithms.personal; meta_gradient / sgd_step: Per-FedAvg's meta-step;
#: batched_local_update: the batched path's own)
LOCAL_UPDATE_HOOKS = ("loss", "local_update", "make_optimizer", "mix_loss", "train_epochs", "joint_update",
                      "personal_phase", "personal_step", "meta_gradient", "sgd_step", "batched_local_update")


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
