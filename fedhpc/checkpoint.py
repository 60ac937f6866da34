"""Checkpoints: written atomically by all ranks together, validated before use.

Layout under ``OUT/checkpoints``::

    round_000010/server.pt            global state, algorithm server state, run identity (rank 0)
    round_000010/client_state/rank<r>/<cid>.pt   per-client state held by rank r (if any)
    round_000010/manifest.json        sha256 of server.pt, world size, written last
    LATEST                            name of the newest complete checkpoint (atomic replace)

A checkpoint directory is first written as ``round_N.partial`` and renamed only
when every rank has finished, so ``LATEST`` never names an incomplete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Dict, Optional

import torch

from .errors import CheckpointError
from .io import atomic_torch_save, atomic_write_json, atomic_write_text

FORMAT = "fedhpc-checkpoint"
VERSION = 1
KEEP = 2


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


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
        })
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(os.path.join(root, "LATEST"), name + "\n")
        older = sorted(d for d in os.listdir(root) if d.startswith("round_") and not d.endswith(".partial"))
        for d in older[:-KEEP]:
            if d != name:
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    world.barrier()
    return final


def latest(out: str) -> Optional[str]:
    path = os.path.join(checkpoint_root(out), "LATEST")
    if not os.path.exists(path):
        return None
    name = open(path).read().strip()
    return os.path.join(checkpoint_root(out), name)


def load(directory: str, identity: Dict[str, Any]) -> Dict[str, Any]:
    """Read and validate a checkpoint; refuse corrupt or mismatched ones with a clear message."""
    fix = (f"delete {os.path.dirname(directory)} to start afresh, or point --out at the run "
           f"this checkpoint belongs to")
    manifest_path = os.path.join(directory, "manifest.json")
    server_path = os.path.join(directory, "server.pt")
    try:
        manifest = json.load(open(manifest_path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory} has no readable manifest.json ({e}); {fix}")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{manifest_path} is not a fedhpc v{VERSION} checkpoint; {fix}")
    if not os.path.exists(server_path) or _sha256(server_path) != manifest.get("server_sha256"):
        raise CheckpointError(
            f"checkpoint {server_path} is corrupt (missing, or its sha256 does not match manifest.json); {fix}")
    try:
        body = torch.load(server_path, map_location="cpu", weights_only=False)
    except Exception as e:  # unreadable pickle/zip despite checksum: still refuse clearly
        raise CheckpointError(f"checkpoint {server_path} cannot be read ({e}); {fix}")
    if body.get("identity") != identity:
        saved, now = body.get("identity") or {}, identity
        diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}"
                 for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        raise CheckpointError(
            f"checkpoint {directory} belongs to a different run ({'; '.join(diffs)}); resume with "
            f"the original settings, or use another --out for the new run")
    body["client_state_dirs"] = [os.path.join(directory, "client_state", f"rank{r}")
                                 for r in range(manifest.get("client_state_shards", 0))]
    return body
