"""The launcher's command line: flags for every RunConfig field and for the chosen algorithm's options."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
from dataclasses import fields
from typing import Any, Callable, Dict, List, Optional, Type, get_type_hints

from ..errors import ConfigError
from .auto import apply_auto
from .layers import (algorithm_of_file, channel_options_for_no_channel, options_for_replaced_algorithm,
                     reference_for_flags, unknown_flags_message, unknown_settings_message)
from .run import RunConfig
from .values import build_options, coerce_value, flag_for, load_yaml, parse_key_values


def _add_dataclass_flags(group, cls: Type, skip=(), per_dataset: Optional[Dict[str, str]] = None) -> List[str]:
    """Add a flag per simple field of ``cls``; the help ends with the default: a field whose
    metadata says ``auto`` is resolved per run (fedhpc.config.auto) and says how, and
    ``per_dataset`` (field -> "digits: 0.1") names the datasets that set a field of their own."""
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
        said = f"default: {default}"
        if f.metadata and f.metadata.get("auto"):
            said = f"default: {f.metadata['auto']}; {default} where options are built without the launcher"
        if per_dataset and f.name in per_dataset:
            said += f"; {per_dataset[f.name]}"
        said = said.replace("%", "%%")  # argparse formats help with %
        if typ is bool:
            group.add_argument(flag_for(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{helptext} ({said})")
        else:
            group.add_argument(flag_for(f.name), dest=f.name, type=_typed(typ, flag_for(f.name), default),
                               default=argparse.SUPPRESS,
                               metavar=typ.__name__.upper(), help=f"{helptext} ({said})")
        added.append(f.name)
    return added


def _dataset_settings_help() -> Dict[str, str]:
    """RunConfig field -> the datasets that set their own value of it ("digits: 0.1"), for --help."""
    from ..data import DATASETS, load_dataset_modules

    load_dataset_modules()
    out: Dict[str, List[str]] = {}
    for name in DATASETS.names():
        for key, value in DATASETS.get(name).settings.items():
            out.setdefault(key, []).append(f"{name}: {value}")
    return {k: "on " + ", ".join(v) + " unless set" for k, v in out.items()}


def _catalogue() -> str:
    from ..registry import ALGORITHMS, load_algorithm_modules
    from ..data import DATASETS, load_dataset_modules
    from ..data.partition import partition_help
    from ..models import MODELS, load_model_modules

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    from ..batched import method_refusal

    lines = ["algorithms (* also trains clients at once: --clients-at-once):"]
    for n in ALGORITHMS.names():
        cls = ALGORITHMS.get(n)
        doc = (cls.__doc__ or "").strip().splitlines()
        star = " " if method_refusal(cls, n) else "*"
        lines.append(f" {star}{n:14s} {doc[0] if doc else ''}")
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


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors: one line naming the problem and the fix, exit 2 through
    the launcher, instead of the whole usage (30 lines) before argparse's own message."""

    def error(self, message):
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        if m:
            message = f"{m.group(1)} {m.group(2)}"
        raise ConfigError(f"{message}; python -m fedhpc.launch --help lists the flags")


def _coerce(value: Any, typ: type, flag: str, example: Any) -> Any:
    """:func:`~fedhpc.config.values.coerce_value`, its error completed with the fix (a value of the
    right type: ``example``, the setting's default): the flags and a YAML file's keys say the same."""
    try:
        return coerce_value(value, typ, flag)
    except ConfigError as e:
        what = {int: "a whole number", float: "a number"}.get(typ)
        if what is None or isinstance(example, bool) or not isinstance(example, (int, float)):
            raise
        raise ConfigError(f"{e}; give {what}, e.g. {flag} {example}") from None


def _typed(typ: type, flag: str, example: Any):
    """argparse's ``type=`` for a flag of type ``typ``: the value converted as a YAML file's is, so
    both name a wrong type in the same words (a ConfigError, which argparse lets through)."""
    def convert(text: str):
        return _coerce(text, typ, flag, example)
    convert.__name__ = typ.__name__
    return convert


def _version() -> str:
    from .. import __version__

    return f"fedhpc {__version__}"


def _chosen(file_values: Dict[str, Any], where: Optional[str], algo: Any, dataset: Any, model: Any):
    """(algorithm class, algorithm name, dataset spec, dataset name) a run of these settings uses, the
    names as given (the registries' spelling comes later); a ConfigError for an unknown key of the
    file (``where``: its path) or an unknown or malformed name."""
    from ..registry import ALGORITHMS, load_algorithm_modules
    from ..data import DATASETS, load_dataset_modules
    from ..models import load_model_modules

    for key in ("algo", "dataset", "model"):
        # YAML reads `algo: null`, `algo: 5`, `algo: [fedavg]` as non-strings, which no registry can look up
        if key in file_values and not isinstance(file_values[key], str):
            raise ConfigError(f"config file {where!r}: {key} must be a name (a string), got "
                              f"{file_values[key]!r}; write e.g. `{key}: {getattr(RunConfig, key)}` "
                              f"(python -m fedhpc.launch --help lists the names)")
    for key, value in (("algo", algo), ("dataset", dataset), ("model", model)):
        if value is not None and not isinstance(value, str):  # fedhpc.run(algo=5): the flags are strings
            raise ConfigError(f"{key} must be a name (a string), got {value!r}; e.g. {key}="
                              f"{getattr(RunConfig, key)!r} (python -m fedhpc.launch --help lists the names)")

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    algo_name = algo or file_values.get("algo", RunConfig.algo)
    data_name = dataset or file_values.get("dataset", RunConfig.dataset)
    valid_keys = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(file_values) - valid_keys, key=str)
    if unknown:
        raise ConfigError(unknown_settings_message(where, unknown, file_values, algo_name, data_name,
                                                   model or file_values.get("model")))
    return ALGORITHMS.get(algo_name), algo_name, DATASETS.get(data_name), data_name


def _parser(algo_cls, algo_name: str):
    """The launcher's full parser (every RunConfig flag, ``algo_name``'s options); and those options' names."""
    parser = _Parser(
        prog="python -m fedhpc.launch",
        description="Simulate federated learning over MPI / torchrun / srun ranks.",
        epilog=_catalogue(), formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--config", help="YAML file of settings (flags override it)")
    _add_dataclass_flags(parser.add_argument_group("run"), RunConfig, per_dataset=_dataset_settings_help())
    parser.add_argument("--no-out", action="store_true", default=argparse.SUPPRESS,
                        help="write nothing (the same as --out none); without --out a run writes to "
                             "runs/<algo>_<dataset>_<time>")
    parser.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="dataset option (repeatable)")
    parser.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model option (repeatable)")
    parser.add_argument("--channel-opt", action="append", metavar="KEY=VALUE",
                        help="channel parameter, e.g. p_up_dbm=30 (repeatable; see fedhpc/server/channel.py)")
    algo_flags = []
    if algo_cls.Options is not None:
        algo_flags = _add_dataclass_flags(parser.add_argument_group(f"{algo_name} options"), algo_cls.Options)
    return parser, algo_flags


#: what ``--out`` / ``out:`` takes to write nothing (an empty value says the same)
NO_OUTPUT = "none"


def parse_args(argv: Optional[List[str]] = None, default_out: Optional[Callable[[RunConfig], str]] = None):
    """Parse ``argv`` into (RunConfig, algorithm options, data options). Raises ConfigError.

    ``default_out(cfg)``: the output folder of a run that names none (no ``--out``, no ``out:`` in its
    file, and not ``--no-out`` / ``--out none``); the launcher's command line passes one, so a run
    saves its results unless told not to. Without it such a run writes nothing (sweeps, tests)."""
    from ..registry import ALGORITHMS

    pre = _Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--version", action="version", version=_version())
    pre.add_argument("--config")
    pre.add_argument("--algo")
    pre.add_argument("--dataset")
    pre.add_argument("--model")
    known, _ = pre.parse_known_args(argv)
    file_values = load_yaml(known.config) if known.config else {}
    algo_cls, algo_name, _, _ = _chosen(file_values, known.config, known.algo, known.dataset, known.model)
    parser, algo_flags = _parser(algo_cls, ALGORITHMS.canonical(algo_name))
    parsed, extra = parser.parse_known_args(argv)
    if extra:
        raise ConfigError(unknown_flags_message(extra, ALGORITHMS.canonical(algo_name),
                                                list(parser._option_string_actions)))
    args = vars(parsed)
    valid_keys = {f.name for f in fields(RunConfig)}
    given = {k: args[k] for k in valid_keys if k in args}
    if args.get("no_out"):
        if given.get("out", "").strip().lower() not in ("", NO_OUTPUT):
            raise ConfigError(f"--no-out writes nothing but --out {given['out']} names a folder; keep one of them")
        given["out"] = NO_OUTPUT
    updates = {"data_options": parse_key_values(args.get("data_opt"), "--data-opt"),
               "model_options": parse_key_values(args.get("model_opt"), "--model-opt"),
               "channel_options": parse_key_values(args.get("channel_opt"), "--channel-opt")}
    return resolve(file_values, known.config, given, {k: args[k] for k in algo_flags if k in args}, updates,
                   default_out=default_out)


def resolve(file_values: Dict[str, Any], where: Optional[str], given: Dict[str, Any],
            algo_given: Optional[Dict[str, Any]] = None, updates: Optional[Dict[str, Dict[str, Any]]] = None,
            default_out: Optional[Callable[[RunConfig], str]] = None):
    """(RunConfig, algorithm options, data options) of a config file's settings (``file_values``, read
    from ``where``) overridden by ``given`` (RunConfig fields, as flags give them), ``algo_given`` (the
    algorithm's options, as its flags give them) and ``updates`` (option mappings whose keys replace the
    file's, as --data-opt k=v does). The launcher's flags and :func:`fedhpc.run`'s keywords both come
    here, so they mean the same and are validated alike. Raises ConfigError."""
    from ..registry import ALGORITHMS
    from ..data import DATASETS
    from ..data.partition import check_partition
    from ..models import MODELS, check_model_options
    from ..server.channel import ChannelOptions

    algo_given, updates = dict(algo_given or {}), dict(updates or {})
    flag_algo, flag_channel = given.get("algo"), given.get("channel")
    if flag_channel is not None and not isinstance(flag_channel, str):
        raise ConfigError(f"channel must be a name (a string), got {flag_channel!r}; e.g. channel='none'")
    algo_cls, algo_name, data_spec, data_name = _chosen(file_values, where, flag_algo, given.get("dataset"),
                                                        given.get("model"))
    file_written = file_values
    file_values, said = options_for_replaced_algorithm(file_values, flag_algo, algo_cls)
    file_values, said_channel = channel_options_for_no_channel(file_values, flag_channel)
    said += said_channel
    # The run holds the registry's spelling ('Fedprox' -> 'fedprox', the alias 'fl' -> 'fedavg'): its
    # identity, which --resume compares, and the names reports group by must not depend on the typing.
    algo_name, data_name = ALGORITHMS.canonical(algo_name), DATASETS.canonical(data_name)

    values = dict(file_values)
    values.update(given)
    values["algo"], values["dataset"] = algo_name, data_name
    for k in ("algo_options", "data_options", "model_options", "channel_options", "reference"):
        v = values.get(k) or {}
        if not isinstance(v, dict):
            raise ConfigError(f"{k} must be a mapping of option: value, got {v!r}")
        values[k] = dict(v)
    values["algo_options"].update(algo_given)
    for k, v in updates.items():
        values[k].update(v)
    # `out: none` / --out none / --no-out write nothing, as an empty value does
    if isinstance(values.get("out"), str) and values["out"].strip().lower() in ("", NO_OUTPUT):
        values["out"] = ""

    hints = get_type_hints(RunConfig)
    cfg = RunConfig(**{k: (_coerce(v, hints[k], flag_for(k), getattr(RunConfig, k))
                           if hints[k] in (int, float, str, bool) else v) for k, v in values.items()})
    if default_out is not None and "out" not in values and not cfg.resume:
        cfg.out = default_out(cfg)  # --resume names the run it continues: never a new folder
    if cfg.model.strip().lower() == "auto":
        cfg.model = "auto"
    # what the run leaves to auto or to defaults, as its dataset and method resolve it (written
    # into cfg, so config.yaml and the checkpoint's identity hold the values that run)
    cfg.auto_resolved = tuple(apply_auto(cfg, algo_cls, data_spec, values))
    cfg.validate()
    # What can be refused without the data is refused here, before a dataset is loaded (a sweep
    # validates its points through this function); what needs the labels is checked when built.
    check_partition(cfg.partition)
    if cfg.model != "auto":
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
        if flag_algo and algorithm_of_file(file_written) != algo_name:
            head = f"--algo {algo_name} replaces the file's algo {algorithm_of_file(file_written)}"
        else:
            head = f"the command line changes settings of {where}"
        print(f"note: {head}; {'; '.join(said)}", file=sys.stderr, flush=True)
    return cfg, algo_opts, data_opts


def settings_args(config: Any = None, settings: Optional[Dict[str, Any]] = None):
    """(RunConfig, algorithm options, data options) of :func:`fedhpc.run`'s arguments: ``config`` a
    launch YAML file's path, a mapping of the same keys, or None; ``settings`` keyword settings named
    as the YAML keys, overriding ``config`` as flags override a file: RunConfig fields (``rounds=5``),
    the algorithm's options (``mu=0.01``, as ``--mu``), and option mappings (``data_options={...}``,
    whose keys replace the file's, as ``--data-opt k=v`` does). ``out=None`` writes nothing."""
    from ..registry import ALGORITHMS

    if config is None:
        file_values, where = {}, None
    elif isinstance(config, (str, os.PathLike)):
        where = os.fspath(config)
        file_values = load_yaml(where)
    elif isinstance(config, dict):
        file_values, where = dict(config), "<dict>"
    else:
        raise ConfigError(f"config must be a launch YAML file's path, a dict of settings or None, got "
                          f"{type(config).__name__}")
    settings = dict(settings or {})
    if "out" in settings and settings["out"] is None:
        settings["out"] = NO_OUTPUT
    if "out" in file_values and file_values["out"] is None and where == "<dict>":
        file_values["out"] = NO_OUTPUT
    valid = {f.name for f in fields(RunConfig)}
    mappings = ("algo_options", "data_options", "model_options", "channel_options")
    algo_cls, algo_name, _, _ = _chosen(file_values, where, settings.get("algo"), settings.get("dataset"),
                                        settings.get("model"))
    options = {f.name for f in fields(algo_cls.Options)} if algo_cls.Options is not None else set()
    unknown = sorted(k for k in settings if k not in valid and k not in options)
    if unknown:
        raise ConfigError(_unknown_keywords_message(unknown, ALGORITHMS.canonical(algo_name), valid | options))
    updates = {}
    for k in mappings:
        if k in settings:
            v = settings.pop(k)
            if not isinstance(v, dict):
                raise ConfigError(f"{k} must be a mapping of option: value, got {v!r}")
            updates[k] = v
    given = {k: v for k, v in settings.items() if k in valid}
    algo_given = {k: v for k, v in settings.items() if k not in valid}
    return resolve(file_values, where, given, algo_given, updates)


def _unknown_keywords_message(unknown: List[str], algo_name: str, names) -> str:
    from .layers import algorithms_with_option

    notes = []
    for k in unknown:
        others = algorithms_with_option(k)
        if others:
            notes.append(f"{k!r} is an option of algorithm(s) {', '.join(others)}, not of {algo_name}: choose one "
                         f"of them with algo=, or drop {k!r}")
            continue
        near = difflib.get_close_matches(k, sorted(names), n=1)
        notes.append(f"{k!r} is not a setting" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (f"unknown setting(s) {unknown}: " + "; ".join(notes) + "; the settings are the launch YAML keys "
            f"(python -m fedhpc.launch --algo {algo_name} --help lists them as flags)")
