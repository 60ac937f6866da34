"""fedhpc: federated learning simulated at cluster scale.

Command line: ``python -m fedhpc.launch`` (or the ``fedhpc`` command). From Python::

    import fedhpc
    result = fedhpc.run("launch/digits_fedavg.yaml", rounds=5)   # or fedhpc.run(algo="fedprox", mu=0.01)
    result.final["test_accuracy"], result.global_state, result.rounds

    fedhpc.report.load_runs("runs/")   # one row per run: settings, final and best metrics

``import fedhpc`` stays cheap (no torch): :func:`run` and :class:`RunResult` are imported from
:mod:`fedhpc.api` on first use.
"""

from ._version import __version__

__all__ = ["__version__", "run", "RunResult", "RunStopped"]

_API = ("run", "RunResult", "RunStopped")


#: subpackages reachable as attributes after a bare ``import fedhpc`` (imported on first use)
_LAZY_MODULES = ("report", "sweep", "config")


def __getattr__(name):
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fedhpc' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API) + list(_LAZY_MODULES))
