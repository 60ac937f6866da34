"""Dataset registry. A dataset registers a builder ``build(cfg, options) -> FederatedData``.

``cfg`` is the run's :class:`fedhpc.config.RunConfig` (data_dir, partition,
num_clients, seed, client_test_fraction, ...); ``options`` is an instance of the
dataset's own options dataclass (``data_options`` in YAML, ``--data-opt k=v`` on
the command line), or None when it declares none.

Every dataset also takes the server's own base set options (``server_per_label``,
``server_deficient``, ``server_deficient_count``: :class:`ServerDataOptions`), for
one-shot methods whose server holds data (XorMixFL). :func:`register_dataset` adds
them to the dataset's options class, and :func:`build_dataset` splits them off
again: the builder receives its own options unchanged (so an HDF5 store's identity
does not move) and runs inside :func:`fedhpc.data.partition.server_set_request`,
which makes the partition carve the server's set out of the pool first.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Tuple, Type

from ..errors import ConfigError
from ..registry import Registry
from .base import ArrayFederatedData, ClientData, FederatedData, ServerDataOptions, default_transform  # noqa: F401
from .partition import make_partition, partition_names, server_set_request  # noqa: F401


@dataclass
class DatasetSpec:
    build: Callable[..., FederatedData]
    #: the options users set: the dataset's own class extended with ServerDataOptions
    options: Optional[Type] = None
    help: str = ""
    #: the dataset's own options class (what the builder receives), or None
    own_options: Optional[Type] = None
    #: run settings (RunConfig fields) a run on this dataset takes when neither its file nor its
    #: flags set them, in place of RunConfig's defaults (digits: a larger lr); applied and said at
    #: the start of the run by :mod:`fedhpc.config.auto`
    settings: Dict[str, Any] = field(default_factory=dict)
    #: the models ``--model auto`` means on this dataset: ``"default"`` (what a method without
    #: needs of its own gets; the builder's ``default_model``) and, per kind of network a method
    #: may need (``Algorithm.auto_model_kind``: ``"residual"`` for the FedAlign family), the one to
    #: take instead; a kind the dataset does not name leaves the default, which the method refuses
    models: Dict[str, str] = field(default_factory=dict)
    #: what ``--partition auto`` deals on this dataset, as the start of a run says it ('' = not declared)
    auto_partition: str = ""


def with_server_options(cls: Optional[Type]) -> Type:
    """``cls`` extended with the server base-set fields (ServerDataOptions itself for None)."""
    if cls is None:
        return ServerDataOptions

    def validate(self):
        if hasattr(cls, "validate"):
            cls.validate(self)
        ServerDataOptions.validate(self)

    # Named and kept in this module so that instances pickle (checkpoints, all_gather_object).
    name = f"{cls.__name__}WithServer"
    wrapped = dataclass(type(name, (cls, ServerDataOptions), {"validate": validate, "__module__": __name__,
                                                              "__qualname__": name, "__doc__": cls.__doc__}))
    globals()[name] = wrapped
    return wrapped


def split_server_options(spec: DatasetSpec, options: Any) -> Tuple[Any, Optional[ServerDataOptions]]:
    """(the builder's own options, the server base-set options or None)."""
    if options is None:
        return None, None
    if not isinstance(options, ServerDataOptions):  # the dataset's own class, made by hand
        return options, None
    server = ServerDataOptions(**{f.name: getattr(options, f.name) for f in fields(ServerDataOptions)})
    own = None
    if spec.own_options is not None:
        own = spec.own_options(**{f.name: getattr(options, f.name) for f in fields(spec.own_options)})
    return own, server


DATASETS: Registry[DatasetSpec] = Registry("dataset")


def register_dataset(name: str, options: Optional[Type] = None, help: str = "", *,
                     settings: Optional[Dict[str, Any]] = None, models: Optional[Dict[str, str]] = None,
                     auto_partition: str = ""):
    """Register a dataset builder; ``settings``, ``models``, ``auto_partition``: see :class:`DatasetSpec`."""
    def deco(fn):
        DATASETS.register(name)(DatasetSpec(fn, with_server_options(options), help, options, dict(settings or {}),
                                            dict(models or {}), auto_partition))
        return fn

    return deco


# Modules that register datasets when imported. Optional readers (HDF5 etc.) import their
# heavy dependencies lazily inside the builder, so listing them here costs nothing.
_DATASET_MODULES = ["digits", "mnist5k", "readers", "synthetic"]


def load_dataset_modules() -> None:
    for mod in _DATASET_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a module not written yet must not break the rest
            if e.name != f"{__name__}.{mod}":
                raise


def build_dataset(cfg: Any, options: Any = None) -> FederatedData:
    load_dataset_modules()
    spec = DATASETS.get(cfg.dataset)
    own, server = split_server_options(spec, options)
    if server is None or not server.active:
        return spec.build(cfg, own)
    with server_set_request(server) as served:
        data = spec.build(cfg, own)
    if data.server_data() is None:
        from .store import HDF5ClientStore

        data.close()
        why = ("its clients come from an HDF5 client store, which holds no server set; add --data-opt "
               "store=memory" if isinstance(data, HDF5ClientStore) else
               "its partition never reached the carve (partition 'natural' keeps writers whole); use a "
               "synthetic partition such as iid or deficient:L:A:B")
        raise ConfigError(f"dataset {cfg.dataset!r} cannot give the server its own base set "
                          f"(server_per_label={server.server_per_label}): {why}")
    if data.task != "classification":
        data.close()
        raise ConfigError(f"the server base set (server_* data options) needs a classification dataset; "
                          f"{cfg.dataset!r} is a {data.task} task")
    return data
