"""The XorMixFL paper (Shin et al., 2020): one-shot federated learning from encoded samples.

``base`` (the one-shot base: a single upload, server training, broadcast; the balancing
rule), ``sample_codecs`` (uint8 blending, XOR and mixup encodings), ``xormixfl``, ``mixfl``,
``standalone`` (the server's own data only).

``fedhpc.algorithms.oneshot`` was the base's module before the family had a folder: its names
are exported here.
"""

from .base import (EncodedUploads, EncodingOptions, OneShotServer, ServerTrainingOptions,  # noqa: F401
                   balance_deficits, keep_until_balanced, split_requests)
