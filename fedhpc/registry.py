"""A tiny name -> factory registry shared by algorithms, datasets and models, and the algorithms' one."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, T] = {}
        self._aliases: Dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        key = name.lower()

        def deco(obj: T) -> T:
            if key in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[key] = obj
            return obj

        return deco

    def alias(self, alias: str, name: str) -> None:
        """Make ``alias`` another name of the entry ``name`` (listed apart, never twice in names())."""
        self._aliases[alias.lower()] = name.lower()

    def canonical(self, name: str) -> str:
        """The registered name of ``name`` (lower case, aliases resolved); runs store this one."""
        if not isinstance(name, str):  # YAML reads `algo: 5`, `algo: null`, `algo: [x]` as non-strings
            raise ConfigError(f"a {self.kind} is named by a string, got {name!r} ({type(name).__name__}); "
                              f"choose one of: {', '.join(self.names())}")
        return self._aliases.get(name.lower(), name.lower())

    def aliases(self) -> Dict[str, str]:
        return dict(self._aliases)

    def get(self, name: str) -> T:
        key = self.canonical(name)
        if key not in self._entries:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            )
        return self._entries[key]

    def names(self):
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return isinstance(name, str) and self.canonical(name) in self._entries


#: every registered algorithm (``fedhpc.algorithms.register_algorithm`` adds to it). It lives
#: here, below the algorithms, so that the layers they stand on (the engine, the configuration,
#: checkpoints) can look a method up without importing the algorithm package.
ALGORITHMS: Registry = Registry("algorithm")


def load_algorithm_modules() -> None:
    """Import every algorithm module, so that each registers itself in :data:`ALGORITHMS`.

    By name: the algorithm package stands on the layers that call this."""
    importlib.import_module("fedhpc.algorithms").import_methods()
