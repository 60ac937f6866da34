"""Per-client state kept across rounds (personal heads, MOON's previous model, Ditto's model...).

Which rank trains a client changes from round to round, so the store tracks where
each client's latest state lives. Because client sampling and the client-to-rank
assignment are deterministic and replicated, every rank knows that location map
without asking anyone; at the start of a round, states whose client moved are
shipped from the old rank to the new one, point to point (``World.send_objects``).

Each rank keeps its states in memory up to a byte budget (least recently used
first out) and spills the rest to ``spill_dir/rank<r>/<cid>.pt``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .errors import CheckpointError
from .io import atomic_write_json, write_synced

#: each checkpoint shard's list of client-state files: {cid: {"bytes": n, "sha256": hex}}
SHARD_INDEX = "index.json"


def read_shard_index(directory: str, indexed: bool = True) -> Dict[int, Optional[Dict[str, Any]]]:
    """The client-state files a checkpoint shard holds, checked to exist with their saved size.

    Raises CheckpointError naming the first problem (the caller decides whether an older
    checkpoint can stand in). ``indexed=False``: a checkpoint saved before shards had an index
    (the manifest says which); its ``<cid>.pt`` files are taken as they are.
    """
    if not indexed:
        return {int(fn[:-3]): None for fn in os.listdir(directory) if re.fullmatch(r"\d+\.pt", fn)}
    path = os.path.join(directory, SHARD_INDEX)
    try:
        with open(path) as f:
            index = {int(cid): entry for cid, entry in json.load(f).items()}
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is missing or unreadable ({e})")
    for cid, entry in index.items():
        file = os.path.join(directory, f"{cid}.pt")
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size is None:
            raise CheckpointError(f"client state {file} is missing ({len(index)} files listed in {path})")
        if size != entry.get("bytes"):
            raise CheckpointError(f"client state {file} has {size} bytes, {entry.get('bytes')} when saved "
                                  f"(truncated or overwritten)")
    return index


def state_nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 64


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class ClientStateStore:
    def __init__(self, world, budget_bytes: int, spill_dir: str):
        self.world = world
        self.budget = int(budget_bytes)
        self.spill_dir = os.path.join(spill_dir, f"rank{world.rank}")
        self.location: Dict[int, int] = {}      # cid -> rank holding its latest state (replicated)
        self._mem: "OrderedDict[int, Any]" = OrderedDict()
        self._mem_bytes = 0
        self._spilled: set = set()
        self.spills = 0
        self._closed = False

    # ---------------------------------------------------------------- local access
    def get(self, cid: int) -> Optional[Any]:
        if cid in self._mem:
            self._mem.move_to_end(cid)
            return self._mem[cid]
        if cid in self._spilled:
            state = self._read_spilled(cid)
            self._drop_spilled(cid)
            self._insert(cid, state)
            return state
        return None

    def put(self, cid: int, state: Any) -> None:
        self.pop(cid)
        self._insert(cid, _to_cpu(state))

    # A client's state is a dict of named slots, so the algorithm ("algo": what
    # ctx.save_state keeps) and the engine ("device_model": the model a device kept
    # after a downlink outage) can both keep something for the same client.
    def get_slot(self, cid: int, slot: str, default: Any = None) -> Any:
        state = self.get(cid)
        return default if state is None or slot not in state else state[slot]

    def put_slot(self, cid: int, slot: str, value: Any) -> None:
        """Set (or, with None, drop) one slot of client ``cid``'s state; copies only ``value``."""
        state = self.pop(cid) or {}
        if value is None:
            state.pop(slot, None)
        else:
            state[slot] = _to_cpu(value)
        if state:
            self._insert(cid, state)

    def pop(self, cid: int) -> Optional[Any]:
        if cid in self._mem:
            state = self._mem.pop(cid)
            self._mem_bytes -= state_nbytes(state)
            return state
        if cid in self._spilled:
            state = self._read_spilled(cid)
            self._drop_spilled(cid)
            return state
        return None

    def held(self) -> List[int]:
        return sorted(set(self._mem) | self._spilled)

    def items(self) -> Iterator[Tuple[int, Any]]:
        """All states this rank holds, one at a time (spilled ones are read, not re-cached)."""
        for cid in self.held():
            yield cid, (self._mem[cid] if cid in self._mem else self._read_spilled(cid))

    @property
    def memory_bytes(self) -> int:
        return self._mem_bytes

    def _insert(self, cid: int, state: Any) -> None:
        self._mem[cid] = state
        self._mem_bytes += state_nbytes(state)
        while self._mem_bytes > self.budget and len(self._mem) > 1:
            old, s = self._mem.popitem(last=False)
            self._mem_bytes -= state_nbytes(s)
            # Scratch, not output: a spill file never outlives the run (checkpoints copy it
            # into their own shard), so skip the atomic write's fsync, which dominated
            # spilling at 10k personal clients.
            os.makedirs(self.spill_dir, exist_ok=True)
            torch.save(s, self._spill_path(old))
            self._spilled.add(old)
            self.spills += 1

    def _read_spilled(self, cid: int) -> Any:
        if self._closed:
            # spill files are scratch, removed when the run ends (close): say so, not FileNotFoundError
            raise RuntimeError(
                f"client {cid}'s state was spilled to disk and deleted when the run ended; read client "
                f"states before Engine.run() returns, from the checkpoint a run with --out writes after its "
                f"last round, or keep them in memory with a larger --client-state-budget-mb")
        return torch.load(self._spill_path(cid), weights_only=False)

    def _spill_path(self, cid: int) -> str:
        return os.path.join(self.spill_dir, f"{cid}.pt")

    def _drop_spilled(self, cid: int) -> None:
        self._spilled.discard(cid)
        try:
            os.unlink(self._spill_path(cid))
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------- collective steps
    def migrate(self, assignment: Dict[int, int]) -> int:
        """Move states so that every client in ``assignment`` (cid -> rank) is held by its rank.

        Collective only when some state moves; the decision is the same on every rank.
        Returns the number of states moved.
        """
        moves = {cid: (self.location[cid], dst) for cid, dst in assignment.items()
                 if cid in self.location and self.location[cid] != dst}
        if moves and self.world.size > 1:
            outgoing: Dict[int, Dict[int, Any]] = {}
            for cid, (src, dst) in moves.items():
                if src == self.world.rank:
                    outgoing.setdefault(dst, {})[cid] = self.pop(cid)
            for parcel in self.world.send_objects(outgoing).values():
                for cid, state in parcel.items():
                    if state is not None:
                        self._insert(cid, state)
        self.location.update(assignment)
        return len(moves)

    def save_shard(self, directory: str) -> int:
        """Write every held state to ``directory/<cid>.pt`` (bounded memory: one at a time), then
        ``directory/index.json``: each file's size and sha256, so that a resume finds a state
        file deleted, truncated or damaged after the save (the checkpoint is then skipped for an
        older intact one) instead of silently restarting that client from scratch."""
        os.makedirs(directory, exist_ok=True)
        index = {}
        for cid in self.held():
            path = os.path.join(directory, f"{cid}.pt")
            if cid in self._mem:
                buffer = io.BytesIO()
                torch.save(self._mem[cid], buffer)
                data = buffer.getvalue()
            else:
                with open(self._spill_path(cid), "rb") as f:
                    data = f.read()
            write_synced(path, data)  # the index's sync covers the names, this the contents
            index[str(cid)] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        atomic_write_json(os.path.join(directory, SHARD_INDEX), index)
        return len(index)

    def load_shards(self, shard_dirs: List[str], indexed: bool = True) -> None:
        """Restore from checkpoint shards written by any number of ranks.

        Shard s goes to rank s % world_size; the location map is rebuilt collectively. Only the
        files the shard's index lists are read, each checked against its sha256.
        """
        self._mem.clear(); self._mem_bytes = 0
        for cid in list(self._spilled):
            self._drop_spilled(cid)
        mine, failure = [], None
        try:
            for s, d in enumerate(shard_dirs):
                if s % self.world.size != self.world.rank:
                    continue
                for cid, entry in sorted(read_shard_index(d, indexed).items()):
                    path = os.path.join(d, f"{cid}.pt")
                    with open(path, "rb") as f:
                        data = f.read()
                    if entry is not None and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                        raise CheckpointError(
                            f"client state {path} is corrupt (its sha256 does not match {SHARD_INDEX}); "
                            f"move {os.path.dirname(os.path.dirname(d))} away to resume from the "
                            f"checkpoint before it, or restore the file")
                    self._insert(cid, torch.load(io.BytesIO(data), weights_only=False))
                    mine.append(cid)
        except Exception as e:  # on this rank alone: the others must not wait in the gather
            failure = e
        gathered = self.world.all_gather_object(None if failure is not None else mine)
        if any(cids is None for cids in gathered):
            self.world.raise_together(failure, "restoring the client states")
        self.location = {}
        for r, cids in enumerate(gathered):
            self.location.update({c: r for c in cids})

    def close(self) -> None:
        """Delete the spill files; states held in memory stay readable."""
        self._closed = True
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.spill_dir))  # the shared parent, once every rank is done
        except OSError:
            pass
