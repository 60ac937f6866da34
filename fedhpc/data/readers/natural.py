"""Readers of naturally federated datasets: TFF HDF5 and LEAF JSON (FEMNIST, CIFAR-100 TFF, Shakespeare)."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...errors import ConfigError, DataError
from .. import register_dataset
from ..augment import token_ids
from ..formats import (
    LEAF_FEMNIST, LEAF_SHAKESPEARE, Published, TFFClientFile, TFF_CIFAR100, TFF_EMNIST, TFF_EMNIST_DIGITS,
    TFF_SHAKESPEARE, decode_strings, integer_labels, iter_leaf_users, leaf_json_files,
)
from ..store import ArrayClients, StreamedClients
from .common import (
    CIFAR100_STATS, EMNIST_STATS, NaturalReader, SHAKESPEARE_VOCAB, checked_options, assemble, char_sequences,
    check_labels, encode_chars, image_transform, pixels_to_uint8, require_data_dir,
)
from .options import Cifar100TffOptions, FemnistOptions, ShakespeareOptions


# --------------------------------------------------------------------------- natural datasets


class TFFNaturalReader(NaturalReader):
    """Writers are the clients of a TFF HDF5 train file; the test file is the global test set."""

    train_name = test_name = ""
    tff_fields: Tuple[str, ...] = ()
    tff_published: Published = TFF_EMNIST

    def __init__(self, cfg, opts, root: str):
        super().__init__(cfg, opts)
        self.root = root
        self.train = TFFClientFile(os.path.join(root, self.train_name), self.tff_fields, self.tff_published,
                                   f"{self.tff_published.title} training file")
        self.test = TFFClientFile(os.path.join(root, self.test_name), self.tff_fields, self.tff_published,
                                  f"{self.tff_published.title} test file")
        self._counts: Optional[np.ndarray] = None

    def source_files(self) -> List[str]:
        return [self.train.path, self.test.path]

    def test_files(self) -> List[str]:
        return [self.test.path]

    def writer_counts(self) -> np.ndarray:
        if self._counts is None:
            self._counts = np.array([self.train.num_examples(c) for c in self.train.client_ids()], dtype=np.int64)
        return self._counts

    def convert(self, arrays: Dict[str, np.ndarray], where: str) -> Tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def load_writer(self, k: int):
        cid = self.train.client_ids()[k]
        return self.convert(self.train.read_client(cid), f"{self.train.path} client {cid!r}")

    def test_source(self):
        ids = self.test.client_ids()
        counts = [self.test.num_examples(c) for c in ids]

        def load(k):
            return self.convert(self.test.read_client(ids[k]), f"{self.test.path} client {ids[k]!r}")

        return StreamedClients(counts, load, self.x_tail, self.x_dtype, self.y_tail, self.y_dtype)

    def close(self) -> None:
        self.train.close()
        self.test.close()


def _shape_error(where: str, what: str, got, fed: Published) -> DataError:
    return DataError(f"{where}: expected {what}, got {got}; the file is not in the published layout ({fed.where()})")


class FemnistTFF(TFFNaturalReader):
    name = "femnist"
    tff_fields = ("pixels", "label")
    x_tail = (1, 28, 28)

    def __init__(self, cfg, opts, root):
        digits = opts.only_digits
        self.train_name = "fed_emnist_digitsonly_train.h5" if digits else "fed_emnist_train.h5"
        self.test_name = "fed_emnist_digitsonly_test.h5" if digits else "fed_emnist_test.h5"
        self.tff_published = TFF_EMNIST_DIGITS if digits else TFF_EMNIST
        self.num_classes = 10 if digits else 62
        super().__init__(cfg, opts, root)

    def convert(self, a, where):
        p, y = a["pixels"], integer_labels(a["label"], f"{where} ('label')", self.tff_published)
        if p.ndim != 3 or p.shape[1:] != (28, 28):
            raise _shape_error(where, "pixels of shape (n, 28, 28)", p.shape, self.tff_published)
        check_labels(y, self.num_classes, where, self.tff_published)
        return pixels_to_uint8(p, self.opts.invert, f"{where} ('pixels')", self.tff_published)[:, None], y

    def transform(self):
        return image_transform(self.opts, EMNIST_STATS)


class Cifar100TFF(TFFNaturalReader):
    name = "cifar100_tff"
    train_name, test_name = "fed_cifar100_train.h5", "fed_cifar100_test.h5"
    tff_published = TFF_CIFAR100
    x_tail = (3, 32, 32)

    def __init__(self, cfg, opts, root):
        self.num_classes = 20 if opts.coarse else 100
        self.tff_fields = ("image", "coarse_label" if opts.coarse else "label")
        super().__init__(cfg, opts, root)

    def convert(self, a, where):
        img, y = a["image"], integer_labels(a[self.tff_fields[1]], f"{where} ({self.tff_fields[1]!r})",
                                            self.tff_published)
        if img.ndim != 4 or img.shape[1:] != (32, 32, 3) or img.dtype != np.uint8:
            raise _shape_error(where, "uint8 images of shape (n, 32, 32, 3)", f"{img.dtype} {img.shape}",
                               self.tff_published)
        check_labels(y, self.num_classes, where, self.tff_published)
        return np.ascontiguousarray(img.transpose(0, 3, 1, 2)), y

    def transform(self):
        return image_transform(self.opts, CIFAR100_STATS)


class CachedNaturalReader(NaturalReader):
    """Writers parsed once into memory (LEAF JSON, Shakespeare text): small once converted."""

    def __init__(self, cfg, opts):
        super().__init__(cfg, opts)
        self._writers: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None
        self._test: Optional[Tuple[np.ndarray, np.ndarray]] = None

    def parse(self) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], Tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def _ensure(self):
        if self._writers is None:
            self._writers, self._test = self.parse()

    def writer_counts(self) -> np.ndarray:
        self._ensure()
        return np.array([len(y) for _, y in self._writers], dtype=np.int64)

    def load_writer(self, k: int):
        self._ensure()
        return self._writers[k]

    def test_source(self):
        self._ensure()
        return ArrayClients.blocks(*self._test)


class FemnistLEAF(CachedNaturalReader):
    name = "femnist"
    num_classes = 62
    x_tail = (1, 28, 28)

    def __init__(self, cfg, opts, root):
        super().__init__(cfg, opts)
        self.root = root

    def source_files(self) -> List[str]:
        return leaf_json_files(self.root, "train", LEAF_FEMNIST) + leaf_json_files(self.root, "test", LEAF_FEMNIST)

    def test_files(self) -> List[str]:
        return leaf_json_files(self.root, "test", LEAF_FEMNIST)

    def _split(self, split):
        users: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {}
        for user, x, y, path in iter_leaf_users(self.root, split, LEAF_FEMNIST, with_path=True):
            where = f"{path} user {user!r}"
            try:
                px = np.asarray(x, dtype=np.float32)
            except (ValueError, TypeError):
                raise _shape_error(f"{where} ('x')", "x as lists of 784 floats", "ragged lists or non-numbers",
                                   LEAF_FEMNIST)
            if px.ndim != 2 or px.shape[1] != 784:
                raise _shape_error(where, "x as lists of 784 floats", px.shape, LEAF_FEMNIST)
            try:
                yy = integer_labels(y, f"{where} ('y')", LEAF_FEMNIST)  # 1.7 must not become class 1
            except ValueError:
                raise _shape_error(f"{where} ('y')", "a list of integer labels", "ragged lists", LEAF_FEMNIST)
            if yy.ndim != 1:
                raise _shape_error(f"{where} ('y')", "a list of integer labels", f"shape {yy.shape}", LEAF_FEMNIST)
            check_labels(yy, self.num_classes, where, LEAF_FEMNIST)
            img = pixels_to_uint8(px, self.opts.invert, f"{where} ('x')", LEAF_FEMNIST).reshape(-1, 1, 28, 28)
            users.setdefault(user, []).append((img, yy))
        return {u: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v]))
                for u, v in sorted(users.items())}

    def parse(self):
        train = self._split("train")
        test = self._split("test")
        tx = np.concatenate([v[0] for v in test.values()]) if test else np.empty((0, 1, 28, 28), np.uint8)
        ty = np.concatenate([v[1] for v in test.values()]) if test else np.empty(0, np.int64)
        return list(train.values()), (tx, ty)

    def transform(self):
        return image_transform(self.opts, EMNIST_STATS)


def _natural_root(cfg, opts, subdir: str, name: str) -> str:
    if opts.dir:
        return opts.dir
    return os.path.join(require_data_dir(cfg, name, subdir + "/"), subdir)


def _pick_source(opts, root: str, tff_file: str, tff: Published, leaf: Published, tff_layout: str) -> str:
    """'tff' or 'leaf' from the source option and what exists under root."""
    if opts.source != "auto":
        return opts.source
    if os.path.isfile(os.path.join(root, tff_file)):
        return "tff"
    if os.path.isdir(os.path.join(root, "train")):
        return "leaf"
    raise DataError(
        f"no dataset files found in {root}: expected "
        f"{os.path.join(root, tff_file)} ({tff_layout}; {tff.where()}) or "
        f"{os.path.join(root, 'train', '*.json')} and {os.path.join(root, 'test', '*.json')} "
        f"(LEAF JSON; {leaf.where()}); set --data-dir, or the dataset option dir=FOLDER"
    )


@register_dataset("femnist", FemnistOptions,
                  "FEMNIST by writer: TFF HDF5 or LEAF JSON (<data_dir>/femnist), natural partition")
def build_femnist(cfg, options: FemnistOptions = None):
    opts = checked_options(options, FemnistOptions)
    root = _natural_root(cfg, opts, "femnist", "femnist")
    tff_file = "fed_emnist_digitsonly_train.h5" if opts.only_digits else "fed_emnist_train.h5"
    if opts.only_digits and not os.path.isfile(os.path.join(root, tff_file)):
        # LEAF has no digits-only release: falling back to it would train on all 62 classes
        raise DataError(
            f"femnist only_digits reads TFF's digits-only files, and {os.path.join(root, tff_file)} is missing "
            f"({TFF_EMNIST_DIGITS.where()}); put fed_emnist_digitsonly_train.h5 and _test.h5 there, or drop "
            f"only_digits to train on all 62 classes (TFF's full files or LEAF JSON)")
    source = _pick_source(opts, root, tff_file, TFF_EMNIST, LEAF_FEMNIST,
                          "TFF HDF5 layout examples/<writer>/pixels + label")
    reader = FemnistTFF(cfg, opts, root) if source == "tff" else FemnistLEAF(cfg, opts, root)
    return assemble(reader)


@register_dataset("cifar100_tff", Cifar100TffOptions,
                  "CIFAR-100 with TFF's 500 natural clients (<data_dir>/cifar100_tff/fed_cifar100_*.h5)")
def build_cifar100_tff(cfg, options: Cifar100TffOptions = None):
    opts = checked_options(options, Cifar100TffOptions)
    return assemble(Cifar100TFF(cfg, opts, _natural_root(cfg, opts, "cifar100_tff", "cifar100_tff")))


class ShakespeareReader(CachedNaturalReader):
    """Next-character prediction: x = L character ids, y = the next character at each position."""

    name = "shakespeare"
    task = "next_char"
    num_classes = len(SHAKESPEARE_VOCAB)
    y_dtype = np.uint8

    def __init__(self, cfg, opts, root, source):
        super().__init__(cfg, opts)
        self.root, self.source = root, source
        self.x_tail = self.y_tail = (opts.seq_len,)
        self.empty_test_hint = (f" of seq_len + 1 = {opts.seq_len + 1} characters (a role's shorter text gives "
                                f"none; a smaller seq_len data option cuts more)")

    def source_files(self) -> List[str]:
        if self.source == "tff":
            # checked here, as leaf_json_files checks the LEAF ones: a store fingerprints (stats) these
            # paths before anything opens them, so a missing one would be a bare FileNotFoundError
            return [self._tff_file("train").path, self._tff_file("test").path]
        return leaf_json_files(self.root, "train", LEAF_SHAKESPEARE) + leaf_json_files(self.root, "test", LEAF_SHAKESPEARE)

    def test_files(self) -> List[str]:
        if self.source == "tff":
            return [self._tff_file("test").path]
        return leaf_json_files(self.root, "test", LEAF_SHAKESPEARE)

    def _tff_file(self, split) -> TFFClientFile:
        """The split's TFF file, not opened yet; a missing one raises the DataError naming path and layout."""
        return TFFClientFile(os.path.join(self.root, f"shakespeare_{split}.h5"), ("snippets",), TFF_SHAKESPEARE,
                             f"TFF Shakespeare {split} file")

    def writer_labels(self, y):
        return y[:, -1]  # synthetic partitions see the character that follows each sequence

    def _tff_split(self, split) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        out = {}
        with self._tff_file(split) as f:
            for cid in f.client_ids():
                text = "\n".join(decode_strings(f.read_client(cid)["snippets"],
                                                f"{f.path} client {cid!r} ('snippets')", TFF_SHAKESPEARE))
                out[cid] = char_sequences(encode_chars(text), self.opts.seq_len)
        return out

    def _leaf_split(self, split) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        L = self.opts.seq_len
        users: Dict[str, List[str]] = {}
        for user, xs, ys, path in iter_leaf_users(self.root, split, LEAF_SHAKESPEARE, with_path=True):
            windows = []
            for i, (x, y) in enumerate(zip(xs, ys)):
                # LEAF's published types: x an 80-character string, y the one character after it.
                # Anything else would be formatted into the text below and read as characters.
                for field, value, ok in (("x", x, isinstance(x, str) and len(x) > 0),
                                         ("y", y, isinstance(y, str) and len(y) == 1)):
                    if not ok:
                        want = "a one-character string" if field == "y" else "a non-empty string"
                        raise DataError(
                            f"{path} user {user!r}: '{field}'[{i}] is {json.dumps(value)[:60]} "
                            f"({type(value).__name__}); LEAF Shakespeare samples have '{field}' as {want}, so the "
                            f"file is not in the published layout ({LEAF_SHAKESPEARE.where()})")
                if len(x) < L:
                    raise ConfigError(
                        f"LEAF Shakespeare samples of user {user!r} hold {len(x)} input characters; "
                        f"use the data option seq_len={len(x)} or smaller"
                    )
                windows.append(f"{x}{y}"[-(L + 1):])
            users.setdefault(user, []).extend(windows)
        out = {}
        for user, windows in sorted(users.items()):
            ids = encode_chars("".join(windows)).reshape(len(windows), L + 1)
            out[user] = (ids[:, :-1].copy(), ids[:, 1:].copy())
        return out

    def parse(self):
        read = self._tff_split if self.source == "tff" else self._leaf_split
        train, test = read("train"), read("test")
        L = self.opts.seq_len
        tx = np.concatenate([v[0] for v in test.values()] + [np.empty((0, L), np.uint8)])
        ty = np.concatenate([v[1] for v in test.values()] + [np.empty((0, L), np.uint8)])
        return list(train.values()), (tx, ty)

    def transform(self):
        return token_ids


@register_dataset("shakespeare", ShakespeareOptions,
                  "Shakespeare next-character prediction by speaking role: TFF HDF5 or LEAF JSON (<data_dir>/shakespeare)")
def build_shakespeare(cfg, options: ShakespeareOptions = None):
    opts = checked_options(options, ShakespeareOptions)
    root = _natural_root(cfg, opts, "shakespeare", "shakespeare")
    source = _pick_source(opts, root, "shakespeare_train.h5", TFF_SHAKESPEARE, LEAF_SHAKESPEARE,
                          "TFF HDF5 layout examples/<role>/snippets")
    return assemble(ShakespeareReader(cfg, opts, root, source))
