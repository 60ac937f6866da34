"""FedAvg round time: fedhpc's engine vs a plain PyTorch loop doing exactly the same client work.

Both run in this one process, on the same clients (same sampling), the same batches
(same permutation rule) and the same weighted averaging; rounds are interleaved
(fedhpc round t, then plain round t) so that machine noise hits both alike, and the
two global models are compared at the end to prove the work was the same.

    python benchmarks/bench_round.py [--rounds 20] [--clients-per-round 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fedhpc.algorithms.base import derive_seed
from fedhpc.config import RunConfig
from fedhpc.engine import Engine, sample_clients
from fedhpc.models import build_model
from fedhpc.world import World


def plain_round(model, global_sd, data, cfg, t):
    """What a researcher would write by hand: load, train each client, average state dicts."""
    sampled = sample_clients(cfg.seed, t, data.num_clients, cfg.clients_per_round)
    lr = cfg.lr * cfg.lr_decay ** t
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_sd.items()}
    weight = 0.0
    for cid in sampled:
        client = data.client(cid)
        model.load_state_dict(global_sd)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum)
        for e in range(cfg.local_epochs):
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, "batches", t, cid, e))
            perm = torch.randperm(client.num_train, generator=g)
            for s in range(0, client.num_train, cfg.batch_size):
                idx = perm[s:s + cfg.batch_size]
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(client.x[idx]), client.y[idx])
                loss.backward()
                opt.step()
        n = client.num_train
        for k, v in model.state_dict().items():
            total[k] += n * v.double()
        weight += n
    return {k: (v / weight).to(global_sd[k].dtype) for k, v in total.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-clients", type=int, default=50)
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    cfg = RunConfig(model=a.model, num_clients=a.num_clients, clients_per_round=a.clients_per_round,
                    local_epochs=a.local_epochs, rounds=a.rounds + a.warmup, lr=0.05, momentum=0.5,
                    quiet=True, tensorboard=False, threads=a.threads)
    cfg.validate()
    eng = Engine(cfg, None, None, World(threads=a.threads))
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    model = build_model(a.model, eng.data.input_shape, eng.data.num_classes)
    global_sd = {k: v.clone() for k, v in model.state_dict().items()}

    t_fed, t_plain = [], []
    for t in range(cfg.rounds):
        t0 = time.perf_counter(); eng.run_round(t); t1 = time.perf_counter()
        global_sd = plain_round(model, global_sd, eng.data, cfg, t); t2 = time.perf_counter()
        if t >= a.warmup:
            t_fed.append(t1 - t0); t_plain.append(t2 - t1)
    fed_sd = eng.flat.state_dict_from(eng.global_state)
    diff = max(float((fed_sd[k].double() - global_sd[k].double()).abs().max()) for k in global_sd)
    med_f, med_p = statistics.median(t_fed), statistics.median(t_plain)
    print(f"config: digits, model {a.model}, {a.clients_per_round} of {a.num_clients} clients per round, "
          f"{a.local_epochs} local epochs, batch {cfg.batch_size}, {a.threads} thread(s), {a.rounds} timed rounds")
    print(f"fedhpc round   median {med_f * 1e3:8.2f} ms")
    print(f"plain loop     median {med_p * 1e3:8.2f} ms")
    print(f"ratio fedhpc / plain = {med_f / med_p:.3f}   (target <= 1.10)")
    print(f"max |fedhpc - plain| over final weights = {diff:.2e} (same work check)")
    if diff > 1e-4:
        print("error: the two loops diverged; the comparison is not like for like", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
