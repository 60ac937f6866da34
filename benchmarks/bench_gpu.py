"""Rounds/s and GPU utilisation of FedAvg on one GPU: a plain loop, sequential vs batched clients, and ranks sharing the GPU.

Issue 14's GPU part, with issue 41's plain row. Each fedhpc row is a real launcher run
(``python -m fedhpc.launch``, under ``torch.distributed.run`` for several ranks) on the GPU in
hand; the ``plain`` row is this file's hand-written loop (:func:`plain_worker`) in a process of
its own; this script watches each from outside:

* rounds/s = 1 / median(round_seconds) over the rounds after ``--warmup`` (round_seconds is
  the engine's own per-round time; it excludes start-up and the final evaluation);
* GPU utilisation = mean of NVML's "utilization.gpu" (share of time a kernel ran), sampled
  every 20 ms while the timed rounds run (the window opens when metrics.jsonl has ``warmup``
  lines and closes at the second-to-last; it includes each round's small evaluation);
* GPU memory = the most NVML saw in use on the device during the window (all processes);
* time / plain = a row's median round time over the plain loop's, both from this one run of
  the script (with ``--repeats N`` the modes of a workload alternate N times and the ratio is
  the median of the N per-repeat ratios; each repeat starts at the next mode);
* |w - w_plain|, |w - w_seq| = largest weight difference from the plain loop and from the
  sequential 1-rank run of the same workload, the check that every row did the same work
  (fedhpc equals the plain loop and batched clients the sequential path within float
  rounding; ranks sharing a GPU equal one rank).

Workloads (FedAvg, SGD lr 0.05, 1 local epoch, IID; the global test set is evaluated every round, outside round_seconds, on 1000 or fewer samples):

* ``cnn``: the digits CNN on digits (8x8), 100 clients x ~15 samples, batch 5, 10 per round
  (workload (a) of bench_overhead.py with the CNN), and ``cnn50``: 50 per round;
* ``cnn_bn_do``: ``cnn`` with BatchNorm after each convolution and dropout 0.3 before the head
  (batched clients with per-client statistics and masks, issue 41);
* ``lenet5``: LeNet-5 on synthetic 1x28x28 (MNIST's shape), 200 clients x 60, batch 10, 20 per round;
* ``resnet18``: ResNet-18 on synthetic 3x64x64 (ImageNet-200's shape, 200 classes), 40 clients
  x 100, batch 32, 10 per round; BatchNorm for the sequential row ``resnet18_bn``, ``norm=none``
  (what batched clients need) for the others.

Modes: ``plain`` (what a researcher writes by hand: one model, the round's clients in turn,
``load_state_dict`` of the global weights, a fresh ``torch.optim.SGD``, the client's batches,
then the sample-weighted average of the state dicts in float64; on the engine's own data,
cohorts (``sample_clients``), batch order, initial weights, thread count and GPU numerics, taken
from an ``Engine`` built from the row's launcher arguments, which trains nothing), ``seq`` (1
rank, one client after another), ``batched`` (1 rank, ``--clients-at-once`` = clients per
round), ``ranks2`` / ``ranks4`` (2 / 4 ranks on the one GPU, sequential clients; their
collectives go over gloo through host memory, see fedhpc/world.py agree_backend). Any other
mode is refused. Both the plain loop and the engine move a client's training data to the
device when it trains (``ClientData.training_on``) and end a round synchronised with it.

    python benchmarks/bench_gpu.py [--rounds 20] [--warmup 3] [--only cnn,lenet5] [--modes plain,seq,batched]
                                   [--repeats 1] [--threads N] [--json OUT.json]
    python benchmarks/bench_gpu.py --device cpu --in-process --only cnn,cnn50,lenet5 --modes plain,seq,batched \\
                                   --rounds 12 --warmup 2 --threads 1                 # the CPU table

``--in-process`` runs the plain, seq and batched rows in this one process instead, interleaved round
by round with the order rotating (:func:`in_process`; no NVML, no test accuracy): the ratios to take
on a machine shared with other work, where separate processes seconds apart see different loads.

On ``--device cuda`` (the default) it needs a CUDA GPU (exits otherwise); ``--device cpu``
runs the same rows on the CPU without NVML. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

COMMON = ["--algo", "fedavg", "--lr", "0.05", "--local-epochs", "1", "--partition", "iid", "--quiet",
          "--no-tensorboard", "--checkpoint-every", "0", "--client-test-fraction", "0", "--no-local-eval"]

WORKLOADS = {
    "cnn": dict(args=["--dataset", "digits", "--model", "cnn", "--num-clients", "100", "--batch-size", "5"],
                per_round=10),
    "cnn50": dict(args=["--dataset", "digits", "--model", "cnn", "--num-clients", "100", "--batch-size", "5"],
                  per_round=50),
    "cnn_bn_do": dict(args=["--dataset", "digits", "--model", "cnn", "--model-opt", "norm=batch", "--model-opt",
                            "dropout=0.3", "--num-clients", "100", "--batch-size", "5"], per_round=10),
    "lenet5": dict(args=["--dataset", "synthetic", "--data-opt", "shape=1x28x28", "--data-opt", "train_samples=12000",
                         "--data-opt", "test_samples=1000", "--model", "lenet5", "--num-clients", "200",
                         "--batch-size", "10"], per_round=20),
    "resnet18": dict(args=["--dataset", "synthetic", "--data-opt", "shape=3x64x64", "--data-opt", "classes=200",
                           "--data-opt", "train_samples=4000", "--data-opt", "test_samples=400", "--model", "resnet18",
                           "--model-opt", "norm=none", "--num-clients", "40", "--batch-size", "32"], per_round=10),
    "resnet18_bn": dict(args=["--dataset", "synthetic", "--data-opt", "shape=3x64x64", "--data-opt", "classes=200",
                              "--data-opt", "train_samples=4000", "--data-opt", "test_samples=400", "--model",
                              "resnet18", "--num-clients", "40", "--batch-size", "32"], per_round=10,
                        modes=("plain", "seq")),
}
MODES = ("plain", "seq", "batched", "ranks2", "ranks4")


class GpuWatch:
    """NVML utilisation and memory samples of GPU 0 while ``active`` is set."""

    def __init__(self, period=0.02):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period
        self.active, self.stop = threading.Event(), threading.Event()
        self.util, self.mem = [], []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            if self.active.is_set():
                self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
                self.mem.append(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            time.sleep(self.period)

    def close(self):
        self.stop.set()
        self.thread.join()


def clean_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("PMI_", "OMPI_COMM", "SLURM_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def plain_round(model, global_sd, data, cfg, t, device):
    """One FedAvg round as a researcher writes it by hand (bench_round.py's loop, on ``device``):
    load the global weights, a fresh SGD, the client's batches, the weighted average of the state
    dicts in float64 (BatchNorm's running statistics included). Batch order: ClientContext.batches'
    rule; inputs through the dataset's own (non-augmenting) transform; with dropout, torch seeded
    per client as fedhpc seeds it (``torch.manual_seed``, as a script would)."""
    from fedhpc.engine import sample_clients
    from fedhpc.seeding import derive_seed

    sampled = sample_clients(cfg.seed, t, data.num_clients, cfg.clients_per_round)
    lr = cfg.lr * cfg.lr_decay ** t
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_sd.items()}
    weight = 0.0
    draws = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    for cid in sampled:
        client = data.client(cid).training_on(device)
        x_all, y_all = data.transform(client.x, True, None), client.y
        if draws:  # a seed per client for the dropout masks, the one fedhpc's sequential loop uses
            torch.manual_seed(derive_seed(cfg.seed, "client", t, cid))
        model.load_state_dict(global_sd)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                              weight_decay=cfg.weight_decay)
        n = client.num_train
        for e in range(cfg.local_epochs):
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, "batches", t, cid, e))
            perm = torch.randperm(n, generator=g).to(device)
            for s in range(0, n, cfg.batch_size):
                idx = perm[s:s + cfg.batch_size]
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
                loss.backward()
                opt.step()
        for k, v in model.state_dict().items():
            total[k] += n * v.double()
        weight += n
    return {k: (v / weight).to(global_sd[k].dtype) for k, v in total.items()}


def plain_worker(argv):
    """``bench_gpu.py --plain-worker LAUNCHER_ARGS...``: the plain loop of one row, in a process of its
    own as the launcher rows are. An Engine built from the row's launcher arguments (same World: device,
    threads, deterministic numerics) supplies the data, cohorts and initial weights and trains nothing;
    the loop writes metrics.jsonl (round_seconds per round, test accuracy at the end) and final_model.pt
    to ``--out`` as the launcher does."""
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.models import build_model
    from fedhpc.world import World

    cfg, algo_options, data_options = parse_args(argv)
    unsupported = {"algo": cfg.algo != "fedavg", "optimizer": cfg.optimizer != "sgd", "grad_clip": cfg.grad_clip > 0,
                   "cold_start_fraction": cfg.cold_start_fraction > 0, "channel": cfg.channel != "none"}
    if any(unsupported.values()):
        sys.exit(f"the plain loop is FedAvg with plain SGD only; unsupported here: "
                 f"{[k for k, v in unsupported.items() if v]}")
    world = World(cfg.device, cfg.threads, cfg.collective_timeout, cfg.collective_backend, cfg.deterministic)
    eng = Engine(cfg, algo_options, data_options, world)
    data, device = eng.data, world.device
    if data.augments:
        sys.exit("the plain loop does not replay the engine's augmentation stream; use a dataset without it")
    model = build_model(eng.model_name, data.model_input_shape(train=True), data.num_classes,
                        cfg.model_options).to(device)
    global_sd = {k: v.clone() for k, v in eng.flat.state_dict_from(eng.global_state).items()}
    model.train()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "metrics.jsonl"), "w") as f:
        for t in range(cfg.rounds):
            t0 = time.perf_counter()
            global_sd = plain_round(model, global_sd, data, cfg, t, device)
            sync()
            record = {"round": t + 1, "round_seconds": time.perf_counter() - t0}
            if t + 1 == cfg.rounds:  # the final model's test accuracy (the launcher rows evaluate every round)
                model.load_state_dict(global_sd)
                model.eval()
                correct = 0
                with torch.no_grad():
                    for start in range(0, data.num_test(), 1000):
                        x, y = data.test_slice(start, min(start + 1000, data.num_test()))
                        pred = model(data.transform(x.to(device), False, None)).argmax(1)
                        correct += int((pred == y.to(device)).sum())
                record["test_accuracy"] = correct / data.num_test()
            f.write(json.dumps(record) + "\n")
            f.flush()
    torch.save(global_sd, os.path.join(cfg.out, "final_model.pt"))
    world.close()
    sys.stdout.flush()
    os._exit(0)  # as the launcher leaves (fedhpc.launch.exit_now)


def run_one(name, mode, args, tmp, repeat=0):
    w = WORKLOADS[name]
    out = os.path.join(tmp, f"{name}-{mode}-{repeat}")
    launch = ["--device", args.device, *COMMON, *w["args"], "--clients-per-round", str(w["per_round"]),
              "--rounds", str(args.rounds), "--eval-every", "1", "--out", out]
    if args.threads:
        launch += ["--threads", str(args.threads)]
    if mode == "plain":
        cmd = [sys.executable, os.path.abspath(__file__), "--plain-worker", *launch]
    else:
        cmd = [sys.executable, "-m", "fedhpc.launch", *launch]
    if mode == "batched":
        cmd += ["--clients-at-once", str(w["per_round"])]
    if mode.startswith("ranks"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", mode[5:],
               "--master-port", str(port)] + cmd[1:]
    watch = GpuWatch() if args.nvml else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_path = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None:  # open the window after the warm-up rounds, close it before the last
        n = len(lines(metrics_path))
        if watch is not None:
            if args.warmup <= n < args.rounds - 1:
                watch.active.set()
            else:
                watch.active.clear()
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    _, err = proc.communicate()
    if watch is not None:
        watch.close()
    if proc.returncode != 0:
        return {"workload": name, "mode": mode, "repeat": repeat, "error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    rows = lines(metrics_path)
    secs = [r["round_seconds"] for r in rows[args.warmup:]]
    res = {"workload": name, "mode": mode, "repeat": repeat, "rounds_per_s": 1.0 / statistics.median(secs),
           "round_ms": 1e3 * statistics.median(secs), "process_s": wall,
           "test_accuracy": rows[-1].get("test_accuracy"), "out": out}
    if watch is not None and watch.util:
        res["gpu_util"] = statistics.mean(watch.util)
        res["gpu_mem_gib"] = max(watch.mem) / 2 ** 30
    res["note"] = next((l[len("note: "):] for l in err.splitlines() if l.startswith("note: ")), "")
    return res


class InProcessRounds:
    """The workload's plain, seq and batched runs side by side in this process: Engines from the rows'
    launcher arguments (``run_round``) and the plain loop (:func:`plain_round`) on the seq engine's data,
    cohorts and initial weights. ``run(mode, t)`` runs round ``t`` of one; ``sync()`` waits for the GPU."""

    def __init__(self, name, modes, args):
        from fedhpc.config import parse_args
        from fedhpc.engine import Engine
        from fedhpc.models import build_model
        from fedhpc.world import World

        w = WORKLOADS[name]
        base = ["--device", args.device, *COMMON, *w["args"], "--clients-per-round", str(w["per_round"]),
                "--rounds", str(args.rounds), "--no-out"] + (["--threads", str(args.threads)] if args.threads else [])
        self.engines, self.plain = {}, None
        for mode in ("seq", "batched"):
            if mode in modes:
                extra = ["--clients-at-once", str(w["per_round"])] if mode == "batched" else []
                cfg, ao, do = parse_args(base + extra)
                self.engines[mode] = Engine(cfg, ao, do, World(cfg.device, cfg.threads, cfg.collective_timeout,
                                                               cfg.collective_backend, cfg.deterministic))
        cfg, ao, do = parse_args(base)
        self.cfg = cfg
        if "plain" in modes:
            eng = self.engines.get("seq") or Engine(cfg, ao, do, World(cfg.device, cfg.threads, cfg.collective_timeout,
                                                                        cfg.collective_backend, cfg.deterministic))
            device = eng.world.device
            model = build_model(eng.model_name, eng.data.model_input_shape(train=True), eng.data.num_classes,
                                cfg.model_options).to(device)
            self.plain = {"data": eng.data, "model": model, "device": device,
                          "sd": {k: v.clone().to(device) for k, v in eng.flat.state_dict_from(eng.global_state).items()}}
        device = next(iter(self.engines.values())).world.device if self.engines else self.plain["device"]
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.order = [m for m in MODES if m in modes and m in ("plain", "seq", "batched")]

    def run(self, mode, t):
        if mode == "plain":
            p = self.plain
            p["sd"] = plain_round(p["model"], p["sd"], p["data"], self.cfg, t, p["device"])
        else:
            self.engines[mode].run_round(t)


def in_process(name, modes, args):
    """``--in-process``: the workload's plain, seq and batched rounds in this one process, interleaved round
    by round (the order rotating each round), as bench_round.py and bench_batched.py measure on the CPU:
    on a machine shared with other work a slow spell then hits every mode alike. Engines from the rows'
    launcher arguments; only ``run_round`` and the plain round are timed (synchronised on a GPU).
    Returns one row per mode, its ratios the medians of the per-round ratios."""
    rounds = InProcessRounds(name, modes, args)
    engines, plain, order = rounds.engines, rounds.plain, rounds.order
    times = {m: [] for m in order}
    for t in range(args.rounds):
        turn = order[t % len(order):] + order[:t % len(order)]
        for mode in turn:
            rounds.sync()
            t0 = time.perf_counter()
            rounds.run(mode, t)
            rounds.sync()
            if t >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    finals = {m: e.flat.state_dict_from(e.global_state) for m, e in engines.items()}
    if plain is not None:
        finals["plain"] = {k: v.cpu() for k, v in plain["sd"].items()}

    def diff(a, b):
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())

    def ratio(mode, ref):
        if ref not in times:
            return float("nan")
        return statistics.median(a / b for a, b in zip(times[mode], times[ref]))

    rows = []
    for mode in order:
        med = statistics.median(times[mode])
        rows.append({"workload": name, "mode": mode, "repeat": 0, "rounds_per_s": 1.0 / med, "round_ms": 1e3 * med,
                     "time_vs_plain": ratio(mode, "plain"), "speed_vs_seq": 1.0 / ratio(mode, "seq"),
                     "max_diff_vs_plain": diff(finals[mode], finals["plain"]) if "plain" in finals else float("nan"),
                     "max_diff_vs_seq": diff(finals[mode], finals["seq"]) if "seq" in finals else float("nan"),
                     "round_ms_each": [round(1e3 * x, 2) for x in times[mode]]})
    return rows


def weights_diff(a_dir, b_dir):
    """Largest absolute difference over the floating-point entries both final models hold."""
    a = torch.load(os.path.join(a_dir, "final_model.pt"), map_location="cpu")
    b = torch.load(os.path.join(b_dir, "final_model.pt"), map_location="cpu")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and a[k].is_floating_point())


def parse_modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or [text]}: choose from {', '.join(MODES)}")
    return modes


def median_ratio(results, name, mode, ref_mode):
    """Median over repeats of (mode's round ms / ref_mode's round ms), each repeat's pair from one alternation."""
    ratios = []
    for r in results:
        if r["workload"] == name and r["mode"] == mode and "error" not in r:
            ref = next((q for q in results if q["workload"] == name and q["mode"] == ref_mode
                        and q["repeat"] == r["repeat"] and "error" not in q), None)
            if ref:
                ratios.append(r["round_ms"] / ref["round_ms"])
    return statistics.median(ratios) if ratios else float("nan")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--plain-worker":
        return plain_worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--repeats", type=int, default=1, help="alternate a workload's modes this many times")
    ap.add_argument("--threads", type=int, default=0, help="--threads for every row (0: the launcher's choice)")
    ap.add_argument("--json", default="", help="also write every row here")
    ap.add_argument("--no-nvml", dest="nvml", action="store_false", help="no utilisation sampling")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--in-process", action="store_true",
                    help="plain, seq and batched in this one process, interleaved round by round (no NVML)")
    args = ap.parse_args()
    unknown = [n for n in args.only.split(",") if n and n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}: choose from {', '.join(WORKLOADS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU (or --device cpu)")
    if args.device == "cpu" or args.in_process:
        args.nvml = False
    names = [n for n in WORKLOADS if not args.only or n in args.only.split(",")]
    modes = args.modes
    print(f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}, torch {torch.__version__}; FedAvg, "
          f"{args.rounds} rounds, median round time after {args.warmup} warm-up rounds, {args.repeats} repeat(s), "
          f"threads {args.threads or 'the launcher default'}", flush=True)
    results = []
    if args.in_process:
        bad = [m for m in modes if m not in ("plain", "seq", "batched")]
        if bad:
            ap.error(f"--in-process runs plain, seq and batched only, not {bad}")
        print("in one process, the modes interleaved round by round (run_round and the plain round timed)", flush=True)
        for name in names:
            for r in in_process(name, [m for m in modes if m in WORKLOADS[name].get("modes", MODES)], args):
                results.append(r)
                print(json.dumps(r), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names if not args.in_process else []:
            for repeat in range(args.repeats):
                ref = {}
                todo = [m for m in MODES if m in modes and m in WORKLOADS[name].get("modes", MODES)]
                # each repeat starts at another mode, so that a slow spell of a shared machine does not
                # always fall on the same one; the weight checks wait for their reference runs
                todo = todo[repeat % len(todo):] + todo[:repeat % len(todo)]
                done = []
                for mode in todo:
                    r = run_one(name, mode, args, tmp, repeat)
                    done.append(r)
                    if "error" not in r and mode in ("plain", "seq"):
                        ref[mode] = r["out"]
                for r in done:
                    mode = r["mode"]
                    if "error" not in r:
                        for m in ("plain", "seq"):
                            r[f"max_diff_vs_{m}"] = weights_diff(ref[m], r["out"]) if m in ref else float("nan")
                    results.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "out"}), flush=True)
    print("\n| workload | mode | rounds/s | round ms | time / plain | x seq | GPU util % | GPU mem GiB "
          "| max abs w - w_plain | max abs w - w_seq | test acc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for mode in MODES:
            rows = [r for r in results if r["workload"] == name and r["mode"] == mode]
            if not rows:
                continue
            ok = [r for r in rows if "error" not in r]
            if not ok:
                print(f"| {name} | {mode} | error: {rows[0]['error']} | | | | | | | | |")
                continue
            med = lambda key: statistics.median(r.get(key, float("nan")) for r in ok)  # noqa: E731
            if args.in_process:
                vs_plain, speed = ok[0]["time_vs_plain"], ok[0]["speed_vs_seq"]
            else:
                vs_plain, speed = median_ratio(results, name, mode, "plain"), 1.0 / median_ratio(results, name, mode, "seq")
            print(f"| {name} | {mode} | {med('rounds_per_s'):.2f} | {med('round_ms'):.1f} | "
                  f"{vs_plain:.3f} | {speed:.2f} | {med('gpu_util'):.0f} | "
                  f"{med('gpu_mem_gib'):.2f} | {max(r['max_diff_vs_plain'] for r in ok):.1e} | "
                  f"{max(r['max_diff_vs_seq'] for r in ok):.1e} | {ok[-1].get('test_accuracy', float('nan')):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "out"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
