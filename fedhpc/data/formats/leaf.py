"""LEAF JSON (``users``, ``num_samples``, ``user_data``), parsed one file at a time."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, List, Optional, Tuple

from .published import Published, malformed, missing


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
