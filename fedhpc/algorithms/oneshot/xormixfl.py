"""XorMixFL (XOR Mixup paper, Sec. 3, Algs. 1-2): one-shot FL with XOR-encoded, server-decoded samples.

Every device uploads, for each target label the server lacks, encoded samples
e = b(target) XOR b(dummy) (Eq. 2; b: blends of up to M samples, ratio alpha) and the
dummy labels' ids. The server decodes each with its *own* blend of the same dummy
labels, d = e XOR b'(dummy) (Eq. 3), labels it with the target label, adds decoded
samples until its dataset is balanced, trains the global model on it (data-parallel
over all ranks) and broadcasts it. No raw sample, and no linear mix of raw samples,
leaves a device; the decoded samples are noisy because b' != b. The codec, blending and
uint8 pixel domain are :mod:`fedhpc.algorithms.oneshot.sample_codecs`'s, the balancing
:mod:`fedhpc.algorithms.oneshot`'s.
"""

from __future__ import annotations

import torch

from .. import register_algorithm
from ..base import derive_seed
from .base import EncodedUploads, keep_until_balanced
from .sample_codecs import from_pixels, to_pixels, xor_decode


@register_algorithm("xormixfl")
class XorMixFL(EncodedUploads):
    """One-shot: XOR-encoded uploads, XOR decoding with the server's own base samples, server training."""

    kind = "xor"

    def augmented_set(self, rnd):
        o = self.options
        enc, deficits = self.collect(rnd)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "oneshot-decode"))
        decoded, _ = xor_decode(enc, to_pixels(self.server_x), self.server_y, o.max_blend, o.blend_alpha, g,
                                  o.blend_rule)
        kept = keep_until_balanced(enc.target, deficits)
        self.metrics["decoded_added"] = float(len(kept))
        self.measure_privacy(enc, decoded[kept], kept)
        return from_pixels(decoded[kept], self.server_x.dtype), enc.target[kept], enc.target[kept]
