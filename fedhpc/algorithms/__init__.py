"""The algorithms: the :class:`Algorithm` base and FedAvg / FedProx here, one folder per paper family.

    base.py, fedavg.py, fedprox.py
    mafl/            FedMix paper: mixing, LocalMix, GlobalMix, NaiveMix, FedMix
    distillation/    Mix2FLD paper: FD, FLD, MixFLD, Mix2FLD
    local_learning/  FedAlign paper: the local-regulariser base, FedAlign, MOON, Mixup, StochDepth, GradAug
    personal/        pMixFed paper: the personal base, pMixFed and its seven baselines
    oneshot/         XorMixFL paper: the one-shot base, the sample codecs, XorMixFL, MixFL, Standalone

A method is one file that subclasses :class:`Algorithm` (or its family's base) and registers
itself with :func:`register_algorithm`; :func:`fedhpc.registry.load_algorithm_modules` imports
every file here, so a new file is found without being listed anywhere.

Before the families had folders every method was a module of this package
(``fedhpc.algorithms.fedmix``); those import paths, and the class paths that older checkpoints
pickled, still resolve to the modules' new homes (``MOVED``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import pkgutil
import sys

from ..registry import ALGORITHMS, load_algorithm_modules  # noqa: F401  (the registry, below this layer)
from .base import Algorithm, ClientContext, RoundInfo  # noqa: F401

#: old module (``fedhpc.algorithms.<key>``) -> its home now, relative to this package
MOVED = {
    **{m: f"mafl.{m}" for m in ("mixing", "localmix", "globalmix", "naivemix", "fedmix")},
    **{m: f"distillation.{m}" for m in ("fd", "fld", "mixfld", "mix2fld")},
    **{m: f"local_learning.{m}" for m in ("local_reg", "fedalign", "moon", "mixup", "stochdepth", "gradaug")},
    **{m: f"personal.{m}" for m in ("pmixfed", "fedper", "fedsim", "fedalt", "lg_fedavg", "fedbabu", "ditto",
                                    "per_fedavg")},
    **{m: f"oneshot.{m}" for m in ("sample_codecs", "xormixfl", "mixfl", "standalone")},
    # ``fedhpc.algorithms.personal`` and ``.oneshot`` were the family bases: the packages of
    # those names export the same names (from their base.py)
}


def register_algorithm(name: str):
    def deco(cls):
        cls.name = name
        return ALGORITHMS.register(name)(cls)

    return deco


def import_methods() -> None:
    """Import every module of this package and its family folders, so that each method registers."""
    for info in pkgutil.walk_packages(__path__, prefix=__name__ + "."):
        if not info.name.rpartition(".")[2].startswith("_"):
            importlib.import_module(info.name)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import fedhpc.algorithms.fedmix`` gives the module ``fedhpc.algorithms.mafl.fedmix``."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module):
        pass  # the module ran under its own name


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
