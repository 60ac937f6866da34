"""Readers for datasets in the formats they are published in (pure numpy / h5py / json).

fedhpc never downloads anything: users keep the datasets on disk exactly as they
are distributed, and these functions read them. Every missing or malformed file
raises :class:`~fedhpc.errors.DataError` naming the path that was expected, the
layout it must have, and where the dataset is published, so that a user on a
cluster without internet knows what to fetch and where to put it.

Formats:

* IDX (MNIST, Fashion-MNIST, EMNIST), gzipped or plain (told by content): :func:`find_idx`, :func:`read_idx`.
* CIFAR-10 / CIFAR-100 "python version" pickles: :func:`read_cifar10`, :func:`read_cifar100`.
  They are unpickled with an allow-list of globals (numpy array reconstruction
  only), so a tampered file cannot run code.
* TensorFlow Federated HDF5 (``examples/<client_id>/<field>``): :class:`TFFClientFile`,
  which lists clients cheaply and reads one client at a time.
* LEAF JSON (``users``, ``num_samples``, ``user_data``): :func:`iter_leaf_users`.
* An ImageNet-style folder tree (``<split>/<wnid>/*.JPEG``): :func:`list_image_folder`.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError


@dataclass(frozen=True)
class Published:
    """Where a dataset is distributed, quoted in every error about its files."""

    title: str
    url: str

    def where(self) -> str:
        return f"{self.title} is published at {self.url}"


MNIST = Published("MNIST", "http://yann.lecun.com/exdb/mnist/")
FASHION_MNIST = Published("Fashion-MNIST", "https://github.com/zalandoresearch/fashion-mnist")
EMNIST = Published(
    "EMNIST", "https://www.nist.gov/itl/products-and-services/emnist-dataset (gzip.zip, IDX files)"
)
CIFAR10 = Published("CIFAR-10", "https://www.cs.toronto.edu/~kriz/cifar.html (cifar-10-python.tar.gz)")
CIFAR100 = Published("CIFAR-100", "https://www.cs.toronto.edu/~kriz/cifar.html (cifar-100-python.tar.gz)")
TFF_EMNIST = Published(
    "TFF federated EMNIST", "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2"
)
TFF_EMNIST_DIGITS = Published(
    "TFF federated EMNIST (digits only)",
    "https://storage.googleapis.com/tff-datasets-public/fed_emnist_digitsonly.tar.bz2",
)
TFF_CIFAR100 = Published(
    "TFF federated CIFAR-100", "https://storage.googleapis.com/tff-datasets-public/fed_cifar100.tar.bz2"
)
TFF_SHAKESPEARE = Published(
    "TFF Shakespeare", "https://storage.googleapis.com/tff-datasets-public/shakespeare.tar.bz2"
)
LEAF_FEMNIST = Published(
    "LEAF FEMNIST", "https://github.com/TalwalkarLab/leaf (data/femnist, produced by ./preprocess.sh)"
)
LEAF_SHAKESPEARE = Published(
    "LEAF Shakespeare", "https://github.com/TalwalkarLab/leaf (data/shakespeare, produced by ./preprocess.sh)"
)
IMAGENET = Published(
    "ImageNet (ILSVRC2012)",
    "https://image-net.org/download.php (train/ and val/ with one folder per class wnid)",
)


def missing(what: str, expected: str, layout: str, published: Published, fix: str = "") -> DataError:
    """The one shape of a 'file not found' error: what, the expected path, its layout, its source."""
    msg = f"{what} not found: expected {expected} ({layout}; {published.where()})"
    if fix:
        msg += f"; {fix}"
    return DataError(msg)


def malformed(path: str, problem: str, layout: str, published: Published) -> DataError:
    return DataError(
        f"{path} is not a valid {layout} file: {problem}; replace it with an intact copy "
        f"({published.where()})"
    )


def _first_non_integer(values: np.ndarray):
    """The first value that is not a whole number (bools, strings, None, 1.7, NaN), else None."""
    for v in values.ravel().tolist():
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            return v
    return None


def integer_labels(labels, where: str, published: Published) -> np.ndarray:
    """Class labels as int64, refusing what the cast would silently change or choke on.

    ``astype(int64)`` truncates 1.7 to 1 and raises a bare ValueError on strings; a label that is
    not a whole number means the file is corrupt or from another dataset, so it is named instead.
    Whole numbers stored as floats (1.0) are exact and accepted.
    """
    arr = np.asarray(labels)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    bad = _first_non_integer(arr)
    if bad is None:
        return arr.astype(np.int64)
    raise DataError(
        f"{where} has a label {bad!r} ({type(bad).__name__}); labels are whole-number class ids, so the file "
        f"is corrupt or from another dataset: replace it with an intact copy ({published.where()})"
    )


# --------------------------------------------------------------------------- IDX

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def find_idx(directory: str, stem: str, what: str, published: Published) -> str:
    """Path of ``<directory>/<stem>`` or ``<directory>/<stem>.gz``, whichever exists (plain first)."""
    plain = os.path.join(directory, stem)
    for candidate in (plain, plain + ".gz"):
        if os.path.isfile(candidate):
            return candidate
    raise missing(
        what, plain + "[.gz]", "IDX format", published,
        "set --data-dir to the folder that holds it (or the dataset's 'dir' option to the folder itself)",
    )


def _idx_layout(path: str) -> str:
    """'gzipped IDX' or 'IDX', told by the first two bytes (gzip's 1f 8b; IDX starts with 00 00), not by
    the name: browsers often decompress a .gz download and keep its name, and a copy may lose the suffix.
    (:func:`find_idx` still looks for both names.)"""
    with open(path, "rb") as f:
        return "gzipped IDX" if f.read(2) == b"\x1f\x8b" else "IDX"


def _open_idx(path: str, layout: str):
    return gzip.open(path, "rb") if layout == "gzipped IDX" else open(path, "rb")


def read_idx_header(path: str, published: Published) -> Tuple[Tuple[int, ...], np.dtype]:
    """(dims, dtype) from an IDX header alone: sizes a dataset without reading its pixels."""
    layout = "IDX"
    try:
        layout = _idx_layout(path)
        with _open_idx(path, layout) as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
                raise malformed(path, f"bad magic number {head.hex() or '(empty file)'}, expected "
                                f"0000<type><ndim>", layout, published)
            raw = f.read(4 * head[3])
    except (OSError, EOFError, zlib.error) as e:
        raise malformed(path, f"cannot be read ({e})", layout, published)
    if head[3] == 0 or len(raw) < 4 * head[3]:
        raise malformed(path, f"header declares {head[3]} dimensions but is truncated", layout, published)
    return struct.unpack(f">{head[3]}I", raw), np.dtype(_IDX_DTYPES[head[2]])


def read_idx(path: str, published: Published) -> np.ndarray:
    """Read one IDX file (gzipped ones decompressed on the fly, whatever their name) into a
    native-endian array.

    The magic number (two zero bytes, a type code, the number of dimensions) and the
    payload length are checked, so a truncated download or an HTML error page saved
    under the right name is reported instead of silently producing garbage.
    """
    layout = "IDX"
    try:
        layout = _idx_layout(path)
        with _open_idx(path, layout) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise malformed(path, f"cannot be read ({e})", layout, published)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise malformed(
            path, f"bad magic number {data[:4].hex() or '(empty file)'}, expected 0000<type><ndim>",
            layout, published,
        )
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise malformed(path, f"header declares {ndim} dimensions but is truncated", layout, published)
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise malformed(
            path, f"dimensions {tuple(dims)} need {expected} bytes of data but the file holds "
            f"{len(data) - header} (truncated or corrupt download)", layout, published,
        )
    arr = np.frombuffer(data, dtype=dtype, count=int(np.prod(dims)), offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx_images_labels(
    directory: str, images_stem: str, labels_stem: str, what: str, published: Published
) -> Tuple[np.ndarray, np.ndarray]:
    """An images file (N, H, W) uint8 and its labels file (N,) as (x, int64 y)."""
    img_path = find_idx(directory, images_stem, f"{what} images", published)
    lab_path = find_idx(directory, labels_stem, f"{what} labels", published)
    x = read_idx(img_path, published)
    y = read_idx(lab_path, published)
    if x.ndim != 3 or x.dtype != np.uint8:
        raise malformed(img_path, f"expected uint8 images of shape (N, H, W), got {x.dtype} {x.shape}",
                        "IDX image", published)
    if y.ndim != 1:
        raise malformed(lab_path, f"expected a 1-d label vector, got shape {y.shape}", "IDX label", published)
    if len(x) != len(y):
        raise DataError(
            f"{img_path} holds {len(x)} images but {lab_path} holds {len(y)} labels; the two files "
            f"belong to different downloads, fetch both again ({published.where()})"
        )
    return x, integer_labels(y, lab_path, published)  # IDX may store float labels (type 0x0D/0x0E)


# --------------------------------------------------------------------------- CIFAR pickles


def _resolve_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _resolve_frombuffer():
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.numeric import _frombuffer
    return _frombuffer


# The only globals a CIFAR batch needs: numpy array/dtype reconstruction, plus
# _codecs.encode, which protocol-2 pickles written by Python 3 use for bytes.
_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _resolve_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _resolve_reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _resolve_frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _resolve_frombuffer,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: codecs.encode,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global except numpy array reconstruction."""

    def find_class(self, module, name):
        resolve = _PICKLE_ALLOWED.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return resolve()


def read_cifar_batch(path: str, label_key: str, published: Published) -> Tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch -> (uint8 images (N, 3, 32, 32), int64 labels (N,)).

    The batches are Python 2 pickles of a dict with byte-string keys (``b'data'``:
    uint8 (N, 3072) rows holding the R, G and B planes, ``b'labels'`` or
    ``b'fine_labels'``/``b'coarse_labels'``: lists of ints).
    """
    layout = "CIFAR python pickle batch"
    if not os.path.isfile(path):
        raise missing(f"{published.title} batch", path, "python pickle batch", published,
                      "extract the python version archive into --data-dir")
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # any unpickling failure means the file is not a CIFAR batch
        raise malformed(path, f"cannot be unpickled ({type(e).__name__}: {e})", layout, published)
    if not isinstance(batch, dict):
        raise malformed(path, f"holds a {type(batch).__name__}, expected a dict", layout, published)
    batch = {(k.decode("latin-1") if isinstance(k, bytes) else k): v for k, v in batch.items()}
    for key in ("data", label_key):
        if key not in batch:
            raise malformed(path, f"has no {key!r} entry (keys: {sorted(batch)})", layout, published)
    data = np.asarray(batch["data"])
    try:
        labels = np.asarray(batch[label_key])
    except ValueError as e:  # ragged nested lists
        raise malformed(path, f"{label_key!r} is not a list of class ids ({e})", layout, published)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise malformed(path, f"'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}",
                        layout, published)
    if labels.ndim != 1 or len(labels) != len(data):
        raise malformed(path, f"{len(data)} images but {labels.shape} labels", layout, published)
    return data.reshape(-1, 3, 32, 32).copy(), integer_labels(labels, f"{path} ({label_key!r})", published)


def read_cifar10(root: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``<root>/data_batch_1..5`` and ``<root>/test_batch`` -> (x_train, y_train, x_test, y_test)."""
    names = [f"data_batch_{i}" for i in range(1, 6)]
    for name in names + ["test_batch"]:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise missing(
                "CIFAR-10 batch", path, "CIFAR-10 python version: data_batch_1..5 and test_batch", CIFAR10,
                "extract cifar-10-python.tar.gz into --data-dir (it creates cifar-10-batches-py/)",
            )
    parts = [read_cifar_batch(os.path.join(root, n), "labels", CIFAR10) for n in names]
    x_test, y_test = read_cifar_batch(os.path.join(root, "test_batch"), "labels", CIFAR10)
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return x, y, x_test, y_test


def read_cifar100(root: str, label: str = "fine") -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``<root>/train`` and ``<root>/test`` with ``fine_labels`` (100) or ``coarse_labels`` (20)."""
    for name in ("train", "test"):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise missing(
                "CIFAR-100 batch", path, "CIFAR-100 python version: files train and test", CIFAR100,
                "extract cifar-100-python.tar.gz into --data-dir (it creates cifar-100-python/)",
            )
    key = f"{label}_labels"
    x, y = read_cifar_batch(os.path.join(root, "train"), key, CIFAR100)
    x_test, y_test = read_cifar_batch(os.path.join(root, "test"), key, CIFAR100)
    return x, y, x_test, y_test


# --------------------------------------------------------------------------- TFF HDF5


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


# --------------------------------------------------------------------------- LEAF JSON


def leaf_json_files(root: str, split: str, published: Published) -> List[str]:
    """The ``*.json`` files of ``<root>/<split>/`` in name order (LEAF writes several per split)."""
    folder = os.path.join(root, split)
    # the folder is a path, not a pattern: .../exp[1]/femnist would otherwise match only .../exp1/femnist
    files = sorted(glob.glob(os.path.join(glob.escape(folder), "*.json")))
    if not files:
        raise missing(
            f"{published.title} {split} split", os.path.join(folder, "*.json"),
            "LEAF JSON: {users, num_samples, user_data: {user: {x, y}}}", published,
            "copy LEAF's data/<dataset>/data/train and test folders into the dataset folder",
        )
    return files


def _named(users: List, most: int = 3) -> str:
    """The first few users, quoted, and how many more."""
    shown = ", ".join(repr(u) for u in users[:most])
    return shown + (f" and {len(users) - most} more" if len(users) > most else "")


def _check_leaf_users(path: str, users: list, user_data: dict, counts: Optional[list],
                      published: Published) -> None:
    """LEAF writes ``users``, ``num_samples`` and ``user_data`` in step, one entry per user each; a file
    where they disagree is refused, where reading it would drop the users ``users`` leaves out, pair
    counts with the wrong users, or read a repeated user twice. ``num_samples`` may be absent (it
    only restates the lengths of ``y``)."""
    problems = []
    if counts is not None and len(counts) != len(users):
        problems.append(f"'num_samples' has {len(counts)} entries but 'users' has {len(users)}")
    listed, repeated, absent = set(), [], []
    for user in users:  # a user that is not a string (JSON keys are) has no entry either
        if not isinstance(user, str) or user not in user_data:
            absent.append(user)
        elif user in listed:
            repeated.append(user)
        else:
            listed.add(user)
    unlisted = [u for u in user_data if u not in listed]
    if absent:
        problems.append(f"'users' lists user(s) {_named(absent)} with no 'user_data' entry")
    if unlisted:
        problems.append(f"'user_data' holds user(s) {_named(unlisted)} not listed in 'users'")
    if repeated:
        problems.append(f"'users' lists user(s) {_named(list(dict.fromkeys(repeated)))} more than once")
    if problems:
        raise malformed(path, "; ".join(problems) + " (LEAF writes one 'users' entry, one 'num_samples' count "
                        "and one 'user_data' entry per user)", "LEAF JSON", published)


def iter_leaf_users(root: str, split: str, published: Published,
                    with_path: bool = False) -> Iterator[Tuple[str, list, list]]:
    """Yield ``(user, x, y)`` for every user of every json file of a LEAF split
    (``(user, x, y, path)`` with ``with_path``, so that callers checking the values can name the file).

    Files are parsed one at a time, so peak memory is one file's worth of Python lists. The
    structure is checked here (users a list, user_data a mapping, the two and num_samples one entry
    per user each, x and y lists of one length); what the values must be is the dataset's business.
    """
    layout = "LEAF JSON"
    for path in leaf_json_files(root, split, published):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise malformed(path, f"cannot be parsed as JSON ({e})", layout, published)
        if not isinstance(doc, dict) or "users" not in doc or "user_data" not in doc:
            keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise malformed(path, f"needs keys 'users' and 'user_data', has {keys}", layout, published)
        users, user_data, counts = doc["users"], doc["user_data"], doc.get("num_samples")
        for key, value, want in (("users", users, list), ("user_data", user_data, dict),
                                 ("num_samples", counts, (list, type(None)))):
            if not isinstance(value, want):
                kind = "a mapping {user: {x, y}}" if want is dict else "a list"
                raise malformed(path, f"'{key}' must be {kind}, got {type(value).__name__}", layout, published)
        _check_leaf_users(path, users, user_data, counts, published)
        for i, user in enumerate(users):
            data = user_data[user]
            if not isinstance(data, dict) or "x" not in data or "y" not in data:
                raise malformed(path, f"user {user!r}: its user_data entry is not a mapping with 'x' and 'y'",
                                layout, published)
            x, y = data["x"], data["y"]
            for field, value in (("x", x), ("y", y)):
                if not isinstance(value, list):
                    raise malformed(path, f"user {user!r}: '{field}' must be a list of samples, got "
                                    f"{type(value).__name__}", layout, published)
            if len(x) != len(y):
                raise malformed(path, f"user {user!r} has {len(x)} inputs but {len(y)} targets", layout, published)
            if counts is not None and counts[i] != len(y):
                raise malformed(path, f"num_samples says user {user!r} has {counts[i]} samples, user_data "
                                f"holds {len(y)}", layout, published)
            yield (str(user), x, y, path) if with_path else (str(user), x, y)


# --------------------------------------------------------------------------- image folders

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")


def list_image_folder(split_dir: str, published: Published = IMAGENET) -> Dict[str, List[str]]:
    """``<split_dir>/<class>/*.JPEG`` -> {class: sorted image paths}, classes sorted.

    Only the directory tree is read (no image is opened), so listing ImageNet's
    1.28M training files costs seconds.
    """
    layout = "one sub-folder per class (wnid) holding .JPEG files"
    if not os.path.isdir(split_dir):
        raise missing("image folder", split_dir, layout, published)
    classes: Dict[str, List[str]] = {}
    loose = 0
    with os.scandir(split_dir) as entries:
        for entry in entries:
            if entry.is_dir():
                files = sorted(
                    os.path.join(entry.path, f) for f in os.listdir(entry.path)
                    if f.lower().endswith(IMAGE_EXTENSIONS)
                )
                if files:
                    classes[entry.name] = files
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                loose += 1
    if not classes:
        hint = (f"it holds {loose} images directly; sort them into <wnid>/ folders (for ILSVRC2012 val, "
                f"use the ground-truth labels, e.g. with the common valprep.sh script)") if loose else \
            "it holds no class folders with images"
        raise DataError(f"{split_dir} does not have the expected layout <class>/<image>.JPEG: {hint} "
                        f"({published.where()})")
    return dict(sorted(classes.items()))
