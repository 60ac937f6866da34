"""What a run leaves behind while it runs: ``config.yaml``, ``identity.json`` (its checkpoint
identity: what config.yaml cannot say, such as the partition rules), ``run.json`` (the settings as
resolved, the code, libraries, ranks, hosts and command: :mod:`fedhpc.provenance`; written at the start
after one gather over the ranks, completed at the end), ``metrics.jsonl`` (one line per
round, fsynced: an evaluated round's with its evaluation, the others with their training metrics),
TensorBoard scalars (grouped tags, :func:`fedhpc.report.tensorboard.tensorboard_tag`) and HParams,
and the line per round on stdout (with the elapsed time and an estimate of the time left).

A mixin of :class:`fedhpc.engine.Engine`, like :mod:`fedhpc.evaluation`: it reads the engine's
config, rank and round range. Only rank 0 writes. On resume ``metrics.jsonl`` keeps exactly the
rounds the checkpoint covers, so the resumed run's file equals the uninterrupted run's.

Under SLURM the batch scripts say in ``FEDHPC_SIGNAL_MARGIN_S`` how long before the time limit the
warning signal comes (``#SBATCH --signal=B:USR1@N``): a signalled run finishes its round and then
checkpoints, so when a round plus a checkpoint takes longer, rank 0 warns once, naming the setting.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import Dict, Optional

from .checkpoint import IDENTITY_FILE, OPTION_MAPPINGS, OPTIONS_AS_RUN, canonical_identity
from .io import atomic_write_json, atomic_write_text, raise_disk_error
from .provenance import rank_facts, read_provenance, start_record, write_provenance

#: metrics.jsonl's wall-clock measurements: the only values a rerun, a resumed run or another rank
#: count does not reproduce (the simulated channel's times add the measured compute)
WALL_CLOCK_METRICS = ("round_seconds", "round_seconds_total", "eval_seconds", "compute_seconds",
                      "sim_round_seconds", "sim_seconds_total")


def evaluated(metrics: Dict[str, float]) -> bool:
    """Whether a round's record holds an evaluation (metrics.jsonl has a record for every round;
    files written before it did hold the evaluated ones alone). The engine marks every evaluation
    with eval_seconds; records older checkpoints kept lack it, and carry test_accuracy, which a
    method training no global model (FD) does not report."""
    return "eval_seconds" in metrics or "test_accuracy" in metrics


#: environment variable: seconds between SLURM's warning signal and the time limit (set by
#: slurm/*.sbatch and the sweep's array scripts beside their ``#SBATCH --signal=B:USR1@N``)
SIGNAL_MARGIN_ENV = "FEDHPC_SIGNAL_MARGIN_S"


def signal_margin(env=None) -> Optional[float]:
    """:data:`SIGNAL_MARGIN_ENV` in seconds, or None where it is unset or not a positive number."""
    value = (os.environ if env is None else env).get(SIGNAL_MARGIN_ENV, "").strip()
    try:
        margin = float(value)
    except ValueError:
        return None
    return margin if math.isfinite(margin) and margin > 0 else None


def margin_warning(margin: float, round_no: int, round_seconds: Optional[float],
                   checkpoint_seconds: Optional[float]) -> str:
    """The warning for a round (``round_seconds``, its evaluation included; None: not measured yet)
    plus a checkpoint (``checkpoint_seconds``; None before the first) that outlast the signal's ``margin``."""
    need = (round_seconds or 0.0) + (checkpoint_seconds or 0.0)
    suggest = 60 * math.ceil(1.5 * need / 60)
    parts = ([f"round {round_no} took {round_seconds:.0f} s"] if round_seconds is not None else []) + (
        [f"a checkpoint took {checkpoint_seconds:.0f} s"] if checkpoint_seconds is not None else [])
    took = " and ".join(parts) + (f" ({need:.0f} s together)" if len(parts) > 1 else "")
    return (f"{took}, more than the {margin:.0f} s between SLURM's warning signal and the time limit "
            f"({SIGNAL_MARGIN_ENV}): signalled, the run finishes its round and then checkpoints, so the job "
            f"can be killed before the checkpoint is written. Give it a longer warning, e.g. {suggest} s: "
            f"`#SBATCH --signal=B:USR1@{suggest}` and {SIGNAL_MARGIN_ENV}={suggest} beside it in the batch "
            f"script (slurm/run.sbatch, slurm/run_gpu.sbatch), or `signal_seconds: {suggest}` under a sweep's slurm:")


def duration(seconds: float) -> str:
    """``seconds`` as the per-round line shows it: ``8.4 s``, ``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class RunLog:
    """Output methods of the engine (see the module docstring)."""

    def _open_outputs(self, redo_last: bool = False) -> None:
        """``redo_last``: the checkpoint's round is logged again (see fedhpc.resume.Resume._resume_records), so
        metrics.jsonl and TensorBoard keep only the rounds before it."""
        cfg = self.cfg
        keep_to = self.start_round - 1 if redo_last else self.start_round
        # the per-round line's clock: rounds run by this process, from here
        self._clock = (time.perf_counter(), self.start_round)
        self._signal_margin = signal_margin()
        self._round_plus_eval_seconds: Optional[float] = None
        self._checkpoint_seconds: Optional[float] = None
        self._margin_warned = False
        self._provenance: Optional[Dict] = None
        # every rank's host, device and threads for run.json (a collective: every rank, before rank 0 writes)
        ranks = self.world.all_gather_object(rank_facts(self.world)) if cfg.out else None
        if not (cfg.out and self.is_main):
            return
        os.makedirs(cfg.out, exist_ok=True)
        import yaml
        atomic_write_text(os.path.join(cfg.out, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        # what config.yaml cannot say (the partition rules the split was dealt under), so that a sweep
        # can tell a finished run of an older split from its point's; a resume's checkpoint check passed.
        # Beside it, outside the identity, each option mapping with every default this code filled in:
        # config.yaml holds the options as given, which a later fedhpc would read with its own defaults
        identity = self._identity()
        resolved = canonical_identity(identity)  # a model left at 'auto' keeps its options as given
        identity[OPTIONS_AS_RUN] = {k: resolved[k] for k in OPTION_MAPPINGS if isinstance(resolved.get(k), dict)}
        atomic_write_json(os.path.join(cfg.out, IDENTITY_FILE), identity)
        # run.json: the settings as resolved (the model built, the partition dealt...), the code, the
        # libraries, the ranks and the command (fedhpc.provenance); an earlier launch's kept in it
        try:
            options = canonical_identity({**identity, "model": self.model_name})
            self._provenance = start_record(
                cfg, self.world, ranks, self.model_name, self.data,
                {k: options[k] for k in OPTION_MAPPINGS if isinstance(options.get(k), dict)},
                previous=read_provenance(cfg.out) if cfg.resume else None)
        except Exception as e:  # noqa: BLE001 - a record that cannot be made must not cost the run
            print(f"warning: {cfg.out}/run.json not written ({type(e).__name__}: {e}); the run goes on",
                  file=sys.stderr, flush=True)
        if self._provenance is not None:
            write_provenance(cfg.out, self._provenance)
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
                if rec.get("round", 0) <= keep_to:
                    kept.append(json.dumps(rec))
        atomic_write_text(path, "".join(k + "\n" for k in kept))
        self._metrics_file = open(path, "a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(cfg.out, "tensorboard"), purge_step=keep_to + 1)
            except ImportError:
                print("warning: tensorboard is not installed; no event files (pip install tensorboard)")

    def _log(self, metrics: Dict[str, float], echo: bool = True) -> None:
        """Log one round's record (every round: an evaluated one holds its evaluation too)."""
        if not self.is_main:
            return
        if self._metrics_file is not None:
            try:
                self._metrics_file.write(json.dumps(metrics) + "\n")
                self._metrics_file.flush()
                os.fsync(self._metrics_file.fileno())
            except OSError as e:
                raise_disk_error(self._metrics_file.name, e)
                raise
        if self._tb is not None:
            from .report.tensorboard import tensorboard_tag

            step = metrics["round"]
            for k, v in metrics.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(tensorboard_tag(k), v, step)
        clock = getattr(self, "_clock", None)
        if echo and "round_seconds" in metrics and clock is not None and metrics["round"] > clock[1] + 1:
            # not a process's first round: it pays one-time costs (a native-ops build, lazy imports)
            self._round_plus_eval_seconds = metrics["round_seconds"] + metrics.get("eval_seconds", 0.0)
            self._check_signal_margin(metrics["round"])
        if echo and not self.cfg.quiet:
            line = (f"round {metrics['round']:4d}/{self.cfg.rounds} | train_loss {metrics['train_loss']:.4f}")
            if "test_accuracy" in metrics:
                line += f" | test_acc {metrics['test_accuracy']:.4f}"
            if "local_test_accuracy_mean" in metrics:
                # the mean over clients is what personalised papers report (pMixFed's tables)
                line += f" | local_acc_mean {metrics['local_test_accuracy_mean']:.4f}"
                if "local_eval_clients" in metrics:
                    line += f" ({metrics['local_eval_clients']} clients)"
            if "reference_device_accuracy" in metrics:
                line += f" | ref_dev_acc {metrics['reference_device_accuracy']:.4f}"
            line += f" | up {metrics['bytes_up'] / 2**20:.2f} MiB | down {metrics['bytes_down'] / 2**20:.2f} MiB"
            if "sim_seconds_total" in metrics:
                line += (f" | outages up {metrics['uplink_outages']} down {metrics['downlink_outages']}"
                         f" | sim {metrics['sim_seconds_total']:.2f} s")
            line += f" | {metrics['round_seconds']:.2f} s"
            if "eval_seconds" in metrics:
                line += f" + eval {metrics['eval_seconds']:.2f} s"
            line += self._progress(metrics["round"])
            print(line, flush=True)

    def _progress(self, round_no: int) -> str:
        """`` | elapsed 42 s, ETA 3 min 05 s``: this process's wall clock since its first round and the
        rounds left at its mean time per round so far (evaluations included); at most, as
        --stop-epsilon can end the run earlier."""
        clock = getattr(self, "_clock", None)
        if clock is None:
            return ""
        elapsed, done = time.perf_counter() - clock[0], round_no - clock[1]
        left = getattr(self, "stop_round", self.cfg.rounds) - round_no
        if done <= 0:
            return ""
        eta = f", ETA {duration(elapsed / done * left)}" if left > 0 else ""
        return f" | elapsed {duration(elapsed)}{eta}"

    def _check_signal_margin(self, round_no: int) -> None:
        """Warn once (rank 0) when the last round plus the longest checkpoint outlast the SLURM signal's
        margin (:data:`SIGNAL_MARGIN_ENV`): the run could not checkpoint before the time limit."""
        margin = getattr(self, "_signal_margin", None)
        if margin is None or not self.is_main or not self.cfg.out or self._margin_warned:
            return
        round_s = self._round_plus_eval_seconds
        if (round_s or 0.0) + (self._checkpoint_seconds or 0.0) > margin:
            self._margin_warned = True
            print(f"warning: {margin_warning(margin, round_no, round_s, self._checkpoint_seconds)}",
                  file=sys.stderr, flush=True)

    def save_checkpoint(self, round_done: int) -> None:
        """:meth:`fedhpc.resume.Resume.save_checkpoint`, timed for the signal-margin check."""
        t0 = time.perf_counter()
        super().save_checkpoint(round_done)  # type: ignore[misc]
        seconds = time.perf_counter() - t0
        if getattr(self, "_signal_margin", None) is not None:
            self._checkpoint_seconds = max(seconds, self._checkpoint_seconds or 0.0)
            self._check_signal_margin(round_done)

    def _final_line(self, final: Dict[str, float]) -> str:
        partial = getattr(getattr(self, "algo", None), "global_model_is_partial", False)
        rounds = f"{self.stop_round} round{'' if self.stop_round == 1 else 's'}"  # one-shot runs: "1 round"
        if "test_accuracy" in final and partial and "local_test_accuracy_mean" in final:
            # the global state's personal layers are the initial ones: the clients' models are the result
            line = (f"final mean accuracy of the clients' own models {final['local_test_accuracy_mean']:.4f} (their "
                    f"local splits) after {rounds}; the global model (trained shared part, initial "
                    f"personal part): test accuracy {final['test_accuracy']:.4f}")
        elif "test_accuracy" in final:
            line = (f"final test accuracy {final['test_accuracy']:.4f} (test loss {final['test_loss']:.4f}) "
                    f"after {rounds}")
            if "local_test_accuracy_global_model" in final:  # clients kept models of their own
                line += (f"; clients' own models on their splits: mean accuracy "
                         f"{final['local_test_accuracy_mean']:.4f}")
        else:  # no global model (FD): the devices' own models are the result
            own = (f" mean accuracy of the devices' own models {final['local_test_accuracy_mean']:.4f} (their "
                   f"local splits)" if "local_test_accuracy_mean" in final else "")
            line = f"final{own} after {rounds}; {self.cfg.algo} trains no global model"
        if "reference_device_accuracy" in final:
            line += f"; reference device {self.reference_device}: accuracy {final['reference_device_accuracy']:.4f}"
        if "sim_seconds_total" in final:
            compute = "compute model" if self.channel.models_compute() else "measured compute"
            line += f", convergence time {final['sim_seconds_total']:.2f} s (simulated channel + {compute})"
        return line

    def _write_hparams(self, final: Dict[str, float]) -> None:
        """At the end of a finished run (rank 0, with --out): run.json completed (``ended``,
        ``rounds_done``), and the hyperparameters and final metrics for TensorBoard's HParams tab (a
        sweep compares runs there): the settings as resolved, and as columns those of every point of
        the sweep the run belongs to (its sweep.json), so that the tab shows each swept setting."""
        record = getattr(self, "_provenance", None)
        config = self.cfg.to_dict()
        if record is not None:
            record.update(ended=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          rounds_done=int(final.get("round", self.stop_round)))
            write_provenance(self.cfg.out, record)
            config = record["config"]
        if self._tb is None:
            return
        try:
            from .report.tensorboard import sweep_hparams, write_hparams
        except ImportError:  # tensorboard not installed: the scalars were skipped too
            return
        write_hparams(os.path.join(self.cfg.out, "tensorboard"), config, final, writer=self._tb,
                      scalars_logged=True, declared=sweep_hparams(self.cfg.out))

    def _close_outputs(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._tb is not None:
            self._tb.close()
