"""One-off dataset preparation that is too slow to do at the start of every run.

``python -m fedhpc.data.prepare imagenet200 --src DIR --out FILE.h5 --size 256 --seed 0``

reads an ImageNet-style tree (``DIR/train/<wnid>/*.JPEG``, ``DIR/val/<wnid>/*.JPEG``),
chooses ``--num-classes`` (default 200) classes with a seeded draw (as FedAlign
builds its ImageNet-200), resizes every image (shorter side to ``--size``, then a
centre crop to ``size x size``) and writes one HDF5 file that the ``imagenet200``
dataset reads. ``--size 256`` (the default) feeds FedAlign's 224-px pipeline
(RandomResizedCrop 224 in training, the central 224x224 in test; about 51 GB for
200 classes); ``--size 64`` feeds the quick 64-px variant (about 3 GB)::

    train/x (N, 3, S, S) uint8   train/y (N,) int64
    val/x   (M, 3, S, S) uint8   val/y   (M,) int64
    classes (C,) str             the chosen wnids; label i = classes[i]
    attrs: format, num_classes, size, seed, source

Decoding runs in ``--workers`` processes; images are written in batches, so memory
stays at a batch. The file is written under a temporary name and moved into place
when complete, so an interrupted run leaves no half-written file behind.
Pillow is needed only here (``pip install Pillow``).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError, FedHPCError
from ..io import durable_replace
from .formats import IMAGENET, list_image_folder
from .store import Progress

#: the ``format`` attribute the imagenet200 reader checks
PREPARED_FORMAT = "fedhpc-image-subset"
_WRITE_BATCH = 256


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DataError(
            "preparing an image dataset needs Pillow, which is not installed; install it with "
            "`pip install Pillow` (it is listed in requirements.txt)"
        )
    return Image


def choose_classes(available: Sequence[str], num_classes: int, seed: int) -> List[str]:
    """A seeded draw of ``num_classes`` class names from the sorted available ones, returned sorted."""
    available = sorted(available)
    if not 1 <= num_classes <= len(available):
        raise DataError(
            f"cannot choose {num_classes} classes: the source tree has {len(available)} class folders "
            f"present in both train/ and val/; lower --num-classes"
        )
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(available), size=num_classes, replace=False)
    return sorted(available[i] for i in picked)


def load_resized(path: str, size: int) -> np.ndarray:
    """One image -> uint8 (3, size, size): shorter side resized to ``size``, centre crop."""
    Image = _pillow()
    try:
        with Image.open(path) as img:
            img.draft("RGB", (size * 2, size * 2))  # JPEG: decode at a reduced scale, much faster
            img = img.convert("RGB")
            w, h = img.size
            scale = size / min(w, h)
            nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
            img = img.resize((nw, nh), Image.BICUBIC)
            left, top = (nw - size) // 2, (nh - size) // 2
            img = img.crop((left, top, left + size, top + size))
            arr = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot decode image {path} ({e}); remove or replace the file and run again")
    return arr.transpose(2, 0, 1).copy()


def _load_task(args: Tuple[str, int]) -> np.ndarray:
    return load_resized(*args)


def _write_split(f, name: str, files: List[Tuple[str, int]], size: int, workers: int, label: str) -> None:
    x = f.create_dataset(f"{name}/x", shape=(len(files), 3, size, size), dtype=np.uint8)
    f.create_dataset(f"{name}/y", data=np.array([c for _, c in files], dtype=np.int64))
    bar = Progress(len(files), label)
    tasks = [(p, size) for p, _ in files]
    pool = None
    if workers > 1 and len(files) > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn" if sys.platform == "darwin" else "fork").Pool(workers)
        images = pool.imap(_load_task, tasks, chunksize=16)
    else:
        images = map(_load_task, tasks)
    try:
        buf = np.empty((min(_WRITE_BATCH, max(len(files), 1)), 3, size, size), dtype=np.uint8)
        start = filled = 0
        for i, img in enumerate(images):
            buf[filled] = img
            filled += 1
            if filled == len(buf) or i == len(files) - 1:
                x[start:start + filled] = buf[:filled]
                start += filled
                filled = 0
                bar.update(start)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    bar.close()


def prepare_image_subset(
    src: str, out: str, size: int = 256, seed: int = 0, num_classes: int = 200, workers: int = 1
) -> List[str]:
    """Write the subset file (see module docstring); returns the chosen class names."""
    import h5py

    _pillow()
    if size < 1:
        raise DataError(f"--size must be positive, got {size}")
    train = list_image_folder(os.path.join(src, "train"), IMAGENET)
    val = list_image_folder(os.path.join(src, "val"), IMAGENET)
    common = sorted(set(train) & set(val))
    classes = choose_classes(common, num_classes, seed)
    files = {
        split: [(p, label) for label, c in enumerate(classes) for p in tree[c]]
        for split, tree in (("train", train), ("val", val))
    }
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with h5py.File(tmp, "w") as f:
            for split in ("train", "val"):
                _write_split(f, split, files[split], size, workers, f"{split} ({len(classes)} classes)")
            f.create_dataset("classes", data=np.array(classes, dtype=object), dtype=h5py.string_dtype())
            f.attrs.update(format=PREPARED_FORMAT, num_classes=len(classes), size=size, seed=seed,
                           source=os.path.abspath(src))
        durable_replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return classes


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhpc.data.prepare", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="dataset", required=True)
    p = sub.add_parser("imagenet200", help="seeded class subset of an ImageNet-style tree -> one HDF5 file")
    p.add_argument("--src", required=True, help="folder holding train/<wnid>/*.JPEG and val/<wnid>/*.JPEG")
    p.add_argument("--out", required=True, help="HDF5 file to write (e.g. <data_dir>/imagenet200.h5)")
    p.add_argument("--size", type=int, default=256,
                   help="output side length in pixels (default 256, for the 224-px crops of FedAlign's pipeline; "
                        "64 for the quick variant)")
    p.add_argument("--seed", type=int, default=0, help="seed of the class choice (default 0)")
    p.add_argument("--num-classes", type=int, default=200, help="classes to keep (default 200)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="decoding processes (default: min(8, cores))")
    args = parser.parse_args(argv)
    try:
        classes = prepare_image_subset(args.src, args.out, args.size, args.seed, args.num_classes, args.workers)
    except FedHPCError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {args.out}: {len(classes)} classes, {args.size}x{args.size}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
