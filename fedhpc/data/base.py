"""The data interface the engine trains from.

A :class:`FederatedData` knows how many clients there are and how much training
data each holds (cheaply, for load balancing and aggregation weights), and hands
out one :class:`ClientData` at a time, loaded lazily, so that a rank only ever
holds the clients it trains this round. The global test set is read in slices so
that evaluation can be sharded over ranks.

Inputs may be stored compactly (uint8 images, int64 character ids); the
``transform`` turns a *batch* on the training device into model input (scaling,
normalisation, augmentation), so no per-sample Python work sits on the hot path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ConfigError, DataError

# transform(x_batch_on_device, train, generator) -> float model input
BatchTransform = Callable[[torch.Tensor, bool, Optional[torch.Generator]], torch.Tensor]


def default_transform(x: torch.Tensor, train: bool, generator: Optional[torch.Generator]) -> torch.Tensor:
    """uint8 -> [0, 1] floats; float inputs pass through; integer ids (text) pass through."""
    if x.dtype == torch.uint8:
        return x.float().div_(255.0)
    return x


@dataclass
class ServerDataOptions:
    """The server's own base dataset, carved out of the training pool before the client partition.

    One-shot methods (XorMixFL, MixFL, standalone) give the server an imbalanced labelled set
    of its own: ``server_per_label`` samples of every label, except the ``server_deficient``
    (target) labels, which get ``server_deficient_count`` (the XorMixFL authors: 200 vs 10).
    Every dataset takes these options (``--data-opt server_per_label=200 --data-opt
    server_deficient=0,2 --data-opt server_deficient_count=10``); they are off by default
    (``server_per_label=0``). The carve is seeded and happens before the partition, so the
    clients share out what is left: see :func:`fedhpc.data.partition.make_partition`.
    """

    server_per_label: int = field(default=0, metadata={
        "help": "samples of every non-deficient label in the server's own base set (0 = no server set)"})
    server_deficient: str = field(default="", metadata={
        "help": "comma-separated target labels the server is deficient in, e.g. 0,2"})
    server_deficient_count: int = field(default=0, metadata={
        "help": "samples the server holds of each deficient label (< server_per_label)"})

    def validate(self):
        if self.server_per_label < 0 or self.server_deficient_count < 0:
            raise ConfigError(f"data options server_per_label and server_deficient_count must be >= 0, got "
                              f"{self.server_per_label} and {self.server_deficient_count}")
        labels = self.deficient_labels()
        if self.server_per_label == 0 and (labels or self.server_deficient_count):
            raise ConfigError("data options server_deficient / server_deficient_count need a server base set: "
                              "set server_per_label > 0 (e.g. --data-opt server_per_label=200)")
        if labels and self.server_deficient_count >= self.server_per_label:
            raise ConfigError(f"data option server_deficient_count ({self.server_deficient_count}) must be "
                              f"below server_per_label ({self.server_per_label}): deficient labels have fewer "
                              f"samples than the others")

    def deficient_labels(self) -> List[int]:
        text = str(self.server_deficient).strip().strip("[]()")  # a YAML list arrives as its text
        if not text:
            return []
        try:
            labels = [int(v) for v in text.replace("+", ",").split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"data option server_deficient must be comma-separated integer labels, e.g. 0,2; "
                              f"got {self.server_deficient!r}")
        if len(set(labels)) != len(labels) or min(labels) < 0:
            raise ConfigError(f"data option server_deficient lists each label once, all >= 0; got "
                              f"{self.server_deficient!r}")
        return sorted(labels)

    @property
    def active(self) -> bool:
        return self.server_per_label > 0

    def counts(self, labels: Sequence[int]) -> Dict[int, int]:
        """label -> samples the server takes of it."""
        deficient = set(self.deficient_labels())
        return {int(c): (self.server_deficient_count if int(c) in deficient else self.server_per_label)
                for c in labels}


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``. To a GPU through pinned memory and without blocking:
    a copy from ordinary (pageable) memory can keep the host waiting on the device's queue, once a
    client (its rows) and epoch (its batch order) on the sequential path."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class ClientData:
    """One client's local data. ``x``/``y`` train, ``x_test``/``y_test`` its own test split."""

    cid: int
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.y_test.shape[0])

    def training_on(self, device: torch.device) -> "ClientData":
        """This client with its training part on ``device``; the local test split stays where it
        is (evaluation reads it separately), so it is not copied every round."""
        if device.type == "cpu":
            return self
        return ClientData(self.cid, host_to_device(self.x, device), host_to_device(self.y, device),
                          self.x_test, self.y_test)

    @staticmethod
    def all_training_on(clients: List["ClientData"], device: torch.device) -> List["ClientData"]:
        """:meth:`training_on` for several clients (a batched group) in two copies to the device, not
        two a client: their training rows joined on the host, moved, and split into views."""
        if device.type == "cpu" or len(clients) < 2:
            return [c.training_on(device) for c in clients]
        sizes = [c.num_train for c in clients]
        xs = host_to_device(torch.cat([c.x for c in clients]), device).split(sizes)
        ys = host_to_device(torch.cat([c.y for c in clients]), device).split(sizes)
        return [ClientData(c.cid, x, y, c.x_test, c.y_test) for c, x, y in zip(clients, xs, ys)]


class FederatedData(ABC):
    """A federated dataset: clients with local train/test splits plus a global test set."""

    #: registry name of the dataset
    name: str = ""
    #: number of output classes (vocabulary size for next-character prediction)
    num_classes: int = 0
    #: shape of one model input (without the batch dimension), e.g. (1, 8, 8)
    input_shape: Tuple[int, ...] = ()
    #: 'classification' or 'next_char' (targets are one id per sequence position)
    task: str = "classification"
    #: batched input transform for training / evaluation
    transform: BatchTransform = staticmethod(default_transform)

    @property
    @abstractmethod
    def num_clients(self) -> int: ...

    @abstractmethod
    def client_sizes(self) -> np.ndarray:
        """Number of *training* samples of every client, shape (num_clients,), int64."""

    @abstractmethod
    def client(self, cid: int) -> ClientData:
        """Load one client's data (CPU tensors). Called only for clients trained on this rank."""

    @abstractmethod
    def num_test(self) -> int:
        """Size of the global test set."""

    @abstractmethod
    def test_slice(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, stop) of the global test set (CPU tensors)."""

    def default_model(self) -> str:
        return "mlp"

    def model_for(self, model: str) -> str:
        """The registry name ``--model MODEL`` means for this data: ``auto`` is :meth:`default_model`."""
        return self.default_model() if model == "auto" else model

    def model_input_shape(self, train: bool = True) -> Tuple[int, ...]:
        """Shape of one model input: a stored sample after ``transform`` (without the batch dimension).

        ``input_shape`` is the *stored* shape; the two differ when the transform crops (a 224-px
        RandomResizedCrop or centre crop of 256-px stored images). Models are built for the
        training shape, mean data live in the evaluation shape (:func:`model_input_means`).
        Found by transforming one stored sample (a throwaway generator: no stream the run
        draws from moves), so any transform a user plugs in is covered.
        """
        cache = self.__dict__.setdefault("_model_input_shapes", {})
        if train not in cache:
            x = self.model_input_sample(train)
            if x is None:
                return tuple(self.input_shape)
            cache[train] = tuple(int(s) for s in x.shape[1:])
        return cache[train]

    def model_input_sample(self, train: bool = True) -> Optional[torch.Tensor]:
        """One model input (a batch of 1) as training (``train``) or evaluation sees it: the first
        global test sample, else client 0's first, through ``transform`` with a throwaway generator
        (no stream the run draws from moves); None where the data holds no sample. One row is read,
        not a client's whole share (an ImageNet-200 client's is gigabytes)."""
        x = self.test_slice(0, 1)[0] if self.num_test() > 0 else self.client(0).x[:1]
        if x.shape[0] == 0:
            return None
        return self.transform(x, train, torch.Generator().manual_seed(0) if train else None)

    @property
    def augments(self) -> bool:
        """Whether training batches are randomly augmented (a generator is then made per epoch)."""
        return bool(getattr(self.transform, "augments", False))

    def server_data(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The server's own base set (x, y) as CPU tensors in the clients' stored form, or None.

        Set by the ``server_*`` data options (:class:`ServerDataOptions`); one-shot methods
        (XorMixFL) train on it. Its samples belong to no client.
        """
        return None

    def client_test_split(self, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Client ``cid``'s local test split (CPU tensors); stores may read only this part."""
        c = self.client(cid)
        return c.x_test, c.y_test

    def client_test_sizes(self) -> np.ndarray:
        """Size of every client's local test split, shape (num_clients,), int64.

        This default loads every split once; datasets that know the sizes override it."""
        return np.array([int(self.client_test_split(c)[1].shape[0]) for c in range(self.num_clients)],
                        dtype=np.int64)

    def client_test_rows(self, cids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The local test splits of ``cids`` one after another, in that order (CPU tensors).

        Evaluation reads the global model's test batches over many small clients through this:
        one read per batch instead of one per client."""
        parts = [self.client_test_split(int(c)) for c in cids]
        if not parts:
            x, y = self.client_test_split(0)
            return x[:0], y[:0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def close(self) -> None:
        """Release file handles (HDF5 stores)."""


def local_split_rng(seed: int) -> np.random.Generator:
    """The generator of the local train/test splits (one permutation per client, in client order)."""
    return np.random.default_rng([seed, 0x5EED])


def split_local(n: int, fraction: float, rng: np.random.Generator, cid: int) -> Tuple[np.ndarray, np.ndarray]:
    """Positions (within a client's rows) of its local train and test parts.

    One permutation per client, drawn from ``rng`` in client order; the first
    ``int(n * fraction)`` permuted rows are the test part; both parts sorted. The
    in-memory path and the HDF5 store both use it, so they hold the same clients.
    """
    perm = rng.permutation(n)
    n_test = int(n * fraction)
    if n - n_test < 1:
        raise DataError(
            f"client {cid} has {n} samples, leaving no training data after the "
            f"{fraction:.0%} local test split; use fewer clients, a larger "
            f"Dirichlet alpha, or a smaller client_test_fraction"
        )
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


class ArrayFederatedData(FederatedData):
    """In-memory federated dataset built from arrays and a partition of the training pool.

    ``partition[k]`` holds the indices (into ``x_pool``) owned by client k; each
    client's indices are split, with a seeded shuffle, into a local train part and
    a local test part of ``client_test_fraction`` (rounded down), so both follow
    the client's own label distribution. A partition carrying ``server_indices``
    (:class:`fedhpc.data.partition.Partition`, made under a server-set request) also
    gives the server its own base set (:meth:`server_data`).
    """

    def __init__(
        self,
        name: str,
        x_pool: np.ndarray,
        y_pool: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        partition: Sequence[np.ndarray],
        num_classes: int,
        client_test_fraction: float = 0.2,
        seed: int = 0,
        transform: Optional[BatchTransform] = None,
        default_model: str = "mlp",
        task: str = "classification",
    ):
        if not 0.0 <= client_test_fraction < 1.0:
            raise DataError(f"client_test_fraction must be in [0, 1), got {client_test_fraction}")
        self.name = name
        self.num_classes = int(num_classes)
        self.task = task
        self._x = torch.from_numpy(np.ascontiguousarray(x_pool))
        self._y = torch.from_numpy(np.ascontiguousarray(y_pool)).long()
        self._x_test = torch.from_numpy(np.ascontiguousarray(x_test))
        self._y_test = torch.from_numpy(np.ascontiguousarray(y_test)).long()
        self.input_shape = tuple(self._x.shape[1:])
        if transform is not None:
            self.transform = transform
        self._default_model = default_model
        rng = local_split_rng(seed)
        self._train_idx, self._test_idx = [], []
        for cid, idx in enumerate(partition):
            idx = np.sort(np.asarray(idx, dtype=np.int64))  # pool order, as the HDF5 store holds a client
            train, test = split_local(len(idx), client_test_fraction, rng, cid)
            self._train_idx.append(np.sort(idx[train]))
            self._test_idx.append(np.sort(idx[test]))
        self._sizes = np.array([len(i) for i in self._train_idx], dtype=np.int64)
        server = getattr(partition, "server_indices", None)
        self._server_idx = None if server is None else torch.from_numpy(np.asarray(server, dtype=np.int64))

    @property
    def num_clients(self) -> int:
        return len(self._train_idx)

    def client_sizes(self) -> np.ndarray:
        return self._sizes

    def client(self, cid: int) -> ClientData:
        tr = torch.from_numpy(self._train_idx[cid])
        te = torch.from_numpy(self._test_idx[cid])
        # index_select: many times faster than fancy indexing on uint8 images
        take = torch.index_select
        return ClientData(cid, take(self._x, 0, tr), take(self._y, 0, tr), take(self._x, 0, te), take(self._y, 0, te))

    def client_test_split(self, cid: int):
        return self.client_test_rows([cid])

    def client_test_sizes(self) -> np.ndarray:
        return np.array([len(i) for i in self._test_idx], dtype=np.int64)

    def client_test_rows(self, cids: Sequence[int]):
        rows = [self._test_idx[int(c)] for c in cids]
        idx = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
        return torch.index_select(self._x, 0, idx), torch.index_select(self._y, 0, idx)

    def num_test(self) -> int:
        return int(self._y_test.shape[0])

    def test_slice(self, start: int, stop: int):
        return self._x_test[start:stop], self._y_test[start:stop]

    def server_data(self):
        if self._server_idx is None:
            return None
        return torch.index_select(self._x, 0, self._server_idx), torch.index_select(self._y, 0, self._server_idx)

    def default_model(self) -> str:
        return self._default_model
