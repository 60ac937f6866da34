"""Typed run configuration, settable from YAML files and command-line flags.

Precedence: dataclass defaults < ``--config FILE.yaml`` < command-line flags.
The algorithm's own options (``Algorithm.Options``) are flags too (``--mu 0.01``)
and live under ``algo_options:`` in YAML; dataset and model options live under
``data_options:`` / ``model_options:`` (``--data-opt k=v``, ``--model-opt k=v``).
Everything is validated before any output is written.

``run``: RunConfig and its validation; ``values``: YAML files, KEY=VALUE flags and options
dataclasses; ``layers``: what happens when a file and the flags disagree; ``cli``: parse_args.
"""

from .cli import launcher_rank, parse_args
from .layers import METHOD_SPECIFIC, OPTION_OWNERS, algorithm_identity_settings, identity_changes
from .run import RunConfig, parse_rounds, setting_default
from .values import DuplicateKeyError, UniqueKeyLoader, build_options, load_yaml, option_names

__all__ = [
    "DuplicateKeyError", "METHOD_SPECIFIC", "OPTION_OWNERS", "RunConfig", "UniqueKeyLoader",
    "algorithm_identity_settings", "build_options", "identity_changes", "launcher_rank", "load_yaml",
    "option_names", "parse_args", "parse_rounds", "setting_default",
]
