"""Find the runs under some folders and group them by everything but the seed.

A run is a folder holding config.yaml (written by the engine) or status.json (written by the
sweep's runners when an attempt ended before the engine wrote anything). Two finished runs
fall in the same group when their flattened configurations agree on every setting except
RUN_LOCAL: the seed, and the settings that say how or where a run executed, not what it
computed. Unknown settings (added by a later fedhpc) do separate groups: a report that keeps
two settings apart that could have been merged is safer than one that averages different
experiments. The partition rules a run's split was dealt under (its recorded identity, not
config.yaml) count as a setting when they are not today's. A folder is read once however often
the roots reach it, and two runs of a group with one seed are one run counted once (same
metrics) or refused (different metrics), never two seeds.

A setting left at ``auto`` (the model, the partition) is read as what the run resolved it to, from
its run.json (:mod:`fedhpc.provenance`); for a run from before run.json, as today's code reads it
where that can be told without its data (:func:`_assume_for_unrecorded`), else config.yaml's ``auto``.
The settings a report names per row (:func:`shown_settings`) are those whose value differs between
rows, with an option's default counted as its value (FedProx's ``mu: 0.01`` is named beside a row
with ``mu: 0.1``), and the axes a run's sweep declared.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Tuple

from ..checkpoint import OPTION_MAPPINGS, OPTIONS_AS_RUN, recorded_identity
from ..errors import ConfigError, FedHPCError
from ..provenance import code_versions, read_provenance
from ..sweep.state import RunState, read_config, read_metrics, run_state

RUN_LOCAL = ("seed", "out", "resume", "threads", "device", "quiet", "tensorboard", "checkpoint_every",
             "collective_timeout", "client_state_budget_mb", "eval_batch_size", "data_dir", "reference",
             "collective_backend")


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"algo_options": {"lam": 0.1}} -> {"algo_options.lam": 0.1}; an empty mapping disappears."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def meaning(config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` with each setting spelled one way, so that runs computing the same thing fall in
    one group: names as the registries spell them, the partition as it parses, and each option
    mapping holding just the options that differ from their defaults, in their declared types
    (``mu: 1`` in a YAML file and ``--mu 1`` are one run; so are ``{}`` and an option written out
    at its default). The same reading a resume makes (:func:`fedhpc.checkpoint.canonical_identity`),
    minus the defaults, so that the report's columns show what a run set, not every option."""
    from ..checkpoint import canonical_identity

    full = canonical_identity(config)
    bare = canonical_identity({**config, **{k: {} for k in OPTION_MAPPINGS if isinstance(config.get(k), dict)}})
    out = dict(full)
    for k in OPTION_MAPPINGS:
        if isinstance(full.get(k), dict) and isinstance(bare.get(k), dict):
            out[k] = {o: v for o, v in full[k].items() if o not in bare[k] or bare[k][o] != v}
    return out


#: settings a run may leave at ``auto`` (or 0: threads) that its run.json records resolved; the first
#: two decide groups, the others say where the run executed (load_runs shows them resolved too)
RESOLVED_SETTINGS = ("model", "partition", "device", "threads", "collective_backend")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("", "auto", "default")


def resolve_autos(config: Optional[Dict[str, Any]], provenance: Optional[Dict[str, Any]],
                  keys=RESOLVED_SETTINGS, assumed: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """``config`` with each of ``keys`` that it leaves at ``auto`` (``threads``: 0) replaced by the
    value the run resolved (run.json's ``config``), else by ``assumed`` (:func:`find_runs`' reading
    of a run from before run.json); as it is where neither says."""
    resolved = (provenance or {}).get("config")
    resolved = resolved if isinstance(resolved, dict) else (assumed or {})
    if config is None or not resolved:
        return config
    out = dict(config)
    for k in keys:
        left = _is_auto(out.get(k)) or (k == "threads" and out.get(k) == 0)
        if left and k in resolved and resolved[k] is not None:
            out[k] = resolved[k]
    return out


def _assume_for_unrecorded(runs: List["Run"]) -> None:
    """What ``auto`` meant for runs from before run.json: the partition as today's code deals it
    (``natural`` for naturally federated data, else ``iid``: the partition rules a split was dealt
    under are told apart by ``partition_rules``), and the model as the runs here that recorded it on
    the same dataset resolved it (the reading a resume makes: today's default); with no such run, the
    model stays ``auto``. So an older run and a newer one of one setting stay one group."""
    from ..provenance import resolved_partition

    models: Dict[str, str] = {}
    for r in runs:
        done = (r.provenance or {}).get("config")
        if r.config and isinstance(done, dict) and _is_auto(r.config.get("model")) and done.get("model"):
            models.setdefault(str(r.config.get("dataset")), str(done["model"]))
    for r in runs:
        if r.provenance is not None or not r.config:
            continue
        dataset = str(r.config.get("dataset"))
        if _is_auto(r.config.get("model")) and dataset in models:
            r.assumed["model"] = models[dataset]
        if _is_auto(r.config.get("partition")):
            try:
                r.assumed["partition"] = resolved_partition("auto", dataset)
            except Exception:  # noqa: BLE001 - unreadable today: read as written
                pass


def _options_as_run(config: Optional[Dict[str, Any]], recorded: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``config`` with each option mapping as the run's own code read it, every default filled in
    (the engine's record beside the identity, :data:`~fedhpc.checkpoint.OPTIONS_AS_RUN`), so that
    a default changed since is not read into the run. A mapping is taken only where the record
    describes this config.yaml (the identity holds the same mapping as given); a run from before
    the record keeps its options as given, read with today's defaults."""
    as_run = (recorded or {}).get(OPTIONS_AS_RUN)
    if config is None or not isinstance(as_run, dict):
        return config
    return {**config, **{k: v for k, v in as_run.items()
                         if k in OPTION_MAPPINGS and isinstance(v, dict) and recorded.get(k) == config.get(k)}}


@dataclass
class Run:
    path: str
    config: Optional[Dict[str, Any]]
    records: List[Dict[str, Any]]
    state: RunState
    #: the partition rules its split was dealt under (config.yaml cannot say: the identity the
    #: engine records holds them); "unrecorded" for a record that predates them
    partition_rules: Any = None
    #: its run.json (fedhpc.provenance), None for a run from before it
    provenance: Optional[Dict[str, Any]] = None
    #: config.yaml as written (options as given, before any default was filled in)
    given: Optional[Dict[str, Any]] = None
    #: the settings its sweep varies (its point's axes in sweep.json, flattened keys), if any
    axes: List[str] = field(default_factory=list)
    #: for a run from before run.json: what its ``auto`` settings are read as (find_runs)
    assumed: Dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> Any:
        return (self.config or {}).get("seed")

    @property
    def reference(self) -> Dict[str, Any]:
        ref = (self.config or {}).get("reference")
        return ref if isinstance(ref, dict) else {}

    @property
    def code_versions(self) -> List[str]:
        """The fedhpc code that ran it (each launch's, :func:`fedhpc.provenance.code_version`);
        empty for a run from before run.json."""
        return code_versions(self.provenance)

    def _resolved(self) -> Dict[str, Any]:
        config = {k: v for k, v in (self.config or {}).items() if k not in RUN_LOCAL}
        return resolve_autos(config, self.provenance, ("model", "partition"), self.assumed)

    def _with_rules(self, out: Dict[str, Any]) -> Dict[str, Any]:
        from ..data.partition import PARTITION_RULES

        if self.partition_rules is not None and self.partition_rules != PARTITION_RULES:
            out["partition_rules"] = self.partition_rules
        return out

    def settings(self) -> Dict[str, Any]:
        """The flattened configuration that decides the group, as :func:`meaning` reads it (a model
        or partition left at ``auto`` as the run resolved it); a split dealt under other partition
        rules than today's is another setting (the same spec may have meant another split), shown
        as ``partition_rules``."""
        return self._with_rules(flatten(meaning(self._resolved())))

    def display(self) -> Dict[str, Any]:
        """:meth:`settings` with every option's value, defaults included: what a row names."""
        from ..checkpoint import canonical_identity

        return self._with_rules(flatten(canonical_identity(self._resolved())))


@dataclass
class Group:
    settings: Dict[str, Any]
    runs: List[Run] = field(default_factory=list)

    @property
    def reference(self) -> Dict[str, Any]:
        """The first run's reference (runs of one group come from one config, so they agree)."""
        return next((r.reference for r in self.runs if r.reference), {})

    @cached_property
    def display(self) -> Dict[str, Any]:
        """The first run's :meth:`Run.display` (runs of one group mean the same settings)."""
        return self.runs[0].display() if self.runs else dict(self.settings)

    def code_versions(self) -> Dict[str, List[str]]:
        """{run path: the code versions that ran it} for runs whose code differs within the group
        (commit, dirty flag or the dirty tree's digest; a run without run.json as "unrecorded" when
        another run of the group has one); empty when every run ran the same code."""
        versions = {r.path: r.code_versions or ["unrecorded"] for r in self.runs}
        distinct = {v for vs in versions.values() for v in vs}
        if distinct <= {"unrecorded"} or len(distinct) == 1:
            return {}
        return versions


def _is_run(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.yaml")) or os.path.exists(os.path.join(path, "status.json"))


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def find_runs(roots: List[str], skipped: Optional[List[Dict[str, Any]]] = None
              ) -> Tuple[List[Run], List[Dict[str, Any]]]:
    """Every run under ``roots`` (sorted by path), and the points of sweep manifests with no run yet.

    A folder reached twice (a root given twice, a root inside another, a symlink) is one run.
    A run whose config.yaml, or a sweep.json, cannot be parsed is skipped with a warning and,
    when ``skipped`` is given, appended to it ({"path", "status", "problem"}): one torn file
    must not stop a report over many runs, but the report has to say what it left out.
    """
    runs: List[Run] = []
    not_started: List[Dict[str, Any]] = []
    seen = set()
    manifests: Dict[str, Any] = {}  # sweep.json path -> its content (None: unreadable), read once

    def skip(path: str, status: str, problem: str) -> None:
        _warn(f"{path} skipped: {problem}")
        if skipped is not None:
            skipped.append({"path": path, "status": status, "problem": problem})

    for root in roots:
        for dirpath, dirnames, _ in os.walk(root):
            dirnames.sort()
            real = os.path.realpath(dirpath)
            if real in seen:  # already walked from another root: its runs are in the list
                dirnames[:] = []
                continue
            seen.add(real)
            if _is_run(dirpath):
                dirnames[:] = []  # checkpoints/ and tensorboard/ belong to this run
                try:
                    config = read_config(dirpath)
                except FedHPCError as e:
                    skip(dirpath, "unreadable config.yaml", str(e))
                    continue
                try:  # as the sweep reads it: no record at all is taken as today's rules
                    recorded = recorded_identity(dirpath)
                except FedHPCError as e:
                    skip(dirpath, "unreadable identity.json", str(e))
                    continue
                records = read_metrics(dirpath)
                rounds = config.get("rounds") if config else None
                given = config
                config = _options_as_run(config, recorded)
                runs.append(Run(dirpath, config, records, run_state(dirpath, rounds, records=records),
                                None if recorded is None else recorded.get("partition_rules", "unrecorded"),
                                read_provenance(dirpath), given, _declared_axes(sweep_point(dirpath, manifests))))
            manifest = os.path.join(dirpath, "sweep.json")
            if os.path.exists(manifest):
                try:
                    with open(manifest) as f:
                        sweep = json.load(f)
                    ids = [str(p["id"]) for p in sweep.get("points", [])]
                except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
                    # The sweep's runs are still found (they are folders with config.yaml); only
                    # the points that never started cannot be listed.
                    skip(manifest, "unreadable sweep.json",
                         f"cannot be read as a sweep manifest ({type(e).__name__}: {e}), so the report cannot "
                         f"list that sweep's points that have not started; submit the sweep's grid again "
                         f"(python -m fedhpc.sweep GRID rewrites it when points remain)")
                    continue
                for pid in ids:
                    run_dir = os.path.join(dirpath, "runs", pid)
                    if not _is_run(run_dir) and os.path.realpath(run_dir) not in seen:
                        seen.add(os.path.realpath(run_dir))
                        not_started.append({"path": run_dir, "status": "not started", "id": pid})
    runs.sort(key=lambda r: r.path)
    _assume_for_unrecorded(runs)
    return runs, not_started


# Wall-clock measurements: they differ between two executions of one computation.
def _is_timing(key: str) -> bool:
    return "seconds" in key


def _results(run: Run) -> List[Dict[str, Any]]:
    return [{k: v for k, v in rec.items() if not _is_timing(k)} for rec in run.records]


def group_runs(runs: List[Run], duplicates: Optional[List[Tuple[Run, Run]]] = None) -> List[Group]:
    """Finished runs grouped by their settings minus RUN_LOCAL, in order of first appearance.

    Two finished runs of one group with the same seed are not two seeds. With the same results
    (timings aside) they are one computation twice (a copied folder, a re-run): the first is
    kept and ``(dropped, kept)`` appended to ``duplicates``. With different results there is no
    telling which one is right, so ConfigError names both folders.
    """
    groups: Dict[str, Group] = {}
    for r in runs:
        if r.state.status != "finished" or r.config is None:
            continue
        s = r.settings()
        key = json.dumps(s, sort_keys=True, default=str)
        group = groups.setdefault(key, Group(s))
        twin = next((o for o in group.runs if json.dumps(o.seed, default=str) == json.dumps(r.seed, default=str)),
                    None)
        if twin is None:
            group.runs.append(r)
            continue
        if json.dumps(_results(twin), sort_keys=True, default=str) != json.dumps(_results(r), sort_keys=True,
                                                                                  default=str):
            raise ConfigError(
                f"{twin.path} and {r.path} have the same settings and seed ({r.seed}) but different metrics, "
                f"so they are neither two seeds nor one run counted twice; move the wrong one out of the "
                f"folders passed to the report (or change its seed)")
        _warn(f"{r.path} repeats {twin.path} (same settings, seed {r.seed} and metrics): counted once")
        if duplicates is not None:
            duplicates.append((r, twin))
    return list(groups.values())


def varying_settings(groups: List[Group]) -> List[str]:
    """The settings that tell the groups apart, in order of first appearance."""
    keys: List[str] = []
    for g in groups:
        for k in g.settings:
            if k not in keys and len({json.dumps(h.settings.get(k), default=str) for h in groups}) > 1:
                keys.append(k)
    return keys


def shown_settings(groups: List[Group]) -> List[str]:
    """The settings a report names per row (its columns, labels and legends), in order of first
    appearance: each that takes more than one value over the rows, an option's default counting as
    its value (:meth:`Run.display`: ``mu: 0.01`` beside ``mu: 0.1``, not a blank); one that some rows
    set and others do not have (:func:`varying_settings`: FedMix's ``lam`` beside FedAvg, or an option
    written out at its default in config.yaml); and each axis the runs' sweep declares. An option of
    one method that no run sets and no sweep varies is not named (FedAvg's ``server_lr`` beside FedProx)."""
    displays = [g.display for g in groups]
    differ = set(varying_settings(groups))
    given = {k for g in groups for r in g.runs
             for k in flatten({k: v for k, v in (r.given or {}).items() if k not in RUN_LOCAL})}
    declared = {k for g in groups for r in g.runs for k in r.axes}
    keys: List[str] = []
    for d in displays:
        for k in d:
            if k in keys:
                continue
            values = {json.dumps(e[k], sort_keys=True, default=str) for e in displays if k in e}
            everywhere = all(k in e for e in displays)
            if len(values) > 1 or k in differ or k in declared or (k in given and not everywhere):
                keys.append(k)
    return keys


def sweep_point(run_dir: str, cache: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The point of ``run_dir``'s sweep (``SWEEP/runs/<id>`` listed in ``SWEEP/sweep.json``): its entry
    in the manifest, with the manifest itself under ``"sweep"``; None for a run of no sweep (or one
    whose manifest cannot be read: find_runs names that). ``cache``: manifests already read, by path."""
    run_dir = os.path.abspath(run_dir)
    parent = os.path.dirname(run_dir)
    if os.path.basename(parent) != "runs":
        return None
    path = os.path.join(os.path.dirname(parent), "sweep.json")
    if cache is not None and path in cache:
        sweep = cache[path]
    else:
        try:
            with open(path) as f:
                sweep = json.load(f)
        except (OSError, ValueError):
            sweep = None
        if cache is not None:
            cache[path] = sweep
    if not isinstance(sweep, dict) or not isinstance(sweep.get("points"), list):
        return None
    name = os.path.basename(run_dir)
    point = next((p for p in sweep["points"] if isinstance(p, dict) and str(p.get("id")) == name), None)
    return None if point is None else {**point, "sweep": sweep}


def _declared_axes(point: Optional[Dict[str, Any]]) -> List[str]:
    """The settings a sweep point's axes name, flattened as :meth:`Run.settings` are (an axis over a
    whole option mapping names each option its values set); not the seed (grouped over), a launch
    file (``config``: the settings it changes differ between rows anyway) or a RUN_LOCAL setting."""
    axes = (point or {}).get("axes")
    if not isinstance(axes, dict):
        return []
    out: List[str] = []
    for key, value in axes.items():
        if key == "config" or key.partition(".")[0] in RUN_LOCAL:
            continue
        names = list(flatten({key: value})) if isinstance(value, dict) else [key]
        out += [k for k in names if k not in out]
    return out


def load_runs(directory: str, as_frame: Optional[bool] = None) -> Any:
    """One row per run under ``directory`` (any depth: a sweep's folder, ``runs/``, one run's folder):

    * ``path`` (the run's folder), ``status`` (finished, interrupted, failed, damaged; a sweep's
      reading, :func:`fedhpc.sweep.state.run_state`) and ``rounds_done`` (its last logged round);
    * its settings as it ran them, option mappings flattened (``algo``, ``lr``, ``seed``,
      ``algo_options.mu``...; an option left at its default is there with the default the run used;
      ``model``, ``partition``, ``device``, ``threads`` as the run resolved them where it has a run.json);
    * the code that ran it (run.json): ``fedhpc_version``, ``commit``, ``dirty`` (None where unrecorded);
    * ``final_<metric>``: every number of its last record (the final evaluation: ``final_test_accuracy``,
      ``final_local_test_accuracy_mean``, ``final_bytes_up_total``...);
    * ``best_<metric>``: the highest value of each accuracy over its rounds (``best_test_accuracy``;
      the clients' local accuracies only over rounds that evaluated every client, as the report reads them).

    A run whose files cannot be read is left out with a warning (as the report does). Returns a
    pandas DataFrame when pandas is installed and ``as_frame`` is not False (``as_frame=True``
    requires it), else a list of dicts (rows lacking a column simply lack the key)."""
    from .summary import _numeric, is_sampled

    if not os.path.isdir(directory):
        raise ConfigError(f"{directory!r} is not a folder; pass a folder holding runs (e.g. runs/ or a sweep's folder)")
    runs, _ = find_runs([directory])
    rows = []
    for run in runs:
        row: Dict[str, Any] = {"path": run.path, "status": run.state.status, "rounds_done": run.state.last_round}
        config = resolve_autos(run.config, run.provenance, assumed=run.assumed)  # the model built, the device used...
        row.update(flatten({k: v for k, v in (config or {}).items() if k != "reference"}))
        code = (run.provenance or {}).get("fedhpc") or {}
        row.update({"fedhpc_version": code.get("version"), "commit": code.get("commit"), "dirty": code.get("dirty")})
        last = run.records[-1] if run.records else {}
        row.update({f"final_{k}": v for k, v in last.items() if k != "round" and _numeric(v)})
        accuracies = sorted({k for rec in run.records for k in rec if k.endswith("accuracy")})
        for m in accuracies:
            seen = [float(rec[m]) for rec in run.records if _numeric(rec.get(m)) and not is_sampled(m, rec)]
            if seen:
                row[f"best_{m}"] = max(seen)
        rows.append(row)
    if as_frame is False:
        return rows
    try:
        import pandas
    except ImportError:
        if as_frame:
            raise ImportError("load_runs(as_frame=True) needs pandas (pip install pandas); as_frame=False "
                              "returns the rows as a list of dicts") from None
        return rows
    return pandas.DataFrame(rows)
