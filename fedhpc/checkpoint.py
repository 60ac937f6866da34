"""Checkpoints: written atomically by all ranks together, validated before use.

Layout under ``OUT/checkpoints``::

    round_000010/server.pt            global state, algorithm server state, run identity (rank 0)
    round_000010/client_state/rank<r>/<cid>.pt   per-client state held by rank r (if any)
    round_000010/client_state/rank<r>/index.json its files' sizes and sha256
    round_000010/manifest.json        sha256 of server.pt, world size, written last
    LATEST                            name of the newest complete checkpoint (atomic replace)

A checkpoint directory is first written as ``round_N.partial`` and renamed only
when every rank has finished, so ``LATEST`` never names an incomplete one.

Resuming (:func:`load_latest_intact`) still checks what it reads: a checkpoint damaged
after it was written (a truncated copy, a disk error, a deleted shard) is skipped with a
warning in favour of the newest intact one among the ``KEEP`` kept; a checkpoint of a
*different run* (other settings) is refused outright, because it means ``--out`` points
at another experiment, not that a file broke.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .client_state import read_shard_index
from .config.identity import canonical_identity
from .errors import CheckpointError
from .io import atomic_torch_save, atomic_write_json, atomic_write_text

FORMAT = "fedhpc-checkpoint"
VERSION = 1
KEEP = 2
_NAME = re.compile(r"^round_(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


def _rounds(root: str) -> List[Tuple[int, str]]:
    """(round, name) of the complete checkpoint directories under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), d) for d in os.listdir(root) if (m := _NAME.match(d))]
    return sorted(found, reverse=True)


def _prune(root: str, round_done: int) -> None:
    """Keep the checkpoint just written and the KEEP-1 newest before it.

    Checkpoints of a *later* round are deleted too: they exist only when this run resumed
    from an older checkpoint past a corrupt newer one (or past one whose LATEST update a
    crash prevented), so they belong to a history the run has abandoned, and ordering by
    name would otherwise keep them and delete the fresh ones. Leftover ``.partial``
    directories of crashed saves go as well (every rank is past its writes here).
    """
    older = [d for r, d in _rounds(root) if r < round_done][: KEEP - 1]
    keep = {f"round_{round_done:06d}", *older}
    for d in os.listdir(root):
        if (_NAME.match(d) and d not in keep) or d.endswith(".partial"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def save(out: str, round_done: int, world, server: Dict[str, Any], client_store=None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    root = checkpoint_root(out)
    name = f"round_{round_done:06d}"
    final, partial = os.path.join(root, name), os.path.join(root, name + ".partial")
    if world.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    world.barrier()
    shards = 0
    if client_store is not None:
        client_store.save_shard(os.path.join(partial, "client_state", f"rank{world.rank}"))
        shards = world.size
    if world.rank == 0:
        body = dict(server, format=FORMAT, version=VERSION, round=round_done, world_size=world.size)
        atomic_torch_save(body, os.path.join(partial, "server.pt"))
    world.barrier()
    if world.rank == 0:
        atomic_write_json(os.path.join(partial, "manifest.json"), {
            "format": FORMAT, "version": VERSION, "round": round_done,
            "server_sha256": _sha256(os.path.join(partial, "server.pt")),
            "client_state_shards": shards,
            "client_state_index": True,  # each shard lists its files (client_state.SHARD_INDEX)
        })
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)  # made durable with LATEST's rename: one sync of root covers both
        atomic_write_text(os.path.join(root, "LATEST"), name + "\n")
        _prune(root, round_done)
    world.barrier()
    return final


def latest(out: str) -> Optional[str]:
    """The directory LATEST names (not checked), or None when there is no LATEST file."""
    path = os.path.join(checkpoint_root(out), "LATEST")
    if not os.path.exists(path):
        return None
    name = open(path).read().strip()
    return os.path.join(checkpoint_root(out), name)


class _Damaged(Exception):
    """A checkpoint whose files are missing or broken: skipped by the fallback."""


def _read(directory: str) -> Dict[str, Any]:
    """The server body of an intact checkpoint, with ``client_state_dirs`` filled in.

    Raises _Damaged (with the reason, naming the file) for anything a broken disk or an
    interrupted copy can cause, and CheckpointError for a checkpoint of another format
    version, which no fallback would cure.
    """
    manifest_path = os.path.join(directory, "manifest.json")
    server_path = os.path.join(directory, "server.pt")
    if not os.path.isdir(directory):
        raise _Damaged(f"{directory} does not exist")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise _Damaged(f"{manifest_path} is missing or unreadable ({e})")
    if manifest.get("format") != FORMAT:
        raise _Damaged(f"{manifest_path} is not a fedhpc checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_path} is a fedhpc checkpoint of format version {manifest.get('version')!r}, "
            f"this fedhpc reads version {VERSION}; resume with the fedhpc version that wrote it, or "
            f"use another --out")
    if not os.path.exists(server_path):
        raise _Damaged(f"{server_path} is missing")
    if _sha256(server_path) != manifest.get("server_sha256"):
        raise _Damaged(f"{server_path} is corrupt (its sha256 does not match manifest.json)")
    try:
        body = torch.load(server_path, map_location="cpu", weights_only=False)
    except Exception as e:  # unreadable pickle/zip despite a matching checksum
        raise _Damaged(f"{server_path} cannot be read ({e.__class__.__name__}: {e})")
    if not isinstance(body, dict):
        raise _Damaged(f"{server_path} does not hold a checkpoint body")
    shards = [os.path.join(directory, "client_state", f"rank{r}")
              for r in range(int(manifest.get("client_state_shards", 0)))]
    missing = [d for d in shards if not os.path.isdir(d)]
    if missing:
        raise _Damaged(f"client-state shard {missing[0]} is missing ({len(missing)} of {len(shards)} "
                       f"shards that manifest.json lists)")
    indexed = bool(manifest.get("client_state_index", False))  # False: saved before shards had one
    for shard in shards:  # every state file there, at its saved size (its sha256 is checked as it loads)
        try:
            read_shard_index(shard, indexed)
        except CheckpointError as e:
            raise _Damaged(str(e))
    body["client_state_dirs"] = shards
    body["client_state_indexed"] = indexed
    return body


IDENTITY_FILE = "identity.json"
#: the settings that are mappings of a method's, dataset's, model's or channel's own options
OPTION_MAPPINGS = ("algo_options", "data_options", "model_options", "channel_options")
#: the key of IDENTITY_FILE (not part of the identity) holding OPTION_MAPPINGS as the run read them,
#: every default filled in by the code that ran it: the report groups runs by these, so that a run
#: made before a default changed is not averaged with runs made after it
OPTIONS_AS_RUN = "options_as_run"


def recorded_identity(out: str) -> Optional[Dict[str, Any]]:
    """The identity the run in ``out`` was made with: its :data:`IDENTITY_FILE`; for a run written
    before the engine wrote one, the identity its LATEST checkpoint holds (every finished run with
    --out checkpoints its last round); None when neither can be read (a run without either is
    taken as made under today's rules, as it always was). A hand-broken IDENTITY_FILE raises
    CheckpointError naming it and the fix."""
    path = os.path.join(out, IDENTITY_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                identity = json.load(f)
            if not isinstance(identity, dict):
                raise ValueError(f"holds {type(identity).__name__}, not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be read ({e}); the engine writes it at the start of a run: "
                                  f"delete it to have the run's checkpoint read instead, or delete {out} to run "
                                  f"it again")
        return identity
    directory = latest(out)
    if directory is None:
        return None
    try:  # mmap: the identity without reading the model's tensors
        body = torch.load(os.path.join(directory, "server.pt"), map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - missing or damaged: a resume finds out and says so
        return None
    identity = body.get("identity") if isinstance(body, dict) else None
    return identity if isinstance(identity, dict) else None


def _run_settings() -> set:
    from .config import RunConfig

    return {f.name for f in dataclasses.fields(RunConfig)}


def _unrecorded_settings(directory: str, saved: Dict[str, Any], now: Dict[str, Any]) -> Dict[str, Any]:
    """The run settings that ``now`` (today's identity) holds and the checkpoint's ``saved`` lacks,
    as the run that wrote it had them. Such a key entered the identity after the checkpoint was
    written (pMixFed's ``rounds``, since its schedule was guarded), so the checkpoint cannot say;
    the run's config.yaml can: the engine rewrites it at the start of every attempt, after this
    check, so it holds the settings of the attempt that wrote the newest checkpoint. A setting
    that config.yaml lacks too did not exist then: the run had its default. Without config.yaml
    the setting is left out, and the comparison names it (``checkpoint None``)."""
    from .config import setting_default
    from .sweep.state import read_config

    missing = [k for k in now if k not in saved and k in _run_settings()]
    if not missing:
        return {}
    try:
        written = read_config(os.path.dirname(os.path.dirname(os.path.normpath(directory))))  # OUT/checkpoints/round_N
    except CheckpointError:  # unreadable: the refusal names what is missing
        return {}
    if written is None:
        return {}
    return {k: json.loads(json.dumps(written.get(k, setting_default(k)), default=str)) for k in missing}


def _without_options_checked_by_state(identity: Dict[str, Any]) -> Dict[str, Any]:
    """A canonical ``identity`` without the algorithm options whose field says ``checked_by_state``:
    the algorithm compares those with its checkpointed state (load_state_dict), which can tell what
    a checkpoint from before the option ran with (pMixFed numbered its layers from 0), where the
    identity would fill that checkpoint's ``{}`` with today's default and refuse the one value it
    resumes under. Only a resume leaves them out: the report and a paper reference still tell
    runs of different values apart."""
    from .registry import ALGORITHMS

    options_class = ALGORITHMS.get(identity["algo"]).Options if identity.get("algo") in ALGORITHMS else None
    if options_class is None or not isinstance(identity.get("algo_options"), dict):
        return identity
    checked = {f.name for f in dataclasses.fields(options_class) if f.metadata.get("checked_by_state")}
    return {**identity, "algo_options": {k: v for k, v in identity["algo_options"].items() if k not in checked}}


def _check_identity(directory: str, body: Dict[str, Any], identity: Dict[str, Any],
                    auto_means: Optional[Dict[str, str]] = None) -> None:
    recorded = dict(body.get("identity") or {})
    recorded.update(_unrecorded_settings(directory, recorded, identity))
    saved, now = (_without_options_checked_by_state(canonical_identity(i, auto_means)) for i in (recorded, identity))
    if saved != now:
        diffs = []
        for k in sorted(set(saved) | set(now)):
            a, b = saved.get(k), now.get(k)
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):  # name the options that differ, not the mappings
                diffs += [f"{k}.{o}: checkpoint {a.get(o)!r} vs now {b.get(o)!r}"
                          for o in sorted(set(a) | set(b)) if a.get(o) != b.get(o)]
            elif k not in recorded:  # written before the identity held it
                where = (" nor by the run's config.yaml beside checkpoints/ (missing or unreadable)"
                         if k in _run_settings() else "")
                diffs.append(f"{k}: not recorded by the checkpoint (it predates that record){where} vs now {b!r}")
            else:
                diffs.append(f"{k}: checkpoint {a!r} vs now {b!r}")
        raise CheckpointError(
            f"checkpoint {directory} belongs to a different run ({'; '.join(diffs)}); resume with "
            f"the original settings, or use another --out for the new run")


def load(directory: str, identity: Dict[str, Any], auto_means: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Read and validate one checkpoint; refuse corrupt or mismatched ones with a clear message."""
    fix = (f"delete {os.path.dirname(directory)} to start afresh, or point --out at the run "
           f"this checkpoint belongs to")
    try:
        body = _read(directory)
    except _Damaged as e:
        raise CheckpointError(f"checkpoint {directory} is corrupt: {e}; {fix}")
    _check_identity(directory, body, identity, auto_means)
    return body


def _print_to_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _candidates(out: str) -> Tuple[List[str], List[str]]:
    """Checkpoint directories to try, best first, and problems with LATEST itself.

    LATEST's directory comes first (it is the newest *complete* one by construction);
    then every other ``round_N`` directory, newest round first.
    """
    root = checkpoint_root(out)
    names = [d for _, d in _rounds(root)]
    problems: List[str] = []
    first: Optional[str] = None
    latest_path = os.path.join(root, "LATEST")
    if os.path.exists(latest_path):
        try:
            with open(latest_path) as f:
                first = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{latest_path} is unreadable ({e})")
        if first is not None and first not in names:
            problems.append(f"{latest_path} names {first!r}, which is not a checkpoint directory in {root}")
            first = None
    elif names:
        problems.append(f"{latest_path} is missing")
    order = ([first] if first else []) + [d for d in names if d != first]
    return [os.path.join(root, d) for d in order], problems


def _choose(out: str, identity: Dict[str, Any], auto_means: Optional[Dict[str, str]] = None):
    """This rank's verdict: ("none",), ("use", directory, body, damaged) or ("error", message)."""
    candidates, problems = _candidates(out)
    if not candidates and not problems:
        return ("none",)
    damaged = list(problems)
    for directory in candidates:
        try:
            body = _read(directory)
        except _Damaged as e:
            damaged.append(str(e))
            continue
        except CheckpointError as e:
            return ("error", str(e))
        try:
            _check_identity(directory, body, identity, auto_means)
        except CheckpointError as e:
            return ("error", str(e))
        return ("use", directory, body, damaged)
    root = checkpoint_root(out)
    return ("error",
            f"no intact checkpoint in {root}: {'; '.join(damaged)}. Restore those files (e.g. from "
            f"a backup), or move {root} away and run again to start afresh from round 0")


def load_latest_intact(
    out: str,
    identity: Dict[str, Any],
    warn: Optional[Callable[[str], None]] = _print_to_stderr,
    world=None,
    auto_means: Optional[Dict[str, str]] = None,
) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(directory, body) of the newest intact checkpoint of this run, or None if there is none.

    Tries LATEST's checkpoint, then the other kept ones, newest first. A damaged one
    (manifest missing or unreadable, server.pt missing, sha256 mismatch or unreadable, a
    client-state shard directory the manifest lists missing) is skipped, and ``warn`` gets
    one message naming every skipped one and the one used. CheckpointError when every kept
    checkpoint is damaged, or when the first intact one was written with other settings
    (``identity`` differs): that is refused, never skipped, since it means --out holds
    another run. ``auto_means``: what a setting left at 'auto' stands for in this run
    (see :func:`canonical_identity`).

    With a multi-rank ``world`` every rank must call it: only rank 0 warns, and the ranks
    compare their verdicts (one object all-gather) so that they either all resume from the
    same checkpoint or all raise the same error, instead of diverging or hanging when they
    see different files (e.g. node-local disks).
    """
    verdict = _choose(out, identity, auto_means)
    if world is not None and getattr(world, "size", 1) > 1:
        # Compare checkpoint names, not paths: ranks agree when they pick the same round.
        summary = verdict[:2] if verdict[0] != "use" else ("use", os.path.basename(verdict[1]))
        every = world.all_gather_object(summary)
        errors = [v[1] for v in every if v[0] == "error"]
        if errors:
            raise CheckpointError(errors[0])
        if any(v != every[0] for v in every):
            raise CheckpointError(
                f"the ranks see different checkpoints in {checkpoint_root(out)} "
                f"({', '.join(f'rank {r}: {v[-1]}' for r, v in enumerate(every))}); --out must be on "
                f"a file system every rank shares")
    if verdict[0] == "error":
        raise CheckpointError(verdict[1])
    if verdict[0] == "none":
        return None
    _, directory, body, damaged = verdict
    if damaged and warn is not None and (world is None or getattr(world, "rank", 0) == 0):
        warn(f"skipping damaged checkpoint data: {'; '.join(damaged)}. Resuming from {directory} "
             f"(round {body.get('round')}), the newest intact checkpoint of this run")
    return directory, body
