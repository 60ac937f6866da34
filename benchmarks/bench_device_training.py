"""The main job's device training against a hand-written loop: fedhpc sequential and batched / plain.

Issue 41 asks for the sequential path at the plain loop's speed (<= 1.10x on a GPU, <= 1.05x on the
CPU) on the FD / Mix2FLD main job's device training too, not only on FedAvg's rows of
``bench_gpu.py``. The rows are ``launch/mix2fld_digits.yaml`` (10 devices, the 64-128-10 MLP, 2
epochs at batch 10) as Mix2FLD runs it and as FD runs it (``--algo fd``):

* ``mix2fld``: each device trains the downloaded global model on Eq. 1 while summing its softmax
  outputs per label (Eq. 2), and uploads the per-label average table;
* ``fd``: each device trains *its own* model (kept across rounds) on Eq. 3, cross-entropy plus
  beta times the cross-entropy to the global per-label output of the sample's label, from the
  table of the round before, with the same Eq. 2 sums.

"plain" is that device loop as a researcher writes it: ``load_state_dict``, a fresh
``torch.optim.SGD``, the batches in fedhpc's order (``ClientContext.batches``' rule), the sums by
``index_add_``, the devices' tables summed in float64; FD's models kept in a dict and its teacher
averaged from the sums by hand. Only the device training is timed (fedhpc's ``Engine._train_clients``,
the plain loop's device loop): the server's output-to-model conversion (Mix2FLD's K_s steps), the
round's all-reduce and the evaluation are not device training. Mix2FLD's plain devices start each
round from the sequential engine's global model and FD's distil from its table, so both train the
same models; every round the plain devices' summed tables are compared with what the sequential
engine's devices uploaded, and after the last round FD's device models too. Without a channel (``--channel none``; Mix2FLD's seeds
``--seed-delivery always``): the plain loop has no link model, and with every link delivered the
devices' work is the same.

The three modes run in one process, their rounds interleaved (the order rotating each round), so
that machine noise hits them alike; a ratio is the median of the per-round ratios.

    python benchmarks/bench_device_training.py [--only mix2fld,fd] [--rounds 10] [--warmup 2]
                                               [--k 10] [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fedhpc.config import parse_args  # noqa: E402
from fedhpc.engine import Engine, sample_clients  # noqa: E402
from fedhpc.models import build_model  # noqa: E402
from fedhpc.seeding import derive_seed  # noqa: E402
from fedhpc.world import World  # noqa: E402

MAIN_JOB = ["--config", os.path.join(REPO, "launch", "mix2fld_digits.yaml"), "--channel", "none"]
ROWS = {"mix2fld": MAIN_JOB + ["--seed-delivery", "always"], "fd": MAIN_JOB + ["--algo", "fd"]}


def engine(argv, k, device, rounds):
    cfg, algo_opts, data_opts = parse_args(argv + ["--clients-at-once", str(k), "--rounds", str(rounds),
                                                   "--device", device, "--threads", "1", "--quiet", "--no-out",
                                                   "--no-tensorboard", "--stop-epsilon", "0"])
    eng = Engine(cfg, algo_opts, data_opts, World(device, threads=1))
    eng.device_seconds, eng.uploaded = [], []
    train_clients, aggregate = eng._train_clients, eng.algo.aggregate
    sync = torch.cuda.synchronize if eng.world.device.type == "cuda" else (lambda: None)

    def timed_train_clients(*a, **kw):  # the device training alone
        sync()
        t0 = time.perf_counter()
        train_clients(*a, **kw)
        sync()
        eng.device_seconds.append(time.perf_counter() - t0)

    def recording_aggregate(global_state, totals, weight_total, rnd):  # what the devices uploaded
        eng.uploaded.append({k: totals[k].detach().double().cpu().clone() for k in ("label_outputs", "label_presence")})
        return aggregate(global_state, totals, weight_total, rnd)

    eng._train_clients, eng.algo.aggregate = timed_train_clients, recording_aggregate
    return eng


class PlainDevices:
    """The device loop by hand, on the sequential engine's data, cohorts and initial weights."""

    def __init__(self, eng, fd: bool):
        self.eng, self.fd, self.cfg, self.data = eng, fd, eng.cfg, eng.data
        self.device = eng.world.device
        self.model = build_model(eng.model_name, self.data.model_input_shape(train=True), self.data.num_classes,
                                 self.cfg.model_options).to(self.device)
        self.initial = self._state(eng.global_state)
        self.own = {}  # FD: each device's model, kept across rounds
        self.teacher = None  # FD: (G_out float32, mask) of the round before
        self.beta = getattr(eng.algo.options, "beta", 0.0)
        self.seconds, self.uploaded = [], []

    def _state(self, flat):
        return {k: v.clone().to(self.device) for k, v in self.eng.flat.state_dict_from(flat).items()}

    def round(self, t, global_sd, teacher=None):
        cfg, c = self.cfg, self.data.num_classes
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sampled = sample_clients(cfg.seed, t, self.data.num_clients, cfg.clients_per_round)
        sync()
        t0 = time.perf_counter()
        sums = torch.zeros(c, c, dtype=torch.float64, device=self.device)
        present = torch.zeros(c, dtype=torch.float64, device=self.device)
        if self.fd and teacher is not None:
            self.teacher = teacher
        for cid in sampled:
            client = self.data.client(cid).training_on(self.device)
            x_all, y_all = self.data.transform(client.x, True, None), client.y
            self.model.load_state_dict(self.own.get(cid, self.initial) if self.fd else global_sd)
            opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr * cfg.lr_decay ** t, momentum=cfg.momentum,
                                  weight_decay=cfg.weight_decay)
            out_sums = torch.zeros(c, c, dtype=torch.float64, device=self.device)
            counts = torch.zeros(c, dtype=torch.float64, device=self.device)
            n = client.num_train
            for e in range(cfg.local_epochs):
                g = torch.Generator().manual_seed(derive_seed(cfg.seed, "batches", t, cid, e))
                perm = torch.randperm(n, generator=g).to(self.device)
                for s in range(0, n, cfg.batch_size):
                    idx = perm[s:s + cfg.batch_size]
                    x, y = x_all[idx], y_all[idx]
                    opt.zero_grad(set_to_none=True)
                    logits = self.model(x)
                    with torch.no_grad():  # Eq. 2
                        out_sums.index_add_(0, y, F.softmax(logits.detach(), -1).double())
                        counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
                    loss = F.cross_entropy(logits, y)
                    if self.fd and self.teacher is not None and self.beta > 0:  # Eq. 3
                        table, mask = self.teacher
                        psi = -(table[y] * F.log_softmax(logits, -1)).sum(-1)
                        loss = loss + self.beta * (psi * mask[y]).sum() / y.shape[0]
                    loss.backward()
                    opt.step()
            sums += out_sums / counts.clamp_min(1).unsqueeze(1)
            present += (counts > 0).double()
            if self.fd:
                self.own[cid] = {k: v.clone() for k, v in self.model.state_dict().items()}
        sync()
        self.seconds.append(time.perf_counter() - t0)
        self.uploaded.append({"label_outputs": sums.cpu().reshape(-1), "label_presence": present.cpu()})
        if self.fd and float(present.sum()) > 0:  # Eq. 3's average, the next round's teacher (unless given)
            g_out = sums / present.clamp_min(1).unsqueeze(1)
            self.teacher = (g_out.float(), (present > 0).float())


def one_row(name, args):
    rounds = args.warmup + args.rounds
    seq, bat = engine(ROWS[name], 1, args.device, rounds), engine(ROWS[name], args.k, args.device, rounds)
    plain = PlainDevices(seq, fd=name == "fd")
    modes = ["plain", "seq", "batched"]
    for t in range(rounds):
        # the plain devices start where the sequential engine's do now: Mix2FLD's from its global model,
        # FD's distilling from its table (the engine's, from uploads rounded to its exact-sum grid)
        global_sd = plain._state(seq.global_state)
        teacher = None if getattr(seq.algo, "teacher", None) is None else tuple(x.clone() for x in seq.algo.teacher)
        shift = t % 3
        for mode in modes[shift:] + modes[:shift]:
            if mode == "plain":
                plain.round(t, global_sd, teacher)
            else:
                (seq if mode == "seq" else bat).run_round(t)
    timed = slice(args.warmup, None)
    s, b, p = seq.device_seconds[timed], bat.device_seconds[timed], plain.seconds[timed]
    # the devices' uploads: the plain loop's against the sequential engine's, every round
    up = max(float((a[k] - q[k]).abs().max()) for a, q in zip(plain.uploaded, seq.uploaded) for k in a)
    up_batched = max(float((a[k] - q[k]).abs().max()) for a, q in zip(bat.uploaded, seq.uploaded) for k in a)
    models = 0.0
    if name == "fd":  # the devices' own models after the last round
        for cid, sd in plain.own.items():
            mine = seq.flat.state_dict_from(seq.algo.client_model(cid))
            models = max(models, max(float((sd[k].double().cpu() - mine[k].double()).abs().max()) for k in sd))
    return {"row": name, "k": args.k, "rounds": args.rounds, "device": str(seq.world.device),
            "plain_ms": 1e3 * statistics.median(p), "seq_ms": 1e3 * statistics.median(s),
            "batched_ms": 1e3 * statistics.median(b),
            "seq_over_plain": statistics.median([x / y for x, y in zip(s, p)]),
            "batched_over_plain": statistics.median([x / y for x, y in zip(b, p)]),
            "upload_diff_seq_plain": up, "upload_diff_batched_seq": up_batched, "fd_model_diff_seq_plain": models}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--k", type=int, default=10, help="--clients-at-once of the batched engine")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"device {args.device}, torch {torch.__version__}, {args.rounds} timed rounds after {args.warmup}, "
          f"K = {args.k}; device training only (Engine._train_clients / the plain device loop)")
    print("| row | plain ms | seq ms | batched ms | seq / plain | batched / plain | max abs upload seq - plain "
          "| max abs upload batched - seq | FD models seq - plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in args.only.split(","):
        r = one_row(name, args)
        rows.append(r)
        print(f"| {name} | {r['plain_ms']:.1f} | {r['seq_ms']:.1f} | {r['batched_ms']:.1f} | {r['seq_over_plain']:.3f} "
              f"| {r['batched_over_plain']:.3f} | {r['upload_diff_seq_plain']:.1e} | {r['upload_diff_batched_seq']:.1e} "
              f"| {r['fd_model_diff_seq_plain']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
