"""Standalone ML (XOR Mixup paper's baseline): the server trains on its own imbalanced base set only.

The one-shot setting of :mod:`fedhpc.algorithms.oneshot` with nothing added: no device
uploads anything, the server trains once (same trainer, options and initial model as
XorMixFL) and broadcasts the model.
"""

from __future__ import annotations

from .. import register_algorithm
from .base import OneShotServer


@register_algorithm("standalone")
class Standalone(OneShotServer):
    """The server's own data only: the lower bound XorMixFL's decoded samples must beat."""
