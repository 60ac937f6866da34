"""Grid files: a base configuration plus axes, expanded into named points.

A grid is YAML with these top-level keys (anything else is refused)::

    name: digits_demo                 # default: the file's stem
    config: launch/fedmix_digits.yaml # optional launch/ file every point starts from
    base: {rounds: 30, model: mlp}    # settings shared by every point (override `config`)
    axes:                             # the cartesian product of these
      seed: [0, 1, 2]
    zip:                              # each group is ONE axis whose lists advance together
      - algo: [fedavg, fedmix]
        algo_options.lam: [null, 0.05]
    ranks: 2                          # ranks per point (mpiexec -n / srun tasks)
    out: runs/sweeps/digits_demo      # default: runs/sweeps/<name>
    slurm: {time: "04:00:00", max_parallel: 8}   # see fedhpc.sweep.slurm.SlurmOptions

Keys in ``base``, ``axes`` and ``zip`` are RunConfig fields, ``config`` (a launch/ file per
point), or ``algo_options.KEY`` / ``data_options.KEY`` / ``model_options.KEY``. A ``null`` for an
option key means "leave it out" (so one zip can pair fedavg, which takes no ``lam``, with fedmix).
Points are enumerated with the zip groups outermost, then the axes in file order, the last
axis fastest. Each point's settings are its config file < base < its axis values; mapping
fields (``algo_options``...) are merged key by key, not replaced. One exception: a
``reference`` (a paper's row, read by the report) describes the whole setting of the layer that
wrote it: the config file's reference the file's own values, the base's the settings in effect
after the base (config file < base). A point inherits it only when its identity settings
(RunConfig.IDENTITY: algorithm, partition, channel, model, the option mappings...) other than
``seed`` are that layer's; an axis or zip value that changes one (compared by meaning, as a
resume compares them: an alias, a partition's spelling or an option written out at its default
is no change) drops the row from that point, so the IID and symmetric-channel points of a grid
over a non-IID asymmetric file carry no row of the non-IID asymmetric setting. ``seed`` and the
settings outside IDENTITY (rounds, eval cadence, threads, data_dir) never drop it, except those
the point's algorithm names in ``identity_settings`` (pMixFed's schedule reads ``rounds``). A
``reference`` in the point's own axis / zip values is kept. ``python -m fedhpc.sweep --data-dir
DIR`` sets every point's ``data_dir`` (not an identity setting: the ids stay); validation
refuses a point whose dataset reads its files from --data-dir when none is given, before
anything is run or submitted.

Run ids: ``<label>-<hash>``, the label naming the point's axis values in that same order
(``algo-fedmix_seed-1``) and the hash the first 8 hex digits of SHA-1 over the point's
*identity* settings as written (RunConfig.IDENTITY), plus the settings the point's algorithm
names in ``identity_settings`` (pMixFed's schedule reads ``rounds``), taken as written or else
the RunConfig default: together what a checkpoint must agree on (the engine's ``_identity``).
So an id does not depend on the point's position, on other points, or on settings that may
change between a run and its resumption (rounds, eval cadence, threads): raise ``rounds`` in a
finished sweep and the re-run resumes every point instead of starting over, except points of
an algorithm whose identity holds ``rounds`` (pmixfed), which get new ids and start afresh, as
their checkpoints could not be resumed. The algorithm's settings enter the hash only when it
has any, so the ids of every other point are those earlier versions gave. The identity settings
the hash leaves out (``nesterov``, which RunConfig.identity() holds only when true) are compared
with the run already in a point's folder instead (:func:`identity_differences`, called by the
sweep's ``plan``): a sweep that would skip or resume a run made with other settings is refused.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import os
import re
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, get_type_hints

import yaml

from ..config import (RunConfig, algorithm_identity_settings, identity_changes, load_yaml, parse_args,
                      setting_default)
from ..errors import ConfigError, FedHPCError

GRID_KEYS = ("name", "config", "base", "axes", "zip", "ranks", "out", "slurm")
# The sweep chooses these per point; a grid that sets them would make points overwrite each other.
SWEEP_OWNED = ("out", "resume")


@dataclass
class Point:
    """One run of a sweep."""

    index: int
    id: str
    label: str
    axes: Dict[str, Any]          # this point's axis values, keys as written in the grid
    settings: Dict[str, Any]      # the merged settings (config file < base < axes): a launch/ YAML
    rounds: int = 0               # resolved by validation (RunConfig default when unset)
    #: the point's settings as the launcher resolves them (set by validation; None before)
    config: Optional[RunConfig] = field(default=None, repr=False, compare=False)


@dataclass
class Grid:
    path: str
    name: str
    base: Dict[str, Any]
    axes: List[Tuple[str, List[Any]]]
    zips: List[List[Tuple[str, List[Any]]]]
    config: Optional[str] = None
    ranks: int = 1
    out: str = ""
    slurm: Dict[str, Any] = field(default_factory=dict)
    #: every point's data_dir (``python -m fedhpc.sweep --data-dir``); empty: as the grid says
    data_dir: str = ""


def _mapping_fields() -> List[str]:
    hints = get_type_hints(RunConfig)
    return [f.name for f in fields(RunConfig) if getattr(hints[f.name], "__origin__", None) is dict]


def _check_key(key: str, where: str, path: str) -> None:
    """Refuse a key that is not a setting, suggesting the nearest one."""
    valid = [f.name for f in fields(RunConfig) if f.name not in SWEEP_OWNED] + ["config"]
    if key in SWEEP_OWNED:
        raise ConfigError(f"grid {path}: {where} sets {key!r}, which the sweep chooses for every point; remove it")
    head, dot, tail = key.partition(".")
    if dot:
        if head not in _mapping_fields() or not tail:
            raise ConfigError(f"grid {path}: {where} key {key!r}: only {', '.join(_mapping_fields())} "
                              f"take dotted keys such as algo_options.lam")
        return
    if key not in valid:
        near = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"grid {path}: {where} key {key!r} is not a setting{hint}; valid: {sorted(valid)}")


def _axis_list(key: str, values: Any, where: str, path: str) -> List[Any]:
    if not isinstance(values, list):
        raise ConfigError(f"grid {path}: {where} {key!r} must be a list of values (write [{values!r}] for one)")
    if not values:
        raise ConfigError(f"grid {path}: {where} {key!r} is empty; give it at least one value or remove it")
    return values


def load_grid(path: str) -> Grid:
    """Read and check a grid file's structure (points are validated by :func:`expand`)."""
    raw = load_yaml(path, "grid file")
    unknown = sorted(set(raw) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"grid {path} has unknown top-level key(s) {unknown}; valid: {list(GRID_KEYS)} "
                          f"(settings go under base:, axes: or zip:)")
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"grid {path}: base must be a mapping of settings")
    for k in base:
        _check_key(k, "base", path)
    axes_raw = raw.get("axes") or {}
    if not isinstance(axes_raw, dict):
        raise ConfigError(f"grid {path}: axes must be a mapping of setting: [values]")
    axes = []
    for k, v in axes_raw.items():
        _check_key(k, "axes", path)
        axes.append((k, _axis_list(k, v, "axis", path)))
    zips_raw = raw.get("zip") or []
    if isinstance(zips_raw, dict):
        zips_raw = [zips_raw]
    if not isinstance(zips_raw, list):
        raise ConfigError(f"grid {path}: zip must be a list of groups, each a mapping of setting: [values]")
    zips = []
    for gi, group in enumerate(zips_raw):
        if not isinstance(group, dict) or not group:
            raise ConfigError(f"grid {path}: zip group {gi} must be a non-empty mapping of setting: [values]")
        members = []
        for k, v in group.items():
            _check_key(k, f"zip group {gi}", path)
            members.append((k, _axis_list(k, v, f"zip group {gi} list", path)))
        lengths = {k: len(v) for k, v in members}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"grid {path}: zip group {gi} has lists of different lengths {lengths}; "
                              f"zipped lists advance together, so give them equal lengths")
        zips.append(members)
    keys = [k for k, _ in axes] + [k for g in zips for k, _ in g]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"grid {path}: {twice} appear in more than one axis or zip group; keep each key in one")
    ranks = raw.get("ranks", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"grid {path}: ranks must be a positive integer, got {ranks!r}")
    slurm = raw.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise ConfigError(f"grid {path}: slurm must be a mapping of sbatch settings")
    name = str(raw.get("name") or os.path.splitext(os.path.basename(path))[0])
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"grid {path}: name {name!r} may hold only letters, digits, '.', '_' and '-'")
    config = raw.get("config")
    if config is not None and not isinstance(config, str):
        raise ConfigError(f"grid {path}: config must be the path of one launch/ YAML file")
    return Grid(path=path, name=name, base=base, axes=axes, zips=zips, config=config, ranks=ranks,
                out=str(raw.get("out") or os.path.join("runs", "sweeps", name)), slurm=slurm)


# --------------------------------------------------------------------------- expansion

def _set(settings: Dict[str, Any], key: str, value: Any) -> None:
    """Apply one setting; dotted keys and mapping fields merge into the mapping."""
    head, dot, tail = key.partition(".")
    if dot:
        sub = settings.setdefault(head, {})
        if value is None:
            sub.pop(tail, None)
        else:
            sub[tail] = value
    elif head in _mapping_fields():
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{head} must be a mapping of option: value, got {value!r}")
        settings.setdefault(head, {}).update(value or {})
    else:
        settings[key] = value


def _merge(file_values: Dict[str, Any], layers: List[Tuple[str, Any]]) -> Dict[str, Any]:
    settings: Dict[str, Any] = {}
    for k, v in list(file_values.items()) + list(layers):
        _set(settings, k, copy.deepcopy(v))
    return settings


def _is_reference(key: str) -> bool:
    return key.partition(".")[0] == "reference"


def _channel_options_for_no_channel(file_values: Dict[str, Any], base: List[Tuple[str, Any]],
                                    own: List[Tuple[str, Any]], settings: Dict[str, Any]) -> None:
    """A layer (the base, the point's axes) that sets ``channel: none`` over a channel model of
    an earlier layer runs that setting's ideal-link twin: the earlier layers' ``channel_options``
    parametrised the model and go with it, as ``--channel none`` drops a config file's
    (:func:`fedhpc.config.parse_args`). Options set in that layer or after it are kept, for
    validation to refuse: they were written for no channel."""
    layers = [list(file_values.items()), base, own]
    if str(settings.get("channel", RunConfig.channel)).strip().lower() != "none":
        return
    setting = [i for i, layer in enumerate(layers) if any(k == "channel" for k, _ in layer)]
    if not setting or setting[-1] == 0:
        return  # the file's own channel (or the default) is none: its options are its own mistake
    at = setting[-1]
    before = _merge({}, [kv for layer in layers[:at] for kv in layer])
    if str(before.get("channel", RunConfig.channel)).strip().lower() == "none":
        return
    later = _merge({}, [(k, v) for layer in layers[at:] for k, v in layer if k.partition(".")[0] == "channel_options"])
    if later.get("channel_options"):
        settings["channel_options"] = later["channel_options"]
    else:
        settings.pop("channel_options", None)


def _point_reference(file_values: Dict[str, Any], base: List[Tuple[str, Any]], own: List[Tuple[str, Any]],
                     settings: Dict[str, Any]) -> None:
    """Keep in ``settings`` only the ``reference`` parts written for the point's setting.

    A reference is a paper's row for the whole setting of the layer that wrote it: the config
    file's for the file's own values, the base's for the settings in effect after the base (file <
    base). When the point's identity settings differ from that layer's
    (:func:`fedhpc.config.identity_changes`: any but ``seed``, compared by meaning), the row
    describes another run and is dropped; what the point's own axis / zip values set as
    ``reference`` is kept (applied alone when a layer's row is dropped)."""
    file_ref = [("reference", file_values["reference"])] if "reference" in file_values else []
    base_ref = [(k, v) for k, v in base if _is_reference(k)]
    own_ref = [(k, v) for k, v in own if _is_reference(k)]
    if not (file_ref or base_ref):
        return
    kept = (file_ref if file_ref and not identity_changes(file_values, settings) else []) + \
        (base_ref if base_ref and not identity_changes(_merge(file_values, base), settings) else [])
    if len(kept) == len(file_ref) + len(base_ref):
        return  # every row is the point's setting's: as merged
    ref: Dict[str, Any] = {}
    for k, v in kept + own_ref:
        _set(ref, k, copy.deepcopy(v))
    if "reference" in ref:
        settings["reference"] = ref["reference"]
    else:
        settings.pop("reference", None)


def _label_part(key: str, value: Any) -> List[str]:
    short = key.split(".")[-1]
    if key == "config":
        return [os.path.splitext(os.path.basename(str(value)))[0]]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _label_part(k, v)]
    if value is None:
        return []
    return [f"{short}-{value}"]


def _label(axes: Dict[str, Any]) -> str:
    parts = [re.sub(r"[^A-Za-z0-9._+-]+", "-", p).strip("-") for k, v in axes.items() for p in _label_part(k, v)]
    return "_".join(p for p in parts if p)[:80] or "run"


def run_hash(settings: Dict[str, Any]) -> str:
    """8 hex digits of SHA-1 over the identity settings as written (canonical JSON): RunConfig.IDENTITY
    and the point's algorithm's ``identity_settings`` (the latter only when it has any, so that the
    ids of other algorithms' points stay those of sweeps already on disk)."""
    ident = {k: settings[k] for k in RunConfig.IDENTITY if k in settings}
    for k in algorithm_identity_settings(settings.get("algo", RunConfig.algo)):
        if k not in RunConfig.IDENTITY:  # those are hashed as written already
            ident[k] = settings[k] if k in settings else setting_default(k)
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:8]


#: how :func:`identity_differences` begins the line of a run dealt under other partition rules
#: (the sweep's fix for it differs: no setting in the grid restores that split)
PARTITION_RULES_DIFFER = "partition_rules:"


def identity_differences(p: Point, saved: Dict[str, Any], recorded: Optional[Dict[str, Any]] = None) -> List[str]:
    """The identity settings that the run whose config.yaml reads ``saved`` (the engine writes every
    RunConfig field there) does not share with the validated point ``p``: "nesterov: the run has
    False, this point True". Only the settings the id does not hash are compared: those it hashes
    (as written) are the point's by the id itself, and the engine may have resolved them since (a
    full participation under --cold-start-fraction). Both sides are read as the checkpoint reads
    them (fedhpc.checkpoint.canonical_identity), so spellings and defaults are not differences;
    a field missing from an older config.yaml is its default, as the engine assumes on resume.
    What the identity holds besides RunConfig fields (``partition_rules``) is the run's
    ``recorded`` identity's (fedhpc.checkpoint.recorded_identity; a key it lacks: recorded before
    it existed); with none recorded, today's, as config.yaml alone could tell."""
    from ..checkpoint import canonical_identity

    if p.config is None:
        raise ValueError("identity_differences needs a validated point (expand(grid, validate=True))")
    names = {f.name for f in fields(RunConfig)}
    run_cfg = RunConfig(**{k: v for k, v in saved.items() if k in names})
    hashed = set(RunConfig.IDENTITY) | set(algorithm_identity_settings(p.settings.get("algo", RunConfig.algo)))
    # what a checkpoint of each must agree on, as the engine's _identity builds it
    then, now = (canonical_identity(c.identity(algorithm_identity_settings(c.algo))) for c in (run_cfg, p.config))
    if recorded is not None:
        then.update({k: recorded.get(k) for k in set(then) - names})
    out = []
    for k in sorted((set(then) | set(now)) - hashed):
        if k == "partition_rules" and then.get(k) != now.get(k):
            rules = then.get(k) if then.get(k) is not None else "from before they were recorded"
            out.append(f"{PARTITION_RULES_DIFFER} the run's partition {run_cfg.partition!r} was dealt under partition "
                       f"rules {rules}, this point's under rules {now.get(k)}, which may deal another split "
                       f"(PARTITION_RULES in fedhpc/data/partition/)")
        elif then.get(k) != now.get(k):
            # a RunConfig field is shown as set (nesterov False), not as the identity holds it (absent)
            a, b = (getattr(c, k) if k in names else d.get(k) for c, d in ((run_cfg, then), (p.config, now)))
            out.append(f"{k}: the run has {a!r}, this point {b!r}")
    return out


def expand(grid: Grid, validate: bool = True) -> List[Point]:
    """All points of ``grid`` with their ids; with ``validate`` each is checked as the launcher
    would check it (``fedhpc.config.parse_args``) and every bad point is named in one ConfigError."""
    # A zip group is one axis whose values are tuples of (key, value) pairs.
    dims: List[List[List[Tuple[str, Any]]]] = []
    for group in grid.zips:
        dims.append([[(k, vals[i]) for k, vals in group] for i in range(len(group[0][1]))])
    for k, vals in grid.axes:
        dims.append([[(k, v)] for v in vals])
    order = [k for g in grid.zips for k, _ in g] + [k for k, _ in grid.axes]  # labels read like the loop nest
    points: List[Point] = []
    for index, combo in enumerate(itertools.product(*dims)):
        pairs = [kv for member in combo for kv in member]
        values = dict(pairs)
        config_file = values.pop("config", grid.config)
        own = [(k, v) for k, v in pairs if k != "config"]
        try:
            file_values = load_yaml(config_file) if config_file else {}
            settings = _merge(file_values, list(grid.base.items()) + own)
            _channel_options_for_no_channel(file_values, list(grid.base.items()), own, settings)
            _point_reference(file_values, list(grid.base.items()), own, settings)
        except ConfigError as e:
            raise ConfigError(f"grid {grid.path}: point {index} ({values}): {e}")
        if grid.data_dir:  # not an identity setting: the ids stay those of the grid without it
            settings["data_dir"] = grid.data_dir
        axes = {k: dict(pairs)[k] for k in order}
        label = _label(axes)
        points.append(Point(index, f"{label}-{run_hash(settings)}", label, axes, settings))
    seen: Dict[str, int] = {}
    for p in points:
        if p.id in seen:
            raise ConfigError(f"grid {grid.path}: points {seen[p.id]} and {p.index} are the same run "
                              f"({p.id}); remove the duplicate from the axes or zip groups")
        seen[p.id] = p.index
    if validate:
        validate_points(grid, points)
    return points


def reads_files_from_data_dir(cfg: RunConfig, data_opts: Any) -> bool:
    """Whether the run ``cfg`` would stop at "dataset ... reads its files from --data-dir" because it
    gives no data_dir. The datasets read from files are those whose options extend the file readers'
    StoreOptions (fedhpc/data/readers/common.py): each reads its ``dir`` option when set, else a
    folder under --data-dir (``require_data_dir``); a ``file`` option (imagenet200) given as an
    absolute path needs no --data-dir either. The embedded and generated ones (digits, synthetic)
    read none."""
    from ..data.readers.options import StoreOptions

    if str(cfg.data_dir or "") or not isinstance(data_opts, StoreOptions) or data_opts.dir:
        return False
    file = getattr(data_opts, "file", "")
    return not (isinstance(file, str) and os.path.isabs(file))


def _indices(points: List[Point]) -> str:
    """'point 3' / 'points 0-47' / 'points 0-3, 8, 10-11' (indices ascending)."""
    runs: List[List[int]] = []
    for p in points:
        if runs and p.index == runs[-1][1] + 1:
            runs[-1][1] = p.index
        else:
            runs.append([p.index, p.index])
    spans = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ("point " if len(points) == 1 else "points ") + ", ".join(spans)


def validate_points(grid: Grid, points: List[Point]) -> None:
    """Run each point's settings through the launcher's own parser; refuse the grid naming every bad point."""
    bad = []
    failed = set()  # indices of the points in ``bad``
    no_data_dir: Dict[str, List[Point]] = {}  # dataset -> the points that read its files without a data_dir
    resolved: Dict[str, int] = {}  # a point's full configuration as the launcher resolves it -> its index
    with tempfile.TemporaryDirectory(prefix="fedhpc-sweep-") as tmp:
        for p in points:
            path = os.path.join(tmp, f"{p.index}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(p.settings, f, sort_keys=False)
            try:
                # parse_args also checks the partition spec and the model options, which need no data,
                # so a point the launcher would refuse stops the sweep here rather than after point 0 ran
                cfg, _, data_opts = parse_args(["--config", path])
                p.rounds, p.config = cfg.rounds, cfg
                if reads_files_from_data_dir(cfg, data_opts):  # refused by the run only once it started
                    no_data_dir.setdefault(cfg.dataset, []).append(p)
                # Ids hash the names as written; the launcher resolves 'Fedprox' and the alias 'fl'
                # to 'fedprox' and 'fedavg', so two differently spelled points can be one run.
                same = resolved.setdefault(json.dumps(cfg.to_dict(), sort_keys=True, default=str), p.index)
                if same != p.index:
                    failed.add(p.index)
                    bad.append(f"  point {p.index} ({p.label}): the same run as point {same} once the launcher "
                               f"resolves its settings (e.g. names differing only in case, or fl = fedavg); remove one")
            except FedHPCError as e:
                failed.add(p.index)
                bad.append(f"  point {p.index} ({p.label}): {str(e).replace(repr(path), 'its settings')}")
            except SystemExit:  # argparse on a malformed value
                failed.add(p.index)
                bad.append(f"  point {p.index} ({p.label}): settings rejected by the launcher's parser")
    n_bad = len(failed | {p.index for ps in no_data_dir.values() for p in ps})
    # one line per dataset: a grid without a data_dir fails every point that reads files alike
    bad = [f"  {_indices(ps)} ({ps[0].label}{', ...' if len(ps) > 1 else ''}): dataset {ds!r} reads its files "
           f"from --data-dir, and none is given: pass --data-dir DIR to python -m fedhpc.sweep, or set "
           f"data_dir: DIR in the grid's base" for ds, ps in no_data_dir.items()] + bad
    if bad:
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ConfigError(f"grid {grid.path}: {n_bad} of {len(points)} point(s) fail validation, "
                          f"nothing was run or submitted:\n" + "\n".join(bad[:20]) + more)


def point_yaml(grid: Grid, p: Point) -> str:
    """The launch/ YAML of one point: what `python -m fedhpc.launch --config` reads."""
    head = (f"# point {p.index} of sweep {grid.name} ({grid.path}); id {p.id}\n"
            f"# axes: {json.dumps(p.axes, default=str)}\n")
    return head + yaml.safe_dump(p.settings, sort_keys=False)
