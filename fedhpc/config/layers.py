"""How a config file's settings and the command line's combine when they disagree.

A file is written for its own algorithm, channel and paper row: ``--algo`` over it carries the
options the new method shares and drops the others, ``--channel none`` drops the channel's
parameters, and a flag that changes an identity setting drops the file's ``reference``; what is
dropped is said once on rank 0 (:func:`fedhpc.config.parse_args`). A key that is no setting is
refused, naming where it belongs.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import fields
from typing import Any, Dict, List, Optional, Tuple, get_type_hints

import yaml

from ..errors import ConfigError
from .run import RunConfig
from .values import coerce_value, flag_for, option_names


def algorithms_with_option(name: Any) -> List[str]:
    """The registered algorithms that have option ``name``, by name."""
    from ..registry import ALGORITHMS

    return [n for n in ALGORITHMS.names() if name in option_names(ALGORITHMS.get(n).Options)]


def unknown_settings_message(path: str, unknown: List[Any], file_values: Dict[str, Any], algo_name: Any,
                             data_name: Any, model_name: Any) -> str:
    """The message for top-level keys that are not settings: where an option belongs, or the near key."""
    from ..registry import ALGORITHMS
    from ..data import DATASETS
    from ..models import MODELS, load_model_modules, model_option_params

    load_model_modules()
    valid = sorted(f.name for f in fields(RunConfig))

    # The option mappings this file's algorithm, dataset and model read, where a stray key may belong.
    homes = []
    if algo_name in ALGORITHMS:
        homes.append(("algo_options", f"algorithm {ALGORITHMS.canonical(algo_name)!r}",
                      option_names(ALGORITHMS.get(algo_name).Options)))
    if data_name in DATASETS:
        homes.append(("data_options", f"dataset {DATASETS.canonical(data_name)!r}",
                      option_names(DATASETS.get(data_name).options)))
    if model_name in MODELS:
        homes.append(("model_options", f"model {MODELS.canonical(model_name)!r}",
                      set(model_option_params(model_name))))
    notes, list_valid = [], False
    for k in unknown:
        home = next(((m, who) for m, who, names in homes if k in names), None)
        if home is not None:
            example = yaml.safe_dump({home[0]: {k: file_values[k]}}, default_flow_style=None).strip()
            notes.append(f"{k!r} is an option of {home[1]}: put it under {home[0]} (`{example}`)")
            continue
        others = algorithms_with_option(k)
        if others:
            notes.append(f"{k!r} is an option of algorithm(s) {', '.join(others)}, not of the algorithm this "
                         f"file runs: set algo: to one of them and put {k!r} under algo_options:")
            continue
        near = difflib.get_close_matches(str(k), valid, n=1)
        near_option = [(m, n) for m, _, names in homes for n in difflib.get_close_matches(str(k), names, n=1)]
        if near:
            notes.append(f"{k!r} is not a setting (did you mean {near[0]!r}?)")
        elif near_option:
            notes.append(f"{k!r} is not a setting (did you mean {near_option[0][1]!r}, under {near_option[0][0]}?)")
        else:
            notes.append(f"{k!r} is not a setting")
            list_valid = True
    tail = f"; valid: {valid}" if list_valid else ""
    return f"config file {path!r} has unknown setting(s) {unknown}: " + "; ".join(notes) + tail


def unknown_flags_message(extra: List[str], algo_name: str, flags: List[str]) -> str:
    """The message for command-line words the launcher does not take (``extra``, as argparse left
    them) when ``algo_name`` runs and ``flags`` are the flags it has: an option of other algorithms
    is named with them (argparse only knows the chosen algorithm's), another flag with its near
    flag."""
    notes = []
    for word in extra:
        if not word.startswith("--"):
            continue  # a value of the flag before it, or a stray word: shown in the list of all of them
        flag = word.split("=", 1)[0]
        name = flag[2:].replace("-", "_")
        others = algorithms_with_option(name)
        if others:
            notes.append(f"{flag} is an option of algorithm(s) {', '.join(others)}, not of {algo_name}: choose one "
                         f"of them with --algo, or drop {flag}")
            continue
        near = difflib.get_close_matches(flag, flags, n=1)
        notes.append(f"{flag} is no flag" + (f" (did you mean {near[0]}?)" if near else ""))
    return (f"unrecognized argument(s) {' '.join(extra)}" + (": " + "; ".join(notes) if notes else "")
            + f"; python -m fedhpc.launch --algo {algo_name} --help lists the flags")


#: Field metadata key of an algorithm option whose meaning is its method's own while other methods
#: have an option of the same name (FedAvg's server_lr steps the averaged update; FLD's and the
#: server trainers' is a learning rate): such an option is not carried over to or from another
#: algorithm by ``--algo`` unless both read the very same field (one Options class, or inherited).
METHOD_SPECIFIC = "method_specific"


def _same_meaning(old_cls, new_cls, name: str) -> bool:
    """Whether option ``name`` of both Options classes may take one value: the same field, or
    neither marked :data:`METHOD_SPECIFIC`."""
    old = next((f for f in fields(old_cls) if f.name == name), None) if old_cls is not None else None
    new = next(f for f in fields(new_cls) if f.name == name)
    if old is None or old is new:  # not an option of the file's algorithm (kept as written), or one definition
        return True
    return not (old.metadata.get(METHOD_SPECIFIC) or new.metadata.get(METHOD_SPECIFIC))


#: The option mappings of RunConfig and the setting naming what each belongs to.
OPTION_OWNERS = {"algo_options": "algo", "data_options": "dataset", "model_options": "model"}


def algorithm_identity_settings(algo: Any) -> Tuple[str, ...]:
    """``identity_settings`` of the algorithm named ``algo`` (the settings its updates read beyond
    RunConfig.IDENTITY: pMixFed's schedule reads ``rounds``); () for a name the registry does not
    know (the launcher refuses it, naming it)."""
    from ..registry import ALGORITHMS, load_algorithm_modules

    load_algorithm_modules()
    try:
        return tuple(ALGORITHMS.get(ALGORITHMS.canonical(algo)).identity_settings)
    except (ConfigError, TypeError):
        return ()


def identity_changes(layer: Dict[str, Any], final: Dict[str, Any]) -> List[str]:
    """The identity settings (:attr:`RunConfig.IDENTITY` but ``seed``, then the algorithm's
    ``identity_settings``) to which ``final`` gives another meaning than ``layer``, in that order:
    a paper's ``reference`` written in a layer of settings (a config file; a sweep's config file
    and base) describes that layer's setting, so a run whose later layer (command-line flags; a
    sweep point's axes) changes one of these is not the reference's run. ``seed`` is no change of
    setting (a paper's row averages over seeds), nor is anything else outside IDENTITY (cadence,
    threads, out, data_dir), nor ``rounds`` unless the algorithm's updates read it (pMixFed's
    schedule: its identity_settings, which a checkpoint's identity holds too; FedAvg's rounds only
    say how long the same setting runs).

    Both are settings mappings as a YAML file writes them; a key that is not set is RunConfig's
    default. Values are read as the launcher reads them (a scalar converted to its field's type,
    ``model: Auto`` is ``auto``, an empty option mapping is ``{}``) and then as a resume compares
    them (:func:`fedhpc.checkpoint.canonical_identity`: registry names and aliases, option mappings
    with their defaults, a partition's spelling), so a spelling is no change. An option mapping is
    not named when what it belongs to (its algorithm, dataset, model) is: its options are another's.
    A value the launcher would refuse is compared as written (validation names it)."""
    from .identity import canonical_identity

    hints = get_type_hints(RunConfig)
    defaults = RunConfig()
    # the settings of either side's algorithm: when the algorithm itself changes, that is named alone
    extra = [k for algo in (layer.get("algo", defaults.algo), final.get("algo", defaults.algo))
             for k in algorithm_identity_settings(algo) if k not in RunConfig.IDENTITY]
    names = [*RunConfig.IDENTITY, *dict.fromkeys(extra)]

    def read(values: Dict[str, Any]) -> Dict[str, Any]:
        out = {}
        for k in names:
            v = values.get(k, getattr(defaults, k))
            if hints[k] in (int, float, str, bool):
                try:
                    v = coerce_value(v, hints[k], flag_for(k))
                except ConfigError:
                    pass
            elif v is None:  # `algo_options:` with nothing after it, as parse_args reads it
                v = {}
            if k == "model" and isinstance(v, str) and v.strip().lower() == "auto":
                v = "auto"
            out[k] = v
        return canonical_identity(json.loads(json.dumps(_as_auto_resolves(out, values), default=str)))

    then, now = read(layer), read(final)
    changed = [k for k in names if k != "seed" and then[k] != now[k]]
    return [k for k in changed if OPTION_OWNERS.get(k) not in changed and not (k in extra and "algo" in changed)]


def _as_auto_resolves(out: Dict[str, Any], values: Dict[str, Any]) -> Dict[str, Any]:
    """``out`` (identity settings read from a layer of settings ``values``) with what the launcher
    resolves for the settings the layer leaves unset (:func:`fedhpc.config.auto.apply_auto`: digits'
    lr, a method's model or K_s), so that a layer and the run it becomes are compared on the values
    both run with: a file that sets no lr means digits' lr on both sides. Read as written when the
    layer's algorithm or dataset is not one the registries know (the launcher refuses it)."""
    from ..data import DATASETS
    from ..registry import ALGORITHMS
    from .auto import apply_auto

    algo, dataset = out.get("algo"), out.get("dataset")
    if not (isinstance(algo, str) and algo in ALGORITHMS and isinstance(dataset, str) and dataset in DATASETS):
        return out
    cfg = RunConfig()
    for k, v in out.items():
        if isinstance(v, dict):  # option mappings: apply_auto replaces, never edits, but keep them apart
            v = dict(v)
        setattr(cfg, k, v)
    try:
        apply_auto(cfg, ALGORITHMS.get(algo), DATASETS.get(dataset), values)
    except (ConfigError, TypeError, ValueError, AttributeError):  # a value the launcher refuses: as written
        return out
    return {k: getattr(cfg, k) for k in out}


def _reference_row(reference: Dict[str, Any]) -> str:
    """' (ROW)' naming a reference in a note (its row, else table, else paper), or ''."""
    row = next((str(reference[k]) for k in ("row", "table", "paper") if reference.get(k)), "")
    return f" ({row})" if row else ""


def options_for_replaced_algorithm(file_values: Dict[str, Any], flag_algo: Optional[str],
                                   algo_cls) -> Tuple[Dict[str, Any], List[str]]:
    """A file's ``algo_options`` were written for the file's ``algo``. When ``--algo`` names
    another one, the options it also has carry over (the pMixFed files' ``finetune_epochs`` serves
    every method of their table) unless the two mean different things (:data:`METHOD_SPECIFIC`),
    and the others are dropped, not refused: a file's settings cannot be removed from the command
    line. Returns the file's values with those options, and what to say of them in the rank-0
    note (:func:`parse_args`): an option of the same name may still mean another thing (FedProx's
    mu is not pMixFed's). The file's ``reference`` is judged with the other settings, by
    :func:`identity_changes`."""
    from ..registry import ALGORITHMS

    file_algo, opts = file_values.get("algo"), file_values.get("algo_options")
    if (not flag_algo or not isinstance(file_algo, str) or file_algo not in ALGORITHMS
            or ALGORITHMS.canonical(file_algo) == ALGORITHMS.canonical(flag_algo)):
        return file_values, []
    out = dict(file_values)
    new_name = ALGORITHMS.canonical(flag_algo)
    said = []
    if isinstance(opts, dict) and opts:
        names, old_cls = option_names(algo_cls.Options), ALGORITHMS.get(file_algo).Options
        kept = {k: v for k, v in opts.items() if k in names and _same_meaning(old_cls, algo_cls.Options, k)}
        other = {k: v for k, v in opts.items() if k in names and k not in kept}
        dropped = sorted(str(k) for k in opts if k not in names)
        parts = []
        if kept:
            parts.append(f"{', '.join(f'{k}={v}' for k, v in kept.items())} carried over to {new_name} (an option "
                         f"of the same name; {', '.join(flag_for(k) for k in kept)} sets it)")
        if other:
            parts.append(f"{', '.join(f'{k}={v}' for k, v in other.items())} not carried over ({new_name}'s option "
                         f"of that name means another thing; its default applies; "
                         f"{', '.join(flag_for(k) for k in other)} sets it)")
        if dropped:
            parts.append(f"{', '.join(dropped)} dropped ({new_name} has no such option)")
        said.append(f"of its algo_options, {'; '.join(parts)}")
        out["algo_options"] = kept
    return out, said


def channel_options_for_no_channel(file_values: Dict[str, Any], flag_channel: Optional[str]
                                   ) -> Tuple[Dict[str, Any], List[str]]:
    """A file's ``channel_options`` parametrise the file's channel model. ``--channel none`` over a
    file with a model runs the ideal-link twin of that setting (the ablation a channel study
    needs), so the options go with the model, said in the rank-0 note, rather than refusing a run
    whose options cannot be removed from the command line. Options given with ``--channel-opt``,
    or written beside ``channel: none`` in the file itself, are still refused by validate()."""
    file_channel, opts = file_values.get("channel", RunConfig.channel), file_values.get("channel_options")
    if (flag_channel is None or flag_channel.strip().lower() != "none" or not isinstance(opts, dict) or not opts
            or not isinstance(file_channel, str) or file_channel.strip().lower() == "none"):
        return file_values, []
    return ({**file_values, "channel_options": {}},
            [f"its channel_options ({', '.join(f'{k}={v}' for k, v in opts.items())}) parametrise its channel "
             f"{file_channel} and are dropped with it"])


def reference_for_flags(file_values: Dict[str, Any], cfg: "RunConfig") -> List[str]:
    """Drop from ``cfg`` a reference its config file wrote when the command line changed the
    file's identity settings (:func:`identity_changes`): the report would hold the run against
    the row of another setting. Returns what to say of it in the rank-0 note; the algorithm's
    part in the words of ``--algo``'s note ("is pmixfed's")."""
    reference = file_values.get("reference")
    if not (isinstance(reference, dict) and reference and cfg.reference):
        return []
    changed = identity_changes(file_values, cfg.to_dict())
    if not changed:
        return []
    cfg.reference = {}
    parts = [f"is {algorithm_of_file(file_values)}'s"] if "algo" in changed else []
    others = [k for k in changed if k != "algo"]
    if others:
        parts.append(f"describes the file's {', '.join(others)}")
    return [f"its reference{_reference_row(reference)} {', '.join(parts)} and is dropped"]


def algorithm_of_file(file_values: Dict[str, Any]) -> str:
    """The algorithm a config file runs, as the registry names it (RunConfig's default if unset)."""
    from ..registry import ALGORITHMS

    algo = file_values.get("algo", RunConfig.algo)
    return ALGORITHMS.canonical(algo) if algo in ALGORITHMS else str(algo)
