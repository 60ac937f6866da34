"""TensorFlow Federated HDF5 files (``examples/<client_id>/<field>``), read one client at a time."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from ...errors import DataError
from .published import Published, malformed, missing


def open_h5_readonly(path: str):
    """Open an HDF5 file read-only without POSIX file locking.

    Locking is off because many ranks (and forked workers) open the same file at
    once on shared file systems where HDF5's locks either fail or serialise readers;
    the files are never written while being read (stores are replaced atomically).
    """
    import h5py

    try:
        return h5py.File(path, "r", locking=False)
    except TypeError:  # pragma: no cover - h5py < 3.5 has no locking argument
        os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
        return h5py.File(path, "r")


class TFFClientFile:
    """A TensorFlow Federated HDF5 file: ``examples/<client_id>/<field>`` datasets.

    Listing clients reads only the group index; :meth:`num_examples` reads one
    dataset's shape; :meth:`read_client` reads one client's arrays. The file is
    opened on first use and reopened after a fork, so an instance can be created in
    a parent process and used in workers.
    """

    def __init__(self, path: str, fields: Sequence[str], published: Published, what: str):
        self.path = path
        self.fields = tuple(fields)
        self.published = published
        self.what = what
        self._h5 = None
        self._pid = None
        self._ids: Optional[List[str]] = None
        layout = self.layout()
        if not os.path.isfile(path):
            raise missing(what, path, layout, published,
                          "extract the archive into the dataset folder (or set the dataset's 'dir' option)")

    def layout(self) -> str:
        return "TFF HDF5 layout examples/<client_id>/" + " + ".join(self.fields)

    def _file(self):
        if self._h5 is None or self._pid != os.getpid():
            try:
                self._h5 = open_h5_readonly(self.path)
            except OSError as e:
                raise malformed(self.path, f"cannot be opened as HDF5 ({e})", self.layout(), self.published)
            self._pid = os.getpid()
            if "examples" not in self._h5:
                raise malformed(self.path, "has no 'examples' group", self.layout(), self.published)
        return self._h5

    def client_ids(self) -> List[str]:
        """All client ids, sorted (h5py lists group members in name order; sorting makes it explicit)."""
        if self._ids is None:
            self._ids = sorted(self._file()["examples"].keys())
        return list(self._ids)

    def _dataset(self, cid: str, field: str):
        group = self._file()["examples"].get(cid)
        if group is None:
            raise DataError(f"{self.path} has no client {cid!r} under examples/")
        ds = group.get(field)
        if ds is None:
            raise malformed(self.path, f"client {cid!r} has no dataset {field!r} (has {sorted(group.keys())})",
                            self.layout(), self.published)
        return ds

    def num_examples(self, cid: str) -> int:
        return int(self._dataset(cid, self.fields[0]).shape[0])

    def read_client(self, cid: str) -> Dict[str, np.ndarray]:
        out = {field: self._dataset(cid, field)[()] for field in self.fields}
        n = {f: len(a) for f, a in out.items()}
        if len(set(n.values())) > 1:
            raise malformed(self.path, f"client {cid!r} has fields of different lengths {n}",
                            self.layout(), self.published)
        return out

    def close(self) -> None:
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._h5 = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decode_strings(values: np.ndarray, where: str = "", published: Optional[Published] = None) -> List[str]:
    """h5py variable-length strings come back as bytes (or str); return str.

    Anything else (numbers, say) is refused with a DataError naming ``where``: ``str(v)`` would
    turn it into text that reads like data."""
    out = []
    for v in np.asarray(values, dtype=object).ravel():
        if isinstance(v, (bytes, np.bytes_)):
            out.append(v.decode("utf-8", errors="replace"))
        elif isinstance(v, str):
            out.append(v)
        else:
            source = f" ({published.where()})" if published is not None else ""
            raise DataError(f"{where or 'the dataset'} holds {type(v).__name__} values ({v!r}) where byte strings "
                            f"are expected; the file is not in the published layout{source}")
    return out
