"""IDX files (MNIST, Fashion-MNIST, EMNIST), gzipped or plain, told by content."""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from typing import Tuple

import numpy as np

from ...errors import DataError
from .published import Published, integer_labels, malformed, missing


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
