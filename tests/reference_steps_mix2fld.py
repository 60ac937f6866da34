"""Hand-computed rounds of the FLD family (Mix2FLD paper Alg. 1): FLD, MixFLD, Mix2FLD.

One round: each sampled device trains the global model with plain SGD on CE (Eq. 1)
while averaging its softmax outputs per label (Eq. 2, summed sample by sample here);
the server averages them per label over the devices that saw the label (Eq. 3), then
runs K_s plain SGD steps of Eq. 5 (CE to the seed's label + beta * CE to the label
mixture of global output rows) on the server's samples, full batches, no micro-batching.
The samples themselves come from the algorithm's own seed functions, whose equations
tests/test_seed_samples.py checks; the batch order is the server trainer's documented rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhpc.algorithms.base import derive_seed
from fedhpc.engine import sample_clients
from fedhpc.exchanges.seed_samples import SeedSet
from fedhpc.server.trainer import ServerTrainConfig, server_batches
from reference_steps import autograd, batch_indices, flat_of, reference, start_model

FAMILY_ARGV = ["--server-steps", "6", "--server-batch", "16", "--seeds-per-device", "4",
               "--inverse-per-device", "4", "--beta", "0.5"]


def fld_round(eng, arrived=None):
    """Round 1 by hand. ``arrived``: the devices whose round-1 upload got through the channel
    (--seed-delivery channel: the server has only their tables and their seeds); None: every
    sampled device's table arrives and every device's seeds do (--seed-delivery always)."""
    cfg, algo, C = eng.cfg, eng.algo, eng.data.num_classes
    sampled = sample_clients(cfg.seed, 0, eng.data.num_clients, cfg.clients_per_round)
    tables, present = [], []
    for cid in sampled:
        if arrived is not None and cid not in arrived:
            continue
        c = eng.data.client(cid)
        m = start_model(eng)
        sums, counts = torch.zeros(C, C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        for idx in batch_indices(cfg.seed, 0, cid, 0, c.num_train, cfg.batch_size):
            x, y = c.x[idx].double(), c.y[idx]
            logits = m(x)
            p = F.softmax(logits, -1).detach()
            for i in range(len(y)):
                sums[y[i]] += p[i]
                counts[y[i]] += 1
            grads = autograd(m, F.cross_entropy(logits, y))
            with torch.no_grad():
                for prm, gr in zip(m.parameters(), grads):
                    prm -= cfg.lr * gr
        tables.append([sums[n] / counts[n] for n in range(C)])
        present.append(counts > 0)
    g = torch.zeros(C, C, dtype=torch.float64)
    has = torch.zeros(C, dtype=torch.bool)
    for n in range(C):
        rows = [tb[n] for tb, pr in zip(tables, present) if pr[n]]
        if rows:
            g[n], has[n] = sum(rows) / len(rows), True

    # the server's samples, from the algorithm's own (separately tested) seed functions
    delivering = range(eng.data.num_clients) if arrived is None else sorted(arrived)
    local = {cid: algo.make_seeds(cid) for cid in delivering}
    o = algo.options
    m = start_model(eng)
    samples = algo.server_samples(SeedSet.cat([local[c] for c in sorted(local)])) if local else []
    if len(samples) == 0 or not has.any():  # no sample or no table at the server: no conversion
        return {"global_state": flat_of(eng, m), "teacher": g}
    tcfg = ServerTrainConfig(steps=o.server_steps, batch_size=min(o.server_batch, len(samples)),
                             micro_batch=o.server_micro_batch, lr=o.server_lr)
    sx, sy = samples.x.double(), samples.y.double()
    for idx in server_batches(len(sx), tcfg, derive_seed(cfg.seed, "server-train", 0)):
        logits = m(sx[idx])
        logp = F.log_softmax(logits, -1)
        loss = 0
        for i in range(len(idx)):  # Eq. 5 sample by sample
            yi = sy[idx[i]]
            w = yi * has.double()
            loss = loss - (yi * logp[i]).sum()
            if w.sum() > 0:
                loss = loss - o.beta * ((w @ g) / w.sum() * logp[i]).sum()
        grads = autograd(m, loss / len(idx))
        with torch.no_grad():
            for prm, gr in zip(m.parameters(), grads):
                prm -= o.server_lr * gr
    return {"global_state": flat_of(eng, m), "teacher": g}


for _name in ("fld", "mixfld", "mix2fld"):
    fn = reference(_name)(lambda eng: fld_round(eng))
    fn.argv = FAMILY_ARGV
    fn.standard_argv = FAMILY_ARGV
