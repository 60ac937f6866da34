"""ImageNet-style folder trees (``<split>/<wnid>/*.JPEG``), listed without opening an image."""

from __future__ import annotations

import os
from typing import Dict, List

from ...errors import DataError
from .published import IMAGENET, Published, missing


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
