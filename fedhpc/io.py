"""Atomic file writes: a reader never sees half a file, a crash never destroys the old one."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import torch


def _atomic(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, write: Callable[[Any], None]) -> None:
    """Write a binary file atomically through ``write(file_object)`` (plots, archives...)."""
    _atomic(path, write)


def atomic_torch_save(obj: Any, path: str) -> None:
    _atomic(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str, text: str) -> None:
    _atomic(path, lambda f: f.write(text), mode="w")


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
