"""What a run leaves to ``auto`` or to its defaults becomes on its dataset and for its method.

A bare ``python -m fedhpc.launch --algo X`` must run, and quickly, on the embedded data: the
papers' settings (ResNet-56, a server base set of 200 images per label, K_s = 3,200 server
steps...) live in the launch files, which set them explicitly, and a run that does not set them
gets the dataset's and the method's own:

* ``--model auto``: the dataset's default model (``DatasetSpec.models["default"]``: digits'
  ``cnn``), or, for a method that needs another kind of network (``Algorithm.auto_model_kind``:
  the FedAlign family's ``"residual"``), the dataset's model of that kind (digits'
  ``resnet_digits``, mnist5k's ``resnet_mnist``), with the options the method needs and the run did not give
  (``Algorithm.auto_model_options``: MOON's projection head);
* run settings the dataset sets for itself (``DatasetSpec.settings``: digits' lr and epochs) where
  neither the file nor the flags set them;
* run settings a method sets for itself (``Algorithm.auto_settings``: the one-shot methods' single
  round) where neither the file nor the flags set them;
* data options a method needs (``Algorithm.auto_data_options``: the one-shot methods' server base
  set) where the run gave none of them;
* algorithm options a method resolves for the run (``Algorithm.auto_options``: FLD's K_s scaled
  to the server's sample set; FedAlign's rescaled loss, written out so that a checkpoint that
  does not name it keeps the printed form it ran) where the run did not set them.

Everything resolved here is written into the run's settings (``config.yaml``, the checkpoint's
identity, the report's grouping hold the value that ran, not ``auto``), so a resume or a report
compares values, and a run made before a default changed is refused by name rather than resumed
under the new one. What was chosen is said in one line at the start of the run
(:func:`auto_line`, printed by the engine) and kept on the configuration
(:attr:`RunConfig.auto_resolved`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def _flat(options: Dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


def apply_auto(cfg, algo_cls, data_spec, given: Dict[str, Any]) -> List[str]:
    """Resolve in ``cfg`` (a RunConfig before validation) what it leaves to ``auto`` or to defaults
    for its dataset (``data_spec``, a :class:`fedhpc.data.DatasetSpec`) and method (``algo_cls``);
    ``given``: the settings its file and flags set (RunConfig field -> value). Returns what was
    resolved, one phrase each, for :func:`auto_line`."""
    said: List[str] = []
    # run settings the dataset (digits: a larger lr and two epochs) and the method (the one-shot
    # methods: one round) set for themselves, where the run sets none
    own = [(key, value, f"the {cfg.dataset} default") for key, value in data_spec.settings.items()]
    own += [(key, value, why) for key, (value, why) in dict(getattr(algo_cls, "auto_settings", {}) or {}).items()]
    for key, value, why in own:
        if key not in given and getattr(cfg, key) != value:
            setattr(cfg, key, value)
            said.append(f"{key} {value} ({why})")
    # the model a method needs, where the dataset has one of that kind
    kind = getattr(algo_cls, "auto_model_kind", "")
    if cfg.model == "auto" and kind and data_spec.models.get(kind):
        from ..models import model_option_params

        cfg.model = data_spec.models[kind]
        params = model_option_params(cfg.model)
        added = {k: v for k, v in dict(getattr(algo_cls, "auto_model_options", {}) or {}).items()
                 if k in params and k not in cfg.model_options}
        cfg.model_options = {**cfg.model_options, **added}
        default = data_spec.models.get("default")
        instead = f" instead of the {cfg.dataset} default {default}" if default else ""
        said.append(f"model {cfg.model} ({cfg.algo} needs a {kind} network{instead}"
                    + (f"; {_flat(added)}" if added else "") + ")")
    # data options a method needs, when the run set none of them
    wanted = dict(getattr(algo_cls, "auto_data_options", {}) or {})
    if wanted and not any(k in cfg.data_options for k in wanted):
        cfg.data_options = {**cfg.data_options, **wanted}
        said.append(f"{_flat(wanted)} ({getattr(algo_cls, 'auto_data_options_why', 'what ' + cfg.algo + ' needs')})")
    # options whose default depends on the run (FLD: server steps scaled to the server's samples)
    resolve = getattr(algo_cls, "auto_options", None)
    if resolve is not None and algo_cls.Options is not None:
        from ..errors import ConfigError
        from .values import build_options

        try:  # the options as given, defaults filled in; a bad one is refused by the launcher next
            given_options = build_options(algo_cls.Options, cfg.algo_options, f"algorithm {cfg.algo!r}")
        except ConfigError:
            return said
        for key, (value, why) in resolve(cfg, given_options).items():
            if key not in cfg.algo_options:
                cfg.algo_options = {**cfg.algo_options, key: value}
                said.append(f"{key} {value} ({why})")
    return said


def auto_line(cfg, model_name: str, data) -> Optional[str]:
    """The line that says, at the start of a run, what ``auto`` and the dataset's and method's
    defaults resolved to (None when the run left nothing to them)."""
    from ..data import DATASETS

    parts = []
    if cfg.model == "auto":
        parts.append(f"model {model_name} (the {data.name} default)")
    if str(cfg.partition).strip().lower() in ("", "auto", "default"):
        spec = DATASETS.get(cfg.dataset) if cfg.dataset in DATASETS else None
        dealt = spec.auto_partition if spec is not None and spec.auto_partition else "the dataset's own"
        parts.append(f"partition {dealt}")
    parts += list(getattr(cfg, "auto_resolved", ()) or ())
    return ("auto: " + "; ".join(parts)) if parts else None
