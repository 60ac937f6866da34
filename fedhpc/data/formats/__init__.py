"""Readers for datasets in the formats they are published in (pure numpy / h5py / json).

fedhpc never downloads anything: users keep the datasets on disk exactly as they
are distributed, and these functions read them. Every missing or malformed file
raises :class:`~fedhpc.errors.DataError` naming the path that was expected, the
layout it must have, and where the dataset is published, so that a user on a
cluster without internet knows what to fetch and where to put it.

One module a format family (published.py: where each dataset is published and the error
shapes that quote it):

* IDX (MNIST, Fashion-MNIST, EMNIST), gzipped or plain (told by content): :func:`find_idx`, :func:`read_idx`.
* CIFAR-10 / CIFAR-100 "python version" pickles: :func:`read_cifar10`, :func:`read_cifar100`.
  They are unpickled with an allow-list of globals (numpy array reconstruction
  only), so a tampered file cannot run code.
* TensorFlow Federated HDF5 (``examples/<client_id>/<field>``): :class:`TFFClientFile`,
  which lists clients cheaply and reads one client at a time.
* LEAF JSON (``users``, ``num_samples``, ``user_data``): :func:`iter_leaf_users`.
* An ImageNet-style folder tree (``<split>/<wnid>/*.JPEG``): :func:`list_image_folder`.
"""

from .cifar import read_cifar10, read_cifar100, read_cifar_batch
from .idx import find_idx, read_idx, read_idx_header, read_idx_images_labels
from .image_folder import IMAGE_EXTENSIONS, list_image_folder
from .leaf import iter_leaf_users, leaf_json_files
from .published import (
    CIFAR10, CIFAR100, EMNIST, FASHION_MNIST, IMAGENET, LEAF_FEMNIST, LEAF_SHAKESPEARE, MNIST, TFF_CIFAR100,
    TFF_EMNIST, TFF_EMNIST_DIGITS, TFF_SHAKESPEARE, Published, integer_labels, malformed, missing,
)
from .tff import TFFClientFile, decode_strings, open_h5_readonly

__all__ = [
    "read_cifar10", "read_cifar100", "read_cifar_batch", "find_idx", "read_idx", "read_idx_header",
    "read_idx_images_labels", "IMAGE_EXTENSIONS", "list_image_folder", "iter_leaf_users", "leaf_json_files",
    "CIFAR10", "CIFAR100", "EMNIST", "FASHION_MNIST", "IMAGENET", "LEAF_FEMNIST", "LEAF_SHAKESPEARE", "MNIST",
    "TFF_CIFAR100", "TFF_EMNIST", "TFF_EMNIST_DIGITS", "TFF_SHAKESPEARE", "Published", "integer_labels",
    "malformed", "missing", "TFFClientFile", "decode_strings", "open_h5_readonly",
]
