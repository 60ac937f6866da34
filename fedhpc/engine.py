"""The round loop: sampling, sharding clients over ranks, one flat all-reduce, evaluation,
checkpoints and logging. It knows nothing about any specific algorithm: everything
algorithm-specific happens in the hooks of :class:`fedhpc.algorithms.Algorithm`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from . import checkpoint
from .algorithms import ALGORITHMS, ClientContext, RoundInfo, load_algorithm_modules
from .algorithms.base import derive_seed, task_loss
from .client_state import ClientStateStore
from .config import RunConfig
from .data import ClientData, build_dataset
from .errors import CheckpointError, ConfigError, NonFiniteLossError
from .flat import FlatModel
from .io import atomic_torch_save, atomic_write_text
from .models import build_model
from .world import World

#: exit code after a SIGTERM/SIGUSR1 checkpoint: "temporary failure, run again with --resume"
EXIT_PREEMPTED = 75


class Preempted(Exception):
    def __init__(self, round_done: int):
        self.round_done = round_done


def sample_clients(seed: int, round_index: int, num_clients: int, k: int) -> List[int]:
    """K distinct clients, uniformly, fixed by (seed, round): the same on every rank."""
    rng = np.random.default_rng([seed, 0x5A3F, round_index])
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def assign_clients(sampled: List[int], sizes: np.ndarray, world_size: int) -> Dict[int, int]:
    """cid -> rank, balancing training samples: largest client first onto the least-loaded rank."""
    load = [0] * world_size
    out = {}
    for cid in sorted(sampled, key=lambda c: (-int(sizes[c]), c)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[cid] = r
        load[r] += int(sizes[cid])
    return out


class Engine:
    def __init__(self, cfg: RunConfig, algo_options, data_options, world: World):
        self.cfg, self.world = cfg, world
        self.is_main = world.rank == 0
        load_algorithm_modules()
        algo_cls = ALGORITHMS.get(cfg.algo)
        self.data = build_dataset(cfg, data_options)
        if cfg.clients_per_round > self.data.num_clients:
            raise ConfigError(f"--clients-per-round {cfg.clients_per_round} exceeds the dataset's "
                              f"{self.data.num_clients} clients; lower it")
        self.sizes = np.asarray(self.data.client_sizes())
        model_name = cfg.model if cfg.model != "auto" else self.data.default_model()
        self.model_name = model_name
        torch.manual_seed(derive_seed(cfg.seed, "init"))  # same initial model on every rank
        model = build_model(model_name, self.data.input_shape, self.data.num_classes, cfg.model_options)
        self.model = model.to(world.device)
        self.flat = FlatModel(self.model)
        self.global_state = self.flat.flat.detach().clone()

        # Created only if a state is ever spilled; removed when the run ends.
        spill = (os.path.join(cfg.out, "client_state_spill") if cfg.out else
                 os.path.join(tempfile.gettempdir(), f"fedhpc-state-{os.getpid()}"))
        self.client_state = ClientStateStore(world, int(cfg.client_state_budget_mb * 2**20), spill)
        self.algo = algo_cls(cfg, algo_options, self.model, self.flat, self.data, world, self.client_state)
        self.algo.setup()

        # Layout of the one buffer all-reduced per round: the algorithm's uploads, then metrics.
        self.upload_slices: Dict[str, Tuple[slice, str]] = {}
        offset = 0
        for name, (numel, kind) in self.algo.upload_spec().items():
            self.upload_slices[name] = (slice(offset, offset + numel), kind)
            offset += numel
        self.metric_slots = ["weight", "loss_sum", "samples", "nonfinite", "stop"]
        self.metric_offset = offset
        self.ledger_offset = offset + len(self.metric_slots)
        n_ledger = 2 * len(self.algo.ledger_kinds)
        # float64 so the weighted sums barely depend on summation order, i.e. on the rank count.
        self.round_buffer = torch.zeros(self.ledger_offset + n_ledger, dtype=torch.float64,
                                        device=world.device)
        self.start_round = 0
        self.cum_bytes = {"bytes_up_total": 0.0, "bytes_down_total": 0.0}
        self._stop_signal: Optional[int] = None
        self._tb = None
        self._metrics_file = None

    # ------------------------------------------------------------------ one round
    def _slot(self, name: str) -> int:
        return self.metric_offset + self.metric_slots.index(name)

    def run_round(self, t: int) -> Dict[str, float]:
        cfg, world, algo = self.cfg, self.world, self.algo
        t0 = time.perf_counter()
        sampled = sample_clients(cfg.seed, t, self.data.num_clients, cfg.clients_per_round)
        assignment = assign_clients(sampled, self.sizes, world.size)
        mine = [c for c in sampled if assignment[c] == world.rank]
        rnd = RoundInfo(t, sampled, mine, cfg.lr * cfg.lr_decay ** t)
        if algo.uses_client_state:
            self.client_state.migrate(assignment)
        algo.global_state = self.global_state
        algo.ledger.reset()  # before round_begin: traffic booked during its exchanges counts
        algo.round_begin(rnd)

        buf = self.round_buffer
        buf.zero_()
        nonfinite: List[int] = []
        self.model.train()
        for cid in mine:
            client = self._to_device(self.data.client(cid))
            torch.manual_seed(derive_seed(cfg.seed, "client", t, cid))  # dropout etc.
            self.flat.load_(self.global_state)
            ctx = ClientContext(algo, cid, client, rnd)
            algo.download(ctx)
            algo.local_update(self.model, ctx)
            loss_sum = float(ctx.loss_sum)  # one device sync per client
            if not math.isfinite(loss_sum):
                nonfinite.append(cid)
                continue
            weight = algo.client_weight(ctx)
            for name, tensor in algo.upload(self.model, ctx).items():
                sl, kind = self.upload_slices[name]
                buf[sl].add_(tensor.reshape(-1), alpha=weight)
                algo.ledger.add("up", kind, tensor.numel() * tensor.element_size())
            buf[self._slot("weight")] += weight
            buf[self._slot("loss_sum")] += loss_sum
            buf[self._slot("samples")] += ctx.samples
        buf[self._slot("nonfinite")] = len(nonfinite)
        buf[self._slot("stop")] = 1.0 if self._stop_signal else 0.0
        buf[self.ledger_offset:] = algo.ledger.values.to(buf)

        world.all_reduce_sum_(buf)  # the round's one collective: weighted sums + metrics

        if buf[self._slot("nonfinite")] > 0:
            bad = sorted(c for part in world.all_gather_object(nonfinite) for c in part)
            raise NonFiniteLossError(
                f"the training loss became NaN or infinite in round {t + 1} on client(s) {bad} "
                f"(lr {rnd.lr:g}); lower --lr, add --grad-clip, or check the data. Nothing of this "
                f"round was kept; the last checkpoint and metrics in --out are intact")
        weight_total = float(buf[self._slot("weight")])
        totals = {name: buf[sl] for name, (sl, _) in self.upload_slices.items()}
        new_state = algo.aggregate(self.global_state, totals, weight_total, rnd)
        self.global_state = new_state.detach().to(self.flat.flat.dtype).clone()
        ledger = algo.ledger.as_metrics(buf[self.ledger_offset:].double().cpu())
        self.cum_bytes["bytes_up_total"] += ledger["bytes_up"]
        self.cum_bytes["bytes_down_total"] += ledger["bytes_down"]
        samples = float(buf[self._slot("samples")])
        metrics = {
            "round": t + 1,
            "train_loss": float(buf[self._slot("loss_sum")]) / max(samples, 1.0),
            "lr": rnd.lr,
            "clients": len(sampled),
            **ledger, **self.cum_bytes,
            "round_seconds": time.perf_counter() - t0,
        }
        if buf[self._slot("stop")] > 0:
            metrics["stop"] = True
        return metrics

    def _to_device(self, c: ClientData) -> ClientData:
        d = self.world.device
        if d.type == "cpu":
            return c
        return ClientData(c.cid, c.x.to(d, non_blocking=True), c.y.to(d, non_blocking=True),
                          c.x_test.to(d, non_blocking=True), c.y_test.to(d, non_blocking=True))

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Global model on the global test set, sharded over ranks by contiguous slices."""
        self.flat.load_(self.global_state)
        self.model.eval()
        n = self.data.num_test()
        start, stop = n * self.world.rank // self.world.size, n * (self.world.rank + 1) // self.world.size
        sums = torch.zeros(3, dtype=torch.float64, device=self.world.device)
        for s in range(start, stop, self.cfg.eval_batch_size):
            x, y = self.data.test_slice(s, min(s + self.cfg.eval_batch_size, stop))
            x, y = x.to(self.world.device), y.to(self.world.device)
            logits = self.model(self.data.transform(x, False, None))
            sums[0] += task_loss(logits, y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
        self.world.all_reduce_sum_(sums)
        count = max(float(sums[2]), 1.0)
        return {"test_loss": float(sums[0]) / count, "test_accuracy": float(sums[1]) / count}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, round_done: int) -> None:
        server = {
            "identity": self.cfg.identity(),
            "model": self.model_name,
            "global_state": self.global_state.cpu(),
            "algo_state": self.algo.state_dict(),
            "cum_bytes": dict(self.cum_bytes),
        }
        store = self.client_state if self.algo.uses_client_state else None
        checkpoint.save(self.cfg.out, round_done, self.world, server, store)

    def restore(self) -> None:
        directory = checkpoint.latest(self.cfg.out)
        if directory is None:
            if self.is_main:
                print(f"no checkpoint in {self.cfg.out}: starting from round 0", flush=True)
            return
        body = checkpoint.load(directory, self.cfg.identity())
        state = body["global_state"]
        if state.shape != self.global_state.shape:
            raise CheckpointError(f"checkpoint {directory} holds a model of {state.numel()} values, "
                                  f"this run builds {self.global_state.numel()}; resume with the same model")
        self.global_state = state.to(self.world.device)
        self.algo.load_state_dict(body.get("algo_state") or {})
        self.cum_bytes = dict(body.get("cum_bytes", self.cum_bytes))
        if self.algo.uses_client_state:
            self.client_state.load_shards(body["client_state_dirs"])
        self.start_round = int(body["round"])
        if self.is_main:
            print(f"resumed from {directory} after round {self.start_round}", flush=True)

    # ------------------------------------------------------------------ outputs
    def _open_outputs(self) -> None:
        cfg = self.cfg
        if not (cfg.out and self.is_main):
            return
        os.makedirs(cfg.out, exist_ok=True)
        import yaml
        atomic_write_text(os.path.join(cfg.out, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        path = os.path.join(cfg.out, "metrics.jsonl")
        # On resume keep exactly the rounds the checkpoint covers: the resumed run then
        # appends what the uninterrupted run would have written.
        kept = []
        if os.path.exists(path):
            for line in open(path):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash
                if rec.get("round", 0) <= self.start_round:
                    kept.append(json.dumps(rec))
        atomic_write_text(path, "".join(k + "\n" for k in kept))
        self._metrics_file = open(path, "a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(cfg.out, "tensorboard"), purge_step=self.start_round + 1)
            except ImportError:
                print("warning: tensorboard is not installed; no event files (pip install tensorboard)")

    def _log(self, metrics: Dict[str, float]) -> None:
        if not self.is_main:
            return
        if self._metrics_file is not None and "test_accuracy" in metrics:
            self._metrics_file.write(json.dumps(metrics) + "\n")
            self._metrics_file.flush()
            os.fsync(self._metrics_file.fileno())
        if self._tb is not None:
            step = metrics["round"]
            for k, v in metrics.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if not self.cfg.quiet:
            line = (f"round {metrics['round']:4d}/{self.cfg.rounds} | train_loss {metrics['train_loss']:.4f}")
            if "test_accuracy" in metrics:
                line += f" | test_acc {metrics['test_accuracy']:.4f} | test_loss {metrics['test_loss']:.4f}"
            line += (f" | up {metrics['bytes_up'] / 2**20:.2f} MiB | down {metrics['bytes_down'] / 2**20:.2f} MiB"
                     f" | {metrics['round_seconds']:.2f} s")
            print(line, flush=True)

    def _close_outputs(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._tb is not None:
            self._tb.close()

    # ------------------------------------------------------------------ main loop
    def _on_signal(self, signum, frame):
        self._stop_signal = signum

    def run(self) -> Dict[str, float]:
        cfg = self.cfg
        if cfg.resume:
            self.restore()
        self._open_outputs()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
        final: Dict[str, float] = {}
        try:
            if self.is_main and not cfg.quiet:
                print(f"fedhpc: {cfg.algo} on {cfg.dataset} ({self.data.num_clients} clients, "
                      f"{cfg.clients_per_round} per round), model {self.model_name} "
                      f"({self.flat.num_params} parameters), {self.world.describe()}", flush=True)
            for t in range(self.start_round, cfg.rounds):
                metrics = self.run_round(t)
                last = t + 1 == cfg.rounds
                if last or (t + 1) % cfg.eval_every == 0:
                    metrics.update(self.evaluate())
                    final = metrics
                stop = metrics.pop("stop", False)
                self._log(metrics)
                if cfg.out and (stop or last or (cfg.checkpoint_every and (t + 1) % cfg.checkpoint_every == 0)):
                    self.save_checkpoint(t + 1)
                if stop and not last:
                    raise Preempted(t + 1)
            if not final:  # resumed a finished run: report the final model again
                final = {"round": cfg.rounds, **self.evaluate()}
            if cfg.out and self.is_main:
                atomic_torch_save(self.flat.state_dict_from(self.global_state),
                                  os.path.join(cfg.out, "final_model.pt"))
            if self.is_main and not cfg.quiet:
                print(f"final test accuracy {final['test_accuracy']:.4f} (test loss "
                      f"{final['test_loss']:.4f}) after {cfg.rounds} rounds", flush=True)
            return final
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._close_outputs()
            self.client_state.close()
            self.data.close()
