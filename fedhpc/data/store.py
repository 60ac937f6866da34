"""A per-client HDF5 store: thousands of clients per rank without holding them in memory.

Why: the in-memory path (:class:`~fedhpc.data.base.ArrayFederatedData`) keeps the
whole training pool in every rank. With FEMNIST, ImageNet subsets or 10,000+
clients that multiplies memory by the number of ranks per node. The store writes
each client's rows contiguously once, so a rank reads exactly the clients it
trains this round (one contiguous read per array) and nothing else.

Layout (one file, all datasets contiguous, no compression, so a client is a
single ``pread`` per array)::

    train/x        (N_train, *input_shape)  stored dtype (uint8 images, uint8 char ids)
    train/y        (N_train, *target_shape) int64 labels / uint8 char ids
    train/offsets  (num_clients + 1,) int64: client k owns rows offsets[k]:offsets[k+1]
    client_test/{x, y, offsets}             each client's local test split, same scheme
    test/{x, y}                             the global test set
    attrs: fedhpc_store (format version), meta (JSON of what the store was built from),
           name, num_classes, task, default_model

Every client's rows are split into a local train and a local test part exactly as
:class:`ArrayFederatedData` does (same seeded shuffle, same rounding), so the HDF5
and in-memory paths hand out identical :class:`ClientData` (tests check this).

Building is done once and reused: the file name carries a hash of the metadata
(dataset, partition, clients, seed, content options, source file sizes), the file
is written to a temporary name and ``os.replace``-d into place (readers never see
a half-written store), and concurrent builders on one node serialise on a lock
file so only one does the work.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..io import durable_replace
from .base import BatchTransform, ClientData, FederatedData, local_split_rng, split_local
from .formats import open_h5_readonly

STORE_FORMAT = 2  # 2: classes:K became a random draw; stores of the old cyclic deal are rebuilt


# --------------------------------------------------------------------------- client sources


class ArrayClients:
    """Clients given as row-index arrays into a pool (numpy array or h5py dataset).

    ``parts[k]`` are the (sorted) rows of client k. Used both for a partitioned
    training pool and, with contiguous blocks, to stream a global test set.
    """

    def __init__(self, x, y, parts: Sequence[np.ndarray]):
        if getattr(parts, "server_indices", None) is not None:
            # A store holds clients only, and its identity (meta) does not include the server
            # set: writing the carved clients would hand them to later runs without the carve.
            raise ConfigError("the server's own base set (server_* data options) is kept in memory only and "
                              "cannot go into an HDF5 client store; add --data-opt store=memory")
        self.x, self.y = x, y
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self.counts = np.array([len(p) for p in self.parts], dtype=np.int64)
        self.x_tail, self.x_dtype = tuple(x.shape[1:]), np.dtype(x.dtype)
        self.y_tail, self.y_dtype = tuple(y.shape[1:]), np.dtype(y.dtype)

    @classmethod
    def blocks(cls, x, y, block_rows: int = 4096) -> "ArrayClients":
        n = int(x.shape[0])
        return cls(x, y, [np.arange(a, min(a + block_rows, n)) for a in range(0, n, block_rows)])

    def load(self, k: int) -> Tuple[np.ndarray, np.ndarray]:
        idx = self.parts[k]
        return gather_rows(self.x, idx), gather_rows(self.y, idx)


class StreamedClients:
    """Clients read one at a time by a callable (e.g. one TFF HDF5 group per writer)."""

    def __init__(self, counts, load: Callable[[int], Tuple[np.ndarray, np.ndarray]],
                 x_tail, x_dtype, y_tail=(), y_dtype=np.int64):
        self.counts = np.asarray(counts, dtype=np.int64)
        self._load = load
        self.x_tail, self.x_dtype = tuple(x_tail), np.dtype(x_dtype)
        self.y_tail, self.y_dtype = tuple(y_tail), np.dtype(y_dtype)

    def load(self, k: int):
        return self._load(k)


def gather_rows(src, idx: np.ndarray) -> np.ndarray:
    """``src[idx]`` for any ``idx`` (any order, repeats); reads an h5py dataset by runs of rows.

    h5py refuses unsorted or repeated fancy indices and reads a point selection row by
    row, so rows are read as slices: one for a contiguous ``idx``, one per run of
    consecutive rows for a sorted one. Any other ``idx`` reads its distinct rows that
    way, in sorted order, and is put in order in memory.
    """
    if isinstance(src, np.ndarray):
        return src[idx]
    idx = np.asarray(idx, dtype=np.int64)
    if len(idx) == 0:
        return np.empty((0,) + tuple(src.shape[1:]), dtype=src.dtype)
    steps = np.diff(idx)
    if np.any(steps <= 0):
        # Unsorted or repeated: [0, 2, 1, 3] spans 4 rows without being rows 0..3, and a
        # permuted client read run by run would cost one slice per row.
        rows, where = np.unique(idx, return_inverse=True)
        return gather_rows(src, rows)[where.reshape(-1)]
    breaks = np.flatnonzero(steps != 1) + 1
    if len(breaks) == 0:  # one contiguous run
        return src[int(idx[0]):int(idx[-1]) + 1]
    return np.concatenate([src[int(r[0]):int(r[-1]) + 1] for r in np.split(idx, breaks)])


# --------------------------------------------------------------------------- writing


def write_store(
    path: str,
    clients,
    test,
    *,
    meta: Dict[str, Any],
    name: str,
    num_classes: int,
    task: str = "classification",
    default_model: str = "mlp",
    client_test_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = False,
) -> None:
    """Write a store at ``path`` (not atomic by itself: see :func:`open_or_build_store`).

    ``clients`` and ``test`` are sources with ``counts``, ``x_tail``/``x_dtype``,
    ``y_tail``/``y_dtype`` and ``load(k) -> (x, y)``; ``test`` is concatenated into
    the global test set. Sizes are known upfront, so every dataset is allocated
    contiguous and filled client by client: memory is one client at a time.
    """
    import h5py

    if not 0.0 <= client_test_fraction < 1.0:
        raise DataError(f"client_test_fraction must be in [0, 1), got {client_test_fraction}")
    counts = [int(c) for c in clients.counts]
    n_local_test = [int(c * client_test_fraction) for c in counts]
    train_off = np.concatenate([[0], np.cumsum([c - t for c, t in zip(counts, n_local_test)])]).astype(np.int64)
    ltest_off = np.concatenate([[0], np.cumsum(n_local_test)]).astype(np.int64)
    n_global = int(np.sum(test.counts))
    if test.x_tail != clients.x_tail:
        raise DataError(f"test inputs have shape {test.x_tail}, training inputs {clients.x_tail}")
    rng = local_split_rng(seed)
    with h5py.File(path, "w") as f:
        def make(group, n, x_tail, x_dtype, y_tail, y_dtype):
            g = f.require_group(group)
            return (g.create_dataset("x", shape=(n,) + x_tail, dtype=x_dtype),
                    g.create_dataset("y", shape=(n,) + y_tail, dtype=y_dtype))

        trx, try_ = make("train", int(train_off[-1]), clients.x_tail, clients.x_dtype, clients.y_tail, clients.y_dtype)
        ltx, lty = make("client_test", int(ltest_off[-1]), clients.x_tail, clients.x_dtype, clients.y_tail, clients.y_dtype)
        f["train"].create_dataset("offsets", data=train_off)
        f["client_test"].create_dataset("offsets", data=ltest_off)
        tx, ty = make("test", n_global, test.x_tail, test.x_dtype, test.y_tail, test.y_dtype)

        bar = Progress(len(counts), "writing client store") if progress else None
        for k, n in enumerate(counts):
            x, y = clients.load(k)
            if len(x) != n or len(y) != n or tuple(x.shape[1:]) != clients.x_tail:
                raise DataError(
                    f"client {k} was announced with {n} samples of shape {clients.x_tail} but loaded "
                    f"{len(x)} of shape {tuple(x.shape[1:])}; the source files changed while being read"
                )
            tr, te = split_local(n, client_test_fraction, rng, k)
            a, b = int(train_off[k]), int(train_off[k + 1])
            if b > a:
                trx[a:b] = x[tr]
                try_[a:b] = y[tr]
            a, b = int(ltest_off[k]), int(ltest_off[k + 1])
            if b > a:
                ltx[a:b] = x[te]
                lty[a:b] = y[te]
            if bar:
                bar.update(k + 1)
        pos = 0
        for k in range(len(test.counts)):
            x, y = test.load(k)
            tx[pos:pos + len(x)] = x
            ty[pos:pos + len(y)] = y
            pos += len(x)
        if pos != n_global:
            raise DataError(f"global test set announced {n_global} samples, {pos} were read")
        if bar:
            bar.close()
        f.attrs["fedhpc_store"] = STORE_FORMAT
        f.attrs["meta"] = canonical_json(meta)
        f.attrs["name"] = name
        f.attrs["num_classes"] = int(num_classes)
        f.attrs["task"] = task
        f.attrs["default_model"] = default_model


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def store_file_name(meta: Dict[str, Any]) -> str:
    """``<dataset>-<hash of metadata>.h5``: different partitions/seeds get different stores."""
    digest = hashlib.sha256(canonical_json(meta).encode()).hexdigest()[:16]
    return f"{meta.get('dataset', 'data')}-{digest}.h5"


@contextlib.contextmanager
def _exclusive_lock(lock_path: str):
    """Serialise builders of one store (ranks of a node; ranks of several nodes where the
    file system supports flock). Where locking is unsupported, builders race harmlessly:
    each writes its own temporary file and the atomic replace keeps one complete copy."""
    fd = None
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
    except (OSError, ImportError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the flock


def read_store_meta(path: str) -> Optional[Dict[str, Any]]:
    """The metadata of an existing, complete store, or None (missing, foreign or unreadable)."""
    if not os.path.isfile(path):
        return None
    try:
        with open_h5_readonly(path) as f:
            if int(f.attrs.get("fedhpc_store", -1)) != STORE_FORMAT:
                return None
            return json.loads(f.attrs["meta"])
    except (OSError, KeyError, ValueError):
        return None


def open_or_build_store(
    path: str,
    meta: Dict[str, Any],
    build: Callable[[str], None],
    transform: Optional[BatchTransform] = None,
) -> "HDF5ClientStore":
    """Open the store at ``path`` if its metadata equals ``meta``; else build it once.

    ``build(tmp_path)`` must write a complete store (usually via :func:`write_store`
    with this ``meta``); it is moved into place with ``os.replace`` only when done.
    """
    meta = json.loads(canonical_json(meta))  # normalise (tuples -> lists, key order)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create the client-store folder {folder} ({e}); set the dataset option "
            f"store_dir=DIR to a writable folder (e.g. node-local scratch), or store=memory"
        )
    if read_store_meta(path) == meta:
        return HDF5ClientStore(path, transform)
    with _exclusive_lock(path + ".lock"):
        existing = read_store_meta(path)
        if existing == meta:  # another rank built it while we waited
            return HDF5ClientStore(path, transform)
        if existing is not None:
            print(f"fedhpc: rebuilding client store {path}: it was built from different settings",
                  file=sys.stderr)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            if read_store_meta(tmp) != meta:
                raise DataError(f"the store written to {tmp} does not carry the expected metadata")
            durable_replace(tmp, path)
        except OSError as e:
            raise DataError(
                f"cannot write the client store {path} ({e}); set the dataset option store_dir=DIR "
                f"to a writable folder with enough space, or store=memory"
            )
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return HDF5ClientStore(path, transform)


# --------------------------------------------------------------------------- reading


class HDF5ClientStore(FederatedData):
    """A :class:`FederatedData` that reads clients from a store on demand.

    Construction reads only the attributes and the two offset vectors (16 bytes
    per client). :meth:`client` reads that client's rows and nothing else. The
    file is opened lazily and reopened whenever the process id changes, so an
    instance survives ``fork`` and pickling (to workers or other ranks) and any
    number of processes can read one store concurrently.
    """

    def __init__(self, path: str, transform: Optional[BatchTransform] = None):
        self.path = os.path.abspath(path)
        self._h5 = None
        self._pid: Optional[int] = None
        self._datasets: Dict[str, Any] = {}
        if transform is not None:
            self.transform = transform
        f = self._file()
        try:
            if int(f.attrs.get("fedhpc_store", -1)) != STORE_FORMAT:
                raise KeyError("fedhpc_store")
            self.meta = json.loads(f.attrs["meta"])
            self.name = str(f.attrs["name"])
            self.num_classes = int(f.attrs["num_classes"])
            self.task = str(f.attrs["task"])
            self._default_model = str(f.attrs["default_model"])
            self._train_off = np.asarray(f["train/offsets"][()], dtype=np.int64)
            self._ltest_off = np.asarray(f["client_test/offsets"][()], dtype=np.int64)
            self.input_shape = tuple(int(s) for s in f["train/x"].shape[1:])
            self._num_test = int(f["test/y"].shape[0])
        except KeyError as e:
            raise DataError(
                f"{self.path} is not a fedhpc client store of format {STORE_FORMAT} (missing {e}); "
                f"delete it and it will be rebuilt from the dataset files"
            )
        self._sizes = np.diff(self._train_off)

    # -- file handling ------------------------------------------------------------
    def _file(self):
        pid = os.getpid()
        if self._h5 is None or self._pid != pid:
            # After a fork the inherited handle belongs to the parent: open our own.
            try:
                self._h5 = open_h5_readonly(self.path)
            except OSError as e:
                raise DataError(f"cannot open client store {self.path} ({e}); delete it to rebuild it")
            self._pid = pid
            self._datasets = {}
        return self._h5

    def _rows(self, name: str, start: int, stop: int) -> np.ndarray:
        f = self._file()
        ds = self._datasets.get(name)
        if ds is None:
            ds = self._datasets[name] = f[name]
        out = np.empty((stop - start,) + tuple(ds.shape[1:]), dtype=ds.dtype)
        if stop > start:
            ds.read_direct(out, source_sel=np.s_[start:stop])
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_h5=None, _pid=None, _datasets={})
        return state

    def close(self) -> None:
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._h5, self._pid, self._datasets = None, None, {}

    # -- FederatedData ------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self._sizes)

    def client_sizes(self) -> np.ndarray:
        return self._sizes

    def client(self, cid: int) -> ClientData:
        x_test, y_test = self.client_test_split(cid)  # which also says when the client does not exist
        a, b = int(self._train_off[cid]), int(self._train_off[cid + 1])
        return ClientData(cid, torch.from_numpy(self._rows("train/x", a, b)),
                          torch.from_numpy(self._rows("train/y", a, b)).long(), x_test, y_test)

    def client_test_split(self, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= cid < self.num_clients:
            raise DataError(f"client {cid} does not exist; the store has clients 0..{self.num_clients - 1}")
        return self.client_test_rows([cid])

    def client_test_sizes(self) -> np.ndarray:
        return np.diff(self._ltest_off)

    def client_test_rows(self, cids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        # the clients' test rows lie in client order: a run of consecutive clients is one read
        runs: List[Tuple[int, int]] = []
        for c in (int(c) for c in cids):
            a, b = int(self._ltest_off[c]), int(self._ltest_off[c + 1])
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        if not runs:
            runs = [(0, 0)]
        xs = [self._rows("client_test/x", a, b) for a, b in runs]
        ys = [self._rows("client_test/y", a, b) for a, b in runs]
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)).long()

    def num_test(self) -> int:
        return self._num_test

    def test_slice(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        start, stop, _ = slice(start, stop).indices(self._num_test)
        stop = max(start, stop)
        return (torch.from_numpy(self._rows("test/x", start, stop)),
                torch.from_numpy(self._rows("test/y", start, stop)).long())

    def default_model(self) -> str:
        return self._default_model


def build_store_from_arrays(
    path: str,
    meta: Dict[str, Any],
    x_pool,
    y_pool,
    x_test,
    y_test,
    partition: Sequence[np.ndarray],
    *,
    name: str,
    num_classes: int,
    client_test_fraction: float = 0.2,
    seed: int = 0,
    task: str = "classification",
    default_model: str = "mlp",
    transform: Optional[BatchTransform] = None,
) -> HDF5ClientStore:
    """Build (once) and open a store holding ``partition`` of a pool: the HDF5 twin of
    ``ArrayFederatedData(name, x_pool, y_pool, x_test, y_test, partition, ...)``."""
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in partition]

    def build(tmp: str) -> None:
        write_store(
            tmp, ArrayClients(x_pool, y_pool, parts), ArrayClients.blocks(x_test, y_test), meta=meta,
            name=name, num_classes=num_classes, task=task, default_model=default_model,
            client_test_fraction=client_test_fraction, seed=seed,
        )

    return open_or_build_store(path, meta, build, transform)


# --------------------------------------------------------------------------- progress


class Progress:
    """A dependency-free progress bar on stderr (redrawn at most every percent)."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label = max(int(total), 1), label
        self.stream = stream or sys.stderr
        self._last = -1

    def update(self, done: int) -> None:
        pct = int(100 * done / self.total)
        if pct == self._last:
            return
        self._last = pct
        filled = pct * 30 // 100
        self.stream.write(f"\r{self.label}: [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


__all__: List[str] = [
    "ArrayClients", "StreamedClients", "HDF5ClientStore", "write_store", "open_or_build_store",
    "build_store_from_arrays", "store_file_name", "read_store_meta", "split_local", "Progress",
]
