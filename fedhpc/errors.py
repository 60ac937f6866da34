"""Errors that stop a run with a message naming the problem and the fix.

Every user-facing failure raises a subclass of :class:`FedHPCError`; the launcher
prints ``error: <message>`` and exits with a non-zero code without a traceback.
"""


class FedHPCError(Exception):
    """Base class: the message must say what is wrong and how to fix it."""

    exit_code = 2


class ConfigError(FedHPCError):
    """An impossible or unknown setting (algorithm, dataset, numbers out of range)."""


class DataError(FedHPCError):
    """A dataset file is missing or malformed, or a partition cannot be built."""


class CheckpointError(FedHPCError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


class OutputError(FedHPCError):
    """An output (metrics, checkpoint, model) cannot be written: disk full, read-only, no permission."""


class NonFiniteLossError(FedHPCError):
    """A client's loss became NaN or infinite."""

    exit_code = 3


class RankFailure(FedHPCError):
    """A collective failed, usually because a peer rank died."""

    exit_code = 4
