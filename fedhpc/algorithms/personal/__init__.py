"""The pMixFed paper (2025) and its seven personalised baselines.

``base`` (the personal base: layers, personal parts, the clients' own models), ``pmixfed``
(layer-wise mixup of global and local models at broadcast and aggregation), ``fedper``,
``fedsim``, ``fedalt``, ``lg_fedavg``, ``fedbabu``, ``ditto``, ``per_fedavg``.

``fedhpc.algorithms.personal`` was the base's module before the family had a folder: its
names are exported here.
"""

from .base import (LayerMap, Part, PartialAlgorithm, PersonalAlgorithm, PersonalOptions,  # noqa: F401
                   fresh_optimizer, frozen, select_layers, split_layers)
