"""The launcher's command line: flags for every RunConfig field and for the chosen algorithm's options."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import fields
from typing import List, Optional, Type, get_type_hints

from ..errors import ConfigError
from .layers import (algorithm_of_file, channel_options_for_no_channel, options_for_replaced_algorithm,
                     reference_for_flags, unknown_flags_message, unknown_settings_message)
from .run import RunConfig
from .values import build_options, coerce_value, flag_for, load_yaml, parse_key_values


def _add_dataclass_flags(group, cls: Type, skip=()) -> List[str]:
    hints = get_type_hints(cls)
    added = []
    for f in fields(cls):
        if f.name in skip or f.name.isupper():
            continue
        typ = hints[f.name]
        if typ not in (int, float, str, bool):
            continue
        helptext = f.metadata.get("help", "") if f.metadata else ""
        default = f.default if f.default is not dataclasses.MISSING else None
        if typ is bool:
            group.add_argument(flag_for(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{helptext} (default: {default})")
        else:
            group.add_argument(flag_for(f.name), dest=f.name, type=typ, default=argparse.SUPPRESS,
                               metavar=typ.__name__.upper(), help=f"{helptext} (default: {default})")
        added.append(f.name)
    return added


def _catalogue() -> str:
    from ..algorithms import ALGORITHMS, load_algorithm_modules
    from ..data import DATASETS, load_dataset_modules
    from ..data.partition import partition_help
    from ..models import MODELS, load_model_modules

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    lines = ["algorithms:"]
    for n in ALGORITHMS.names():
        doc = (ALGORITHMS.get(n).__doc__ or "").strip().splitlines()
        lines.append(f"  {n:14s} {doc[0] if doc else ''}")
    for alias, name in sorted(ALGORITHMS.aliases().items()):
        lines.append(f"  {alias:14s} = {name}")
    lines.append("datasets:")
    for n in DATASETS.names():
        lines.append(f"  {n:14s} {DATASETS.get(n).help}")
    lines.append("models: " + ", ".join(MODELS.names()))
    lines.append("partitions: " + partition_help())
    lines.append("Algorithm options are flags once --algo is given (try --algo fedprox --help).")
    return "\n".join(lines)


def launcher_rank() -> int:
    """This process's rank as the launcher's environment says, before any World exists."""
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def parse_args(argv: Optional[List[str]] = None):
    """Parse ``argv`` into (RunConfig, algorithm options, data options). Raises ConfigError."""
    from ..algorithms import ALGORITHMS, load_algorithm_modules
    from ..data import DATASETS, load_dataset_modules
    from ..data.partition import check_partition
    from ..models import MODELS, check_model_options, load_model_modules
    from ..server.channel import ChannelOptions

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--algo")
    pre.add_argument("--dataset")
    pre.add_argument("--model")
    pre.add_argument("--channel")
    known, _ = pre.parse_known_args(argv)
    file_values = load_yaml(known.config) if known.config else {}

    for key in ("algo", "dataset", "model"):
        # YAML reads `algo: null`, `algo: 5`, `algo: [fedavg]` as non-strings, which no registry can look up
        if key in file_values and not isinstance(file_values[key], str):
            raise ConfigError(f"config file {known.config!r}: {key} must be a name (a string), got "
                              f"{file_values[key]!r}; write e.g. `{key}: {getattr(RunConfig, key)}` "
                              f"(python -m fedhpc.launch --help lists the names)")

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    algo_name = known.algo or file_values.get("algo", RunConfig.algo)
    data_name = known.dataset or file_values.get("dataset", RunConfig.dataset)
    valid_keys = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(file_values) - valid_keys, key=str)
    if unknown:
        raise ConfigError(unknown_settings_message(known.config, unknown, file_values, algo_name, data_name,
                                                   known.model or file_values.get("model")))
    algo_cls = ALGORITHMS.get(algo_name)
    data_spec = DATASETS.get(data_name)
    file_written = file_values
    file_values, said = options_for_replaced_algorithm(file_values, known.algo, algo_cls)
    file_values, said_channel = channel_options_for_no_channel(file_values, known.channel)
    said += said_channel
    # The run holds the registry's spelling ('Fedprox' -> 'fedprox', the alias 'fl' -> 'fedavg'): its
    # identity, which --resume compares, and the names reports group by must not depend on the typing.
    algo_name, data_name = ALGORITHMS.canonical(algo_name), DATASETS.canonical(data_name)

    parser = argparse.ArgumentParser(
        prog="python -m fedhpc.launch",
        description="Simulate federated learning over MPI / torchrun / srun ranks.",
        epilog=_catalogue(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of settings (flags override it)")
    _add_dataclass_flags(parser.add_argument_group("run"), RunConfig)
    parser.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="dataset option (repeatable)")
    parser.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model option (repeatable)")
    parser.add_argument("--channel-opt", action="append", metavar="KEY=VALUE",
                        help="channel parameter, e.g. p_up_dbm=30 (repeatable; see fedhpc/server/channel.py)")
    algo_flags = []
    if algo_cls.Options is not None:
        algo_flags = _add_dataclass_flags(parser.add_argument_group(f"{algo_name} options"), algo_cls.Options)
    parsed, extra = parser.parse_known_args(argv)
    if extra:
        raise ConfigError(unknown_flags_message(extra, algo_name, list(parser._option_string_actions)))
    args = vars(parsed)

    values = dict(file_values)
    for k in valid_keys:
        if k in args:
            values[k] = args[k]
    values["algo"], values["dataset"] = algo_name, data_name
    for k in ("algo_options", "data_options", "model_options", "channel_options", "reference"):
        v = values.get(k) or {}
        if not isinstance(v, dict):
            raise ConfigError(f"{k} must be a mapping of option: value, got {v!r}")
        values[k] = dict(v)
    values["algo_options"].update({k: args[k] for k in algo_flags if k in args})
    values["data_options"].update(parse_key_values(args.get("data_opt"), "--data-opt"))
    values["model_options"].update(parse_key_values(args.get("model_opt"), "--model-opt"))
    values["channel_options"].update(parse_key_values(args.get("channel_opt"), "--channel-opt"))

    hints = get_type_hints(RunConfig)
    cfg = RunConfig(**{k: (coerce_value(v, hints[k], flag_for(k)) if hints[k] in (int, float, str, bool) else v)
                       for k, v in values.items()})
    cfg.validate()
    # What can be refused without the data is refused here, before a dataset is loaded (a sweep
    # validates its points through this function); what needs the labels is checked when built.
    check_partition(cfg.partition)
    if cfg.model.strip().lower() == "auto":
        cfg.model = "auto"
    else:
        MODELS.get(cfg.model)
        cfg.model = MODELS.canonical(cfg.model)
        check_model_options(cfg.model, cfg.model_options)
    algo_opts = build_options(algo_cls.Options, cfg.algo_options, f"algorithm {algo_name!r}")
    data_opts = build_options(data_spec.options, cfg.data_options, f"dataset {data_name!r}")
    if cfg.channel != "none":  # the engine builds them again; checked here so a sweep's bad point stops before any runs
        build_options(ChannelOptions, cfg.channel_options, f"channel {cfg.channel!r}")
    # The file's reference is the paper's number for the file's setting: flags that change it
    # (--algo, --partition, --channel, an option...; not --seed, nor --rounds but for pMixFed) drop it, said once.
    said += reference_for_flags(file_written, cfg)
    if said and launcher_rank() == 0:
        if known.algo and algorithm_of_file(file_written) != algo_name:
            head = f"--algo {algo_name} replaces the file's algo {algorithm_of_file(file_written)}"
        else:
            head = f"the command line changes settings of {known.config}"
        print(f"note: {head}; {'; '.join(said)}", file=sys.stderr, flush=True)
    return cfg, algo_opts, data_opts
