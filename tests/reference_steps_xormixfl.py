"""Hand-computed one-shot rounds of the XorMixFL family (XOR Mixup paper, Algs. 1-2): xormixfl, mixfl, standalone.

Round 1 by hand: the server counts its base set per label and takes each target label's
deficit to the largest count; it asks the devices holding that label for deficit / K
samples each (the first deficit mod K in device order one more); each device encodes
with the family's (separately tested) blend/XOR/mixup functions from its own seeded
generator; the server XOR-decodes with its own blends (XorMixFL) or keeps the mixups
with soft labels (MixFL), keeps the first deficit of each target label in (device,
position) order, and trains from the initial global model with plain SGD, full-batch
mean cross-entropy per batch, over the server trainer's documented batch order. Devices
train nothing: the result must differ from FedAvg's round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import derive_seed
from fedhpc.algorithms.sample_codecs import EncodedSet, encode_device, from_pixels, to_pixels, xor_decode
from fedhpc.server.trainer import ServerTrainConfig, server_batches
from reference_steps import autograd, flat_of, reference, start_model

DATA_ARGV = ["--data-opt", "server_per_label=20", "--data-opt", "server_deficient=0,3",
             "--data-opt", "server_deficient_count=2"]
CHECK_ARGV = DATA_ARGV + ["--server-optimizer", "sgd", "--server-lr", "0.1", "--server-epochs", "2",
                          "--server-batch", "64", "--server-micro-batch", "16"]
ENCODE_ARGV = ["--num-dummy", "2", "--max-blend", "3", "--blend-alpha", "0.25", "--privacy-samples", "30"]
STANDARD_ARGV = DATA_ARGV + ["--server-epochs", "2", "--server-batch", "32", "--server-micro-batch", "8"]


def mix_ratio(o, kind):
    """MixFL's ratio on the target blend: --mix-lam when set, else Table 4's alpha (--blend-alpha),
    as fedhpc/algorithms/oneshot/mixfl.py documents; XOR encoding takes none."""
    return (o.mix_lam or o.blend_alpha) if kind == "mix" else 0.5


def oneshot_round(eng, kind):
    cfg, algo, C = eng.cfg, eng.algo, eng.data.num_classes
    o = algo.options
    sx, sy = eng.data.server_data()
    counts = [int((sy == c).sum()) for c in range(C)]
    top = max(counts)
    deficits = {c: top - n for c, n in enumerate(counts) if n < top}
    x, y = sx.double(), (F.one_hot(sy, C).double() if kind == "mix" else sy)
    if kind != "standalone":
        holders = {t: [cid for cid in range(eng.data.num_clients) if bool((eng.data.client(cid).y == t).any())]
                   for t in deficits}
        sets = []
        for cid in range(eng.data.num_clients):
            req = {}
            for t, d in deficits.items():
                k = len(holders[t])
                if cid in holders[t]:
                    req[t] = d // k + (1 if holders[t].index(cid) < d % k else 0)
            if not any(req.values()):
                continue
            c = eng.data.client(cid)
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, "oneshot-encode", cid))
            sets.append(encode_device(to_pixels(c.x), c.y, req, sorted(deficits), o.num_dummy, o.max_blend,
                                      o.blend_alpha, g, cid, kind=kind, lam=mix_ratio(o, kind),
                                      num_classes=C))
        enc = EncodedSet.cat(sets)
        if kind == "xor":
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, "oneshot-decode"))
            samples, _ = xor_decode(enc, to_pixels(sx), sy, o.max_blend, o.blend_alpha, g)
            labels = enc.target
        else:
            samples, labels = enc.x, enc.soft
        keep, taken = [], {t: 0 for t in deficits}
        for i in range(len(enc)):
            t = int(enc.target[i])
            if taken[t] < deficits[t]:
                keep.append(i)
                taken[t] += 1
        x = torch.cat([x, from_pixels(samples[keep], sx.dtype).double()])
        y = torch.cat([y, labels[keep].double() if kind == "mix" else labels[keep]])
    m = start_model(eng)
    tcfg = ServerTrainConfig(epochs=o.server_epochs, batch_size=min(o.server_batch, len(y)),
                             micro_batch=o.server_micro_batch, lr=o.server_lr)
    for idx in server_batches(len(y), tcfg, derive_seed(cfg.seed, "oneshot-server-train")):
        logp = F.log_softmax(m(x[idx]), -1)
        if kind == "mix":
            loss = -(y[idx] * logp).sum() / len(idx)
        else:
            loss = -logp[torch.arange(len(idx)), y[idx]].sum() / len(idx)
        with torch.no_grad():
            for prm, gr in zip(m.parameters(), autograd(m, loss)):
                prm -= o.server_lr * gr
    return flat_of(eng, m)


# MixFL without --mix-lam: its mixup ratio is then alpha (0.25 here), Table 4's reading
for _name, _kind, _extra in (("xormixfl", "xor", ENCODE_ARGV), ("mixfl", "mix", ENCODE_ARGV),
                             ("standalone", "standalone", [])):
    fn = reference(_name)(lambda eng, _kind=_kind: oneshot_round(eng, _kind))
    fn.argv = CHECK_ARGV + _extra
    fn.standard_argv = STANDARD_ARGV + _extra
