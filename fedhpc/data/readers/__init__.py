"""Real datasets, read from the files users already have in their published formats.

Nothing is downloaded: each dataset looks under ``--data-dir`` (or its ``dir``
option) for the files as they are distributed, and a missing or malformed file
stops the run with a :class:`DataError` naming the expected path, its layout and
where the dataset is published.

Registered datasets (``--dataset NAME``, options via ``--data-opt k=v``):

==============  =====================================================================
mnist           IDX files, <data_dir>/MNIST/raw/
fmnist          IDX files, <data_dir>/FashionMNIST/raw/
emnist          IDX files, <data_dir>/EMNIST/raw/emnist-<split>-...; option split
cifar10         python pickles, <data_dir>/cifar-10-batches-py/
cifar100        python pickles, <data_dir>/cifar-100-python/; option coarse
femnist         natural: TFF HDF5 (fed_emnist_*.h5) or LEAF JSON, <data_dir>/femnist/
cifar100_tff    natural: TFF HDF5 (fed_cifar100_*.h5), <data_dir>/cifar100_tff/
shakespeare     natural: TFF HDF5 (shakespeare_*.h5) or LEAF JSON, <data_dir>/shakespeare/
imagenet200     HDF5 written by ``python -m fedhpc.data.prepare imagenet200``
==============  =====================================================================

Partitions: every dataset takes the synthetic partitions (iid, dirichlet:A, dirichlet_capped:A,
classes:K, skewed:M:A:B / mix2fld). The naturally federated ones also take
``natural`` (one client per writer / speaking role); an empty, ``auto`` or
``default`` partition means ``natural`` for them and ``iid`` for the others.
Synthetic partitions on a natural dataset pool all writers first.

With ``natural``, ``num_clients`` writers are chosen by a seeded draw among the
writers with at least two samples (all of them when ``num_clients`` equals that
number); asking for more writers than exist is an error. Each client's local
test split is ``client_test_fraction`` of its own training rows (as for every
other dataset); the published test file is the global test set.

Storage: ``store=memory`` keeps the pool in RAM (:class:`ArrayFederatedData`);
``store=hdf5`` builds a per-client HDF5 store once (under ``store_dir``, default
``<data_dir>/fedhpc_stores``) and reads only the clients a rank trains;
``store=auto`` (default) picks hdf5 when the training pool exceeds
``store_threshold_mb``.
"""

# One module per family of formats; importing them registers their datasets. Option classes
# are in ``options``; the reader base and the helpers every reader shares in ``common``.
from .common import (  # noqa: F401  (re-exported: constants users import from here)
    CIFAR10_STATS, CIFAR100_STATS, DEFAULT_MODELS, EMNIST_STATS, FMNIST_STATS, IMAGENET_STATS, MIN_CLIENT_SAMPLES,
    MNIST_STATS, SHAKESPEARE_VOCAB, NaturalReader, Pool, Reader, assemble, char_sequences, encode_chars,
)
from .images import (  # noqa: F401
    Cifar100Reader, CifarReader, EmnistReader, FmnistReader, IdxReader, MnistReader, build_cifar10,
    build_cifar100, build_emnist, build_fmnist, build_mnist,
)
from .options import (  # noqa: F401  (re-exported: option classes users import from here)
    Cifar10Options, Cifar100Options, Cifar100TffOptions, EmnistOptions, FemnistOptions, FmnistOptions,
    Imagenet200Options, MnistOptions, ShakespeareOptions, StoreOptions,
)
from .imagenet import Imagenet200Reader, build_imagenet200  # noqa: F401
from .natural import (  # noqa: F401
    CachedNaturalReader, Cifar100TFF, FemnistLEAF, FemnistTFF, ShakespeareReader, TFFNaturalReader,
    build_cifar100_tff, build_femnist, build_shakespeare,
)
