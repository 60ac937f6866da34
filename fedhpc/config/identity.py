"""What makes two runs the same run: settings spelled differently but meaning the same compare
equal. A resume compares the checkpoint's identity with today's (:mod:`fedhpc.checkpoint`), and
a launch file's layers name what they change (:mod:`fedhpc.config.layers`), both through here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, Optional


def canonical_identity(identity: Dict[str, Any], auto_means: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``identity`` as today's code reads it, so that settings spelled differently but meaning
    the same run compare equal:

    * the algorithm, dataset and model named as their registries spell them (runs started before
      the launcher stored canonical names hold what was typed: 'Fedprox', the alias 'fl');
    * the option mappings resolved to every option's value, defaults included: ``{}`` and an
      option written out at its default (``finetune_epochs: 4``) are the same run, as ``lr: 1e-3``
      and ``lr: 0.001`` already are. A mapping today's code cannot read (an option since
      removed) is compared as written. A default whose change alters a running method is the
      method's to guard in its checkpointed state (pMixFed's ``first_layer_index``; a resume then
      leaves it out of the comparison: :func:`fedhpc.checkpoint._without_options_checked_by_state`);
    * the partition as :func:`~fedhpc.data.partition.canonical_partition` spells it
      ('dirichlet:.50' is 'dirichlet:0.5');
    * a setting left at 'auto' as what it stands for in this run (``auto_means``: the model
      'auto' is the dataset's default), so that naming that default resumes an 'auto' run and
      the other way round. The dataset is part of the identity, so both sides mean the same.
    """
    from ..data import DATASETS, load_dataset_modules
    from ..data.partition import canonical_partition
    from ..models import MODELS, load_model_modules, model_option_params
    from ..registry import ALGORITHMS, load_algorithm_modules
    from ..server.channel import ChannelOptions
    from .values import build_options

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    out = dict(identity)
    for key, meaning in (auto_means or {}).items():
        if isinstance(out.get(key), str) and out[key].strip().lower() == "auto":
            out[key] = meaning
    if isinstance(out.get("partition"), str):
        out["partition"] = canonical_partition(out["partition"])
    for key, registry in (("algo", ALGORITHMS), ("dataset", DATASETS), ("model", MODELS)):
        if isinstance(out.get(key), str) and out[key] in registry:
            out[key] = registry.canonical(out[key])

    def resolved(key: str, make: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
        values = out.get(key)
        if isinstance(values, dict):
            try:
                out[key] = json.loads(json.dumps(make(values), default=str))
            except Exception:  # noqa: BLE001 - not readable today: compared as written
                pass

    def from_dataclass(cls):
        return lambda values: dataclasses.asdict(build_options(cls, values, "a checkpoint's settings"))

    if out.get("algo") in ALGORITHMS and ALGORITHMS.get(out["algo"]).Options is not None:
        resolved("algo_options", from_dataclass(ALGORITHMS.get(out["algo"]).Options))
    if out.get("dataset") in DATASETS and DATASETS.get(out["dataset"]).options is not None:
        resolved("data_options", from_dataclass(DATASETS.get(out["dataset"]).options))
    resolved("channel_options", from_dataclass(ChannelOptions))
    if out.get("model") in MODELS:
        params = model_option_params(out["model"])

        def model_options(values):
            if set(values) - set(params):
                raise KeyError("unknown model option")
            return {**{k: p.default for k, p in params.items()}, **values}
        resolved("model_options", model_options)
    return out


#: the run's checkpoint identity, written by the engine into --out at the start of every attempt
#: (after a resume's checkpoint check passed): config.yaml holds the RunConfig fields only, not what
#: the identity adds to them (``partition_rules``), which the sweep must compare for a finished run
