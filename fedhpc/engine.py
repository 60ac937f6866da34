"""The round loop: sampling, sharding clients over ranks, one flat all-reduce, evaluation
(:mod:`fedhpc.evaluation`), checkpoints (:mod:`fedhpc.resume`) and logging
(:mod:`fedhpc.run_log`). It knows nothing about any specific algorithm: everything
algorithm-specific happens in the hooks of :class:`fedhpc.algorithms.Algorithm`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .client_state import ClientStateStore
from .config import RunConfig, build_options, parse_rounds
from .config.auto import auto_line
from .data import build_dataset
from .errors import ConfigError, NonFiniteLossError
from .evaluation import Evaluation
from .flat import FlatModel, refuse_cumulative_batchnorm
from .io import atomic_torch_save
from .models import build_model
from .models.shapes import check_model_takes_inputs, check_single_sample_batches
from .registry import ALGORITHMS, load_algorithm_modules
from .reproducible_sum import MAX_TERMS, ReproducibleSum, storage_numel
from .resume import Resume
from .round import ClientContext, RoundInfo, Upload
from .run_log import RunLog
from .seeding import derive_seed, seed_torch
from .world import World, exact_sum_step

#: exit code after a SIGTERM/SIGUSR1 checkpoint: "temporary failure, run again with --resume"
EXIT_PREEMPTED = 75


class Preempted(Exception):
    def __init__(self, round_done: int):
        self.round_done = round_done


class StopNow(KeyboardInterrupt):
    """A second SIGTERM / SIGUSR1 while the first one's stop is pending: the run stops at once, as
    Ctrl-C does (the launcher's KeyboardInterrupt path, exit 130), instead of finishing a round that
    may take minutes. Checkpoints are written to a new folder that LATEST names only once complete,
    so the last complete checkpoint is what a --resume continues from."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum} received twice")
        self.signum = signum


def sample_clients(seed: int, round_index: int, num_clients: int, k: int) -> List[int]:
    """K distinct clients, uniformly, fixed by (seed, round): the same on every rank."""
    rng = np.random.default_rng([seed, 0x5A3F, round_index])
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def assign_clients(sampled: List[int], sizes: np.ndarray, world_size: int, group: int = 1) -> Dict[int, int]:
    """cid -> rank, balancing training samples: largest unit first onto the least-loaded rank.

    A unit is ``group`` consecutive clients of ``sampled`` (the ``--clients-at-once`` groups),
    kept on one rank: a batched group's float rounding depends on which clients it holds, so
    groups fixed before the ranks are chosen keep the results independent of the rank count
    (a rank's clients, in sampled order, split into the same groups)."""
    units = [(sum(int(sizes[c]) for c in sampled[i:i + group]), sampled[i:i + group])
             for i in range(0, len(sampled), group)]
    load = [0] * world_size
    out = {}
    for samples, unit in sorted(units, key=lambda u: (-u[0], u[1][0])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out.update({cid: r for cid in unit})
        load[r] += samples
    return out


class Engine(Evaluation, RunLog, Resume):
    def __init__(self, cfg: RunConfig, algo_options, data_options, world: World):
        self.cfg, self.world = cfg, world
        self.is_main = world.rank == 0
        load_algorithm_modules()
        algo_cls = ALGORITHMS.get(cfg.algo)
        # Files can be missing or damaged on one node only: agree before the first collective of
        # the run, so that rank 0 prints that rank's error instead of every rank waiting for it.
        failure: Optional[Exception] = None
        try:
            self.data = build_dataset(cfg, data_options)
        except Exception as e:  # noqa: BLE001 - re-raised on this rank by raise_together
            failure = e
        if world.size > 1 and any(world.all_gather_object(failure is not None)):
            world.raise_together(failure, "loading the dataset")
        if failure is not None:
            raise failure
        if cfg.clients_per_round > self.data.num_clients:
            raise ConfigError(f"--clients-per-round {cfg.clients_per_round} exceeds the dataset's "
                              f"{self.data.num_clients} clients; lower it")
        self.sizes = np.asarray(self.data.client_sizes())
        # Cold-start clients (pMixFed Sec. 10.2): a seeded share never trained, evaluated at the end.
        n = self.data.num_clients
        n_cold = int(round(cfg.cold_start_fraction * n))
        rng = np.random.default_rng(derive_seed(cfg.seed, "cold_start"))
        self.cold_start = sorted(int(c) for c in rng.choice(n, size=n_cold, replace=False)) if n_cold else []
        cold = set(self.cold_start)
        self.training_clients = [c for c in range(n) if c not in cold]
        if n_cold and cfg.clients_per_round == n:
            # full participation (a paper's C = 100%) means every client that trains
            cfg.clients_per_round = len(self.training_clients)
            if self.is_main and not cfg.quiet:
                print(f"--cold-start-fraction holds out {n_cold} of {n} clients: full participation is "
                      f"{cfg.clients_per_round} clients per round", flush=True)
        if cfg.clients_per_round > len(self.training_clients):
            raise ConfigError(f"--clients-per-round {cfg.clients_per_round} exceeds the {len(self.training_clients)} "
                              f"clients left for training after --cold-start-fraction {cfg.cold_start_fraction:g} "
                              f"holds out {n_cold}; lower one of them")
        model_name = self.data.model_for(cfg.model)
        self.model_name = model_name
        torch.manual_seed(derive_seed(cfg.seed, "init"))  # same initial model on every rank
        # Built for what training feeds it (a 224-px crop of 256-px stored images, say).
        model = build_model(model_name, self.data.model_input_shape(train=True), self.data.num_classes,
                            cfg.model_options)
        self.model = model.to(world.device)
        refuse_cumulative_batchnorm(self.model)
        check_model_takes_inputs(self.model, model_name, self.data, world.device)
        self.flat = FlatModel(self.model)
        self.global_state = self.flat.flat.detach().clone()

        # Created only if a state is ever spilled; removed when the run ends.
        spill = (os.path.join(cfg.out, "client_state_spill") if cfg.out else
                 os.path.join(tempfile.gettempdir(), f"fedhpc-state-{os.getpid()}"))
        budget = cfg.client_state_budget_mb
        self.client_state = ClientStateStore(world, int(budget * 2**20) if math.isfinite(budget) else sys.maxsize, spill)
        self.algo = algo_cls(cfg, algo_options, self.model, self.flat, self.data, world, self.client_state)
        self.algo.training_clients = list(self.training_clients)
        self.algo.setup()
        if cfg.per_label_accuracy and not self.algo.has_global_model:
            raise ConfigError(f"--per-label-accuracy reports the global model's accuracy per label, and {cfg.algo} "
                              f"trains no global model (its devices keep their own: local_test_accuracy*, "
                              f"reference_device_accuracy); drop the flag")
        check_single_sample_batches(
            self.model, model_name, [(c, int(self.sizes[c])) for c in self.training_clients], cfg.batch_size,
            lambda cid: self.data.transform(self.data.client(cid).x[:1], True,
                                            torch.Generator().manual_seed(0)).to(world.device),
            self.algo.probe_forward)
        if cfg.clients_at_once > 1:  # refuse what the batched path cannot train exactly, before any round
            from .batched import check_batchable
            check_batchable(self.algo, self.model, cfg)

        # The channel model (Mix2FLD Sec. II-C): per device and round, seeded; "none" lets
        # everything through. Downlink outages leave devices on their own models, which the
        # client-state store keeps, so the store is in use whenever the channel is.
        from .server.channel import Channel, ChannelOptions, RoundLinks
        self.channel = Channel(cfg.channel, build_options(ChannelOptions, cfg.channel_options, "channel"), cfg.seed)
        self.channel_active = cfg.channel != "none"
        self.links = RoundLinks(self.channel, len(self.algo.ledger_kinds)) if self.channel_active else None
        self.uses_store = self.algo.uses_client_state or self.channel_active
        self.algo.channel_active = self.channel_active

        # Layout of the one buffer sum-all-reduced per round: the reproducible sum of the
        # uploads without a bound, then the uploads with one, then metrics, then one
        # training-loss slot per sampled client, then (with a channel) one row per sampled
        # client, then the ledger. Either way an upload's sum has the same bits on any number
        # of ranks: a bounded one is rounded to a grid on which float64 adds exactly, the others
        # go through ReproducibleSum (whose alignment is the round's other collective).
        if cfg.clients_per_round > MAX_TERMS:
            raise ConfigError(f"--clients-per-round {cfg.clients_per_round} is more than the {MAX_TERMS} "
                              f"clients a round can sum reproducibly; sample fewer clients per round")
        #: upload name -> (its elements: of upload_sum, or of the round buffer with a bound; spec)
        self.uploads: Dict[str, Tuple[slice, Upload]] = {}
        self._sum_grid: Dict[str, float] = {}  # upload -> grid step of its exact sum (Upload.bound)
        specs = self.algo.upload_spec()
        summed = sum(spec.numel for spec in specs.values() if spec.bound is None)
        offset, element = storage_numel(summed), 0
        for name, spec in specs.items():
            if spec.bound is None:
                self.uploads[name] = (slice(element, element + spec.numel), spec)
                element += spec.numel
                continue
            if spec.weighted:
                raise ValueError(f"{cfg.algo}: upload {name!r} has a bound, which only unweighted uploads may have")
            self.uploads[name] = (slice(offset, offset + spec.numel), spec)
            offset += spec.numel
            self._sum_grid[name] = exact_sum_step(spec.bound, cfg.clients_per_round)
        self.metric_slots = ["weight", "samples", "nonfinite", "stop", "compute_s", "failed"]
        self.metric_offset = offset
        # one training-loss slot per sampled client: each slot has one nonzero term, so the
        # all-reduce sums it exactly, and the loss of the round is summed in client order
        # (math.fsum) whatever the number of ranks
        self.loss_offset = offset + len(self.metric_slots)
        self.link_offset = self.loss_offset + cfg.clients_per_round
        self.link_fields = RoundLinks.FIELDS if self.channel_active else 0
        self.ledger_offset = self.link_offset + self.link_fields * cfg.clients_per_round
        n_ledger = 2 * len(self.algo.ledger_kinds)
        self.round_buffer = torch.zeros(self.ledger_offset + n_ledger, dtype=torch.float64,
                                        device=world.device)
        self.upload_sum = ReproducibleSum(summed, max(cfg.clients_per_round, 1),
                                          out=self.round_buffer[:storage_numel(summed)])
        self.reference_device = self.training_clients[derive_seed(cfg.seed, "reference_device") % len(self.training_clients)]
        self.start_round = 0
        self.stop_round = cfg.rounds  # earlier when --stop-epsilon is met
        self._converged_round: Optional[int] = None  # the round that met --stop-epsilon: the run ends there
        self._round_metrics: Optional[Dict[str, float]] = None  # the last round run, before evaluation
        self._final_record: Optional[Dict[str, float]] = None   # the last round's log record when it was final
        self._resumed: Optional[Dict[str, Any]] = None          # what restore() read to rebuild the log
        self.cum_bytes = {"bytes_up_total": 0.0, "bytes_down_total": 0.0}
        self.round_seconds_total = 0.0
        # The first optimizer built in a process imports torch._dynamo lazily (1-3 s): pay it
        # here, so round 1's round_seconds measures the round.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        self._previous_convergence_state: Optional[torch.Tensor] = None
        # trained client models kept for the Hessian analysis (FedAlign's H_N / H_D)
        self._save_client_rounds = set(parse_rounds(cfg.save_client_models, cfg.rounds))
        self._stop_signal: Optional[int] = None
        self._tb = None
        self._metrics_file = None

    # ------------------------------------------------------------------ one round
    def _slot(self, name: str) -> int:
        return self.metric_offset + self.metric_slots.index(name)

    def _train_clients(self, rnd: RoundInfo, buf: torch.Tensor, nonfinite: List[int]) -> None:
        """Train this rank's clients of the round, adding their weighted uploads and metrics to
        ``buf``; clients whose loss is not finite go to ``nonfinite`` instead."""
        cfg, algo, t, sampled = self.cfg, self.algo, rnd.index, rnd.sampled
        position = {cid: i for i, cid in enumerate(sampled)}
        # The per-client metrics add up on the host and enter the (device) buffer once, after the
        # loop: a slot updated client by client costs two small kernels a client on a GPU. Same
        # float64 additions in the same order from the same 0, so the same numbers.
        losses = [0.0] * len(sampled)
        totals = {"samples": 0.0, "compute_s": 0.0, "weight": 0.0}
        for cid, ctx, traffic_before, c0 in self._trained_clients(rnd, rnd.my_clients):
            loss_sum = ctx.loss_total()  # one device sync per client (per group of batched clients)
            if not math.isfinite(loss_sum):
                nonfinite.append(cid)
                continue
            uploads = algo.upload(self.model, ctx)
            if t + 1 in self._save_client_rounds:
                from .analysis.hessian import save_client_model
                save_client_model(cfg.out, t + 1, cid, self.flat.state_dict_from(self.flat.flat))
            for name, tensor in uploads.items():
                algo.ledger.add("up", self.uploads[name][1].kind, self._wire_bytes(name, tensor))
            compute_s = time.perf_counter() - c0
            losses[position[cid]] = loss_sum
            totals["samples"] += ctx.samples
            totals["compute_s"] += compute_s
            if self.links is not None:
                up_ok, down_ok = self.links.device(self._link_rows(len(sampled)), t, cid, position[cid], len(sampled),
                                                   algo.ledger.values - traffic_before, compute_s, ctx.samples)
                if not down_ok:
                    algo.on_downlink_outage(self.model, ctx)
                if not up_ok:
                    continue  # a straggler: trained, but its upload is lost this round
            weight = algo.client_weight(ctx)
            for name, tensor in uploads.items():
                sl, spec = self.uploads[name]
                if name in self._sum_grid:
                    step = self._sum_grid[name]
                    tensor = torch.round(tensor.to(buf.dtype) / step) * step  # powers of two: exact
                    buf[sl].add_(tensor.reshape(-1))
                else:
                    self.upload_sum.add_(tensor, alpha=weight if spec.weighted else 1.0, start=sl.start)
            totals["weight"] += weight
        buf[self.loss_offset:self.loss_offset + len(sampled)] = torch.tensor(losses, dtype=buf.dtype)
        for name, value in totals.items():
            buf[self._slot(name)] = value

    def run_round(self, t: int) -> Dict[str, float]:
        cfg, world, algo = self.cfg, self.world, self.algo
        t0 = time.perf_counter()
        sampled = sample_clients(cfg.seed, t, len(self.training_clients), cfg.clients_per_round)
        if self.cold_start:  # positions in the training pool -> client ids
            sampled = sorted(self.training_clients[i] for i in sampled)
        assignment = assign_clients(sampled, self.sizes, world.size, max(cfg.clients_at_once, 1))
        mine = [c for c in sampled if assignment[c] == world.rank]
        rnd = RoundInfo(t, sampled, mine, cfg.lr * cfg.lr_decay ** t)
        if self.uses_store:
            self.client_state.migrate(assignment)
        algo.global_state = self.global_state
        algo.ledger.reset()  # before round_begin: traffic booked during its exchanges counts
        algo.round_begin(rnd)

        buf = self.round_buffer
        self.upload_sum.zero_()  # its bins are a view of buf; this also resets its digit positions
        buf[self.upload_sum.data.numel():].zero_()  # the rest: bounded uploads, losses, flags, ledger
        nonfinite: List[int] = []
        self.model.train()
        # A client that fails on this rank alone must not leave the others in the all-reduce:
        # its error rides in the buffer and every rank raises it together (World.raise_together).
        failure: Optional[Exception] = None
        try:
            self._train_clients(rnd, buf, nonfinite)
        except Exception as e:
            failure = e
            buf[self._slot("failed")] = 1.0
        buf[self._slot("nonfinite")] = len(nonfinite)
        buf[self._slot("stop")] = 1.0 if self._stop_signal else 0.0
        buf[self.ledger_offset:] = algo.ledger.values.to(buf)

        world.heartbeat()  # on NCCL runs: a dead peer is reported by gloo, not by NCCL's watchdog
        self.upload_sum.align_(world)  # the int8 digit positions' maximum over ranks
        world.all_reduce_sum_(buf)  # the round's sum collective: uploads + metrics
        # the round's metrics, losses, links and ledger on the host in one copy: on a GPU each
        # float(buf[i]) would be a wait of its own (on the CPU this is buf itself)
        report = buf[self.metric_offset:].cpu()

        def reported(name: str) -> float:
            return float(report[self.metric_slots.index(name)])

        if reported("failed") > 0:
            world.raise_together(failure, f"training round {t + 1}")
        if reported("nonfinite") > 0:
            bad = sorted(c for part in world.all_gather_object(nonfinite) for c in part)
            raise NonFiniteLossError(
                f"the training loss became NaN or infinite in round {t + 1} on client(s) {bad} "
                f"(lr {rnd.lr:g}); lower --lr, add --grad-clip, or check the data. Nothing of this "
                f"round was kept; the last checkpoint and metrics in --out are intact")
        weight_total = reported("weight")
        summed = self.upload_sum.sum()
        totals = {name: buf[sl] if name in self._sum_grid else summed[sl] for name, (sl, _) in self.uploads.items()}
        s0 = time.perf_counter()
        algo.server_trained_samples = 0.0  # samples its server trains on in aggregate, if it does (the compute model)
        new_state = algo.aggregate(self.global_state, totals, weight_total, rnd)
        server_s = time.perf_counter() - s0
        self.global_state = new_state.detach().to(self.flat.flat.dtype).clone()
        # the algorithm always sees the current global state: personal methods build a client's
        # model from it (client_model, adapt) when evaluating after this round
        algo.global_state = self.global_state
        algo.rounds_done = t + 1
        ledger = algo.ledger.as_metrics(report[self.ledger_offset - self.metric_offset:].double())
        self.cum_bytes["bytes_up_total"] += ledger["bytes_up"]
        self.cum_bytes["bytes_down_total"] += ledger["bytes_down"]
        samples = reported("samples")
        metrics = {
            "round": t + 1,
            "train_loss": math.fsum(report[self.loss_offset - self.metric_offset:][:len(sampled)].tolist())
            / max(samples, 1.0),
            "lr": rnd.lr,
            "clients": len(sampled),
            **ledger, **self.cum_bytes,
        }
        if self.links is not None:
            links = report[self.link_offset - self.metric_offset:][:len(sampled) * self.link_fields]
            metrics.update(self.links.round_metrics(links.view(len(sampled), self.link_fields), server_s,
                                                    algo.server_trained_samples))
        metrics.update(algo.extra_metrics())
        # A round in which no upload arrived (every device a straggler) changes nothing: that
        # is not convergence, so the stopping rule only looks at rounds with an update.
        change = self._relative_change() if weight_total > 0 else None
        if change is not None:
            metrics["relative_change"] = change
            if cfg.stop_epsilon > 0 and change < cfg.stop_epsilon:
                metrics["converged"] = True
        metrics["round_seconds"] = time.perf_counter() - t0
        self.round_seconds_total += metrics["round_seconds"]
        # every round's time, also for rounds metrics.jsonl does not keep (eval_every > 1)
        metrics["round_seconds_total"] = self.round_seconds_total
        if reported("stop") > 0:
            metrics["stop"] = True
        return metrics

    def _trained_clients(self, rnd: RoundInfo, mine: List[int]):
        """This rank's clients trained, in order: yields ``(cid, ctx, traffic_before, c0)`` with
        ``self.model`` holding the client's trained weights. One after another, or
        ``--clients-at-once`` K at a time as one batched model (:mod:`fedhpc.batched`)."""
        cfg, algo = self.cfg, self.algo
        if cfg.clients_at_once > 1:
            from .batched import train_in_groups
            yield from train_in_groups(self, rnd, mine, cfg.clients_at_once)
            return
        for cid in mine:
            c0 = time.perf_counter()
            client = self.data.client(cid).training_on(self.world.device)
            seed_torch(derive_seed(cfg.seed, "client", rnd.index, cid), self.world.device)  # dropout etc.
            self.flat.load_(self.global_state)
            ctx = ClientContext(algo, cid, client, rnd)
            traffic_before = algo.ledger.values.clone() if self.channel_active else None
            algo.download(ctx)
            algo.local_update(self.model, ctx)
            yield cid, ctx, traffic_before, c0

    def _wire_bytes(self, name: str, tensor: torch.Tensor) -> float:
        spec = self.uploads[name][1]
        return float(spec.wire_bytes if spec.wire_bytes is not None else tensor.numel() * tensor.element_size())

    def _link_rows(self, num_devices: int) -> torch.Tensor:
        """The round buffer's rows of the channel's per-device link outcomes (a view)."""
        rows = self.round_buffer[self.link_offset:self.link_offset + num_devices * self.link_fields]
        return rows.view(num_devices, self.link_fields)

    @property
    def sim_seconds_total(self) -> float:
        """The simulated clock (channel + compute) so far; 0 without a channel."""
        return self.links.sim_seconds_total if self.links is not None else 0.0

    @sim_seconds_total.setter
    def sim_seconds_total(self, value: float) -> None:
        if self.links is not None:
            self.links.sim_seconds_total = value

    def _relative_change(self) -> Optional[float]:
        """The relative change of the algorithm's global quantity since the last round with an
        update (Mix2FLD's stopping rule), as the algorithm measures it (``Algorithm.relative_change``:
        the whole state's ratio by default, the largest per-label one for FD methods)."""
        now = self.algo.convergence_state(self.global_state)
        if now is None:
            return None
        now = now.detach().double()
        # The whole previous state is kept (and checkpointed), not a norm: a per-label rule
        # needs every row of it, and a resumed run then compares exactly what it would have.
        before, self._previous_convergence_state = self._previous_convergence_state, now.clone()
        # another length: a checkpoint from a version that measured BatchNorm statistics too
        if before is None or before.shape != now.shape:
            return None
        return float(self.algo.relative_change(before.to(now.device), now))

    def _evaluate_round(self, metrics: Dict[str, float], last: bool) -> None:
        """Collective. Add the round's evaluation to ``metrics``; the run's last round gets the
        final one (the algorithm's final fine-tuning, cold-start clients, --final-adapt)."""
        t0 = time.perf_counter()
        self.algo.final_evaluation = last  # a run that converges early ends here too
        metrics.update(self.evaluate(metrics["round"]))
        if last and self.cold_start:
            metrics.update(self._evaluate_cold_start(metrics))
        if last and self.cfg.final_adapt:
            metrics.update(self._evaluate_final_adapted())
        self.algo.final_evaluation = False
        # apart from round_seconds: at thousands of clients the evaluation over every client's
        # split can cost more than the round it evaluates, and --eval-every is the remedy
        metrics["eval_seconds"] = time.perf_counter() - t0

    def _warn(self, message: str) -> None:
        if self.is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ main loop
    def _on_signal(self, signum, frame):
        if self._stop_signal is not None:
            raise StopNow(signum)  # asked again: do not wait for the round to end
        self._stop_signal = signum
        if self.is_main:  # os.write: safe however the main thread was interrupted
            os.write(2, f"fedhpc: {signal.Signals(signum).name}: stopping after this round with a checkpoint; "
                        f"send it again to stop at once (the last complete checkpoint is kept)\n".encode())

    def run(self) -> Dict[str, float]:
        cfg = self.cfg
        if cfg.resume:
            self.restore()
        redo, final_again = self._resume_records()
        self._open_outputs(redo_last=redo is not None)
        if redo is not None:
            self._log(redo, echo=False)
        if cfg.out and final_again is not None and self._resumed["final_record"] is None:
            # the round became the run's last: its checkpoint says so now, as the shorter run's does
            self.save_checkpoint(self.start_round)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
        final: Dict[str, float] = dict(final_again or {})
        try:
            if self.is_main and not cfg.quiet:
                print(f"fedhpc: {cfg.algo} on {cfg.dataset} ({self.data.num_clients} clients, "
                      f"{cfg.clients_per_round} per round), model {self.model_name} "
                      f"({self.flat.num_params} parameters), {self.world.describe()}", flush=True)
                said = auto_line(cfg, self.model_name, self.data)  # what auto and defaults resolved to
                if said:
                    print(said, flush=True)
                if self.channel_active:
                    print(f"channel: {self.channel.describe()}", flush=True)
            for t in range(self.start_round, self.stop_round):
                metrics = self.run_round(t)
                converged = metrics.get("converged", False)  # kept in metrics.jsonl: a finished run, not a cut one
                if converged:
                    # before the final evaluation: cold-start clients join here
                    self.stop_round = self._converged_round = t + 1
                last = t + 1 == cfg.rounds or converged
                self._round_metrics = dict(metrics)  # before evaluation: a checkpoint keeps it
                if last or (t + 1) % cfg.eval_every == 0:
                    self._evaluate_round(metrics, last)
                    final = metrics
                stop = metrics.pop("stop", False)
                self._final_record = dict(metrics) if last else None
                self._log(metrics)
                if converged and self.is_main and not cfg.quiet:
                    print(f"converged after round {t + 1}: relative change "
                          f"{metrics['relative_change']:.4g} < --stop-epsilon {cfg.stop_epsilon:g}", flush=True)
                if cfg.out and (stop or last or (cfg.checkpoint_every and (t + 1) % cfg.checkpoint_every == 0)):
                    self.save_checkpoint(t + 1)
                if last:
                    break
                if stop:
                    raise Preempted(t + 1)
            if not final:  # resumed a finished run: report the final model again
                self.algo.final_evaluation = True
                final = {"round": self.stop_round, **self.evaluate()}
                self.algo.final_evaluation = False
            if cfg.out and self.is_main:
                atomic_torch_save(self.flat.state_dict_from(self.global_state),
                                  os.path.join(cfg.out, "final_model.pt"))
                self._write_hparams(final)
            if self.is_main and not cfg.quiet:
                print(self._final_line(final), flush=True)
            return final
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._close_outputs()
            self.client_state.close()
            self.data.close()
