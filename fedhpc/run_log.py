"""What a run leaves behind while it runs: ``config.yaml``, ``identity.json`` (its checkpoint
identity: what config.yaml cannot say, such as the partition rules), ``metrics.jsonl`` (one line per
evaluated round, fsynced), TensorBoard scalars and HParams, and the line per round on stdout.

A mixin of :class:`fedhpc.engine.Engine`, like :mod:`fedhpc.evaluation`: it reads the engine's
config, rank and round range. Only rank 0 writes. On resume ``metrics.jsonl`` keeps exactly the
rounds the checkpoint covers, so the resumed run's file equals the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from typing import Dict

from .checkpoint import IDENTITY_FILE, OPTION_MAPPINGS, OPTIONS_AS_RUN, canonical_identity
from .io import atomic_write_json, atomic_write_text, raise_disk_error

#: metrics.jsonl's wall-clock measurements: the only values a rerun, a resumed run or another rank
#: count does not reproduce (the simulated channel's times add the measured compute)
WALL_CLOCK_METRICS = ("round_seconds", "round_seconds_total", "eval_seconds", "compute_seconds",
                      "sim_round_seconds", "sim_seconds_total")


def evaluated(metrics: Dict[str, float]) -> bool:
    """Whether a round's record holds an evaluation: metrics.jsonl keeps those alone. The engine
    marks every evaluation with eval_seconds; records older checkpoints kept lack it, and carry
    test_accuracy, which a method training no global model (FD) does not report."""
    return "eval_seconds" in metrics or "test_accuracy" in metrics


class RunLog:
    """Output methods of the engine (see the module docstring)."""

    def _open_outputs(self, redo_last: bool = False) -> None:
        """``redo_last``: the checkpoint's round is logged again (see fedhpc.resume.Resume._resume_records), so
        metrics.jsonl and TensorBoard keep only the rounds before it."""
        cfg = self.cfg
        keep_to = self.start_round - 1 if redo_last else self.start_round
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
        if not self.is_main:
            return
        if self._metrics_file is not None and evaluated(metrics):
            try:
                self._metrics_file.write(json.dumps(metrics) + "\n")
                self._metrics_file.flush()
                os.fsync(self._metrics_file.fileno())
            except OSError as e:
                raise_disk_error(self._metrics_file.name, e)
                raise
        if self._tb is not None:
            step = metrics["round"]
            for k, v in metrics.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
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
            print(line, flush=True)

    def _final_line(self, final: Dict[str, float]) -> str:
        partial = getattr(getattr(self, "algo", None), "global_model_is_partial", False)
        if "test_accuracy" in final and partial and "local_test_accuracy_mean" in final:
            # the global state's personal layers are the initial ones: the clients' models are the result
            line = (f"final mean accuracy of the clients' own models {final['local_test_accuracy_mean']:.4f} (their "
                    f"local splits) after {self.stop_round} rounds; the global model (trained shared part, initial "
                    f"personal part): test accuracy {final['test_accuracy']:.4f}")
        elif "test_accuracy" in final:
            line = (f"final test accuracy {final['test_accuracy']:.4f} (test loss {final['test_loss']:.4f}) "
                    f"after {self.stop_round} rounds")
            if "local_test_accuracy_global_model" in final:  # clients kept models of their own
                line += (f"; clients' own models on their splits: mean accuracy "
                         f"{final['local_test_accuracy_mean']:.4f}")
        else:  # no global model (FD): the devices' own models are the result
            own = (f" mean accuracy of the devices' own models {final['local_test_accuracy_mean']:.4f} (their "
                   f"local splits)" if "local_test_accuracy_mean" in final else "")
            line = f"final{own} after {self.stop_round} rounds; {self.cfg.algo} trains no global model"
        if "reference_device_accuracy" in final:
            line += f"; reference device {self.reference_device}: accuracy {final['reference_device_accuracy']:.4f}"
        if "sim_seconds_total" in final:
            line += f", convergence time {final['sim_seconds_total']:.2f} s (simulated channel + measured compute)"
        return line

    def _write_hparams(self, final: Dict[str, float]) -> None:
        """Hyperparameters and final metrics for TensorBoard's HParams tab (a sweep compares runs there)."""
        if self._tb is None:
            return
        try:
            from .report.tensorboard import write_hparams
        except ImportError:  # tensorboard not installed: the scalars were skipped too
            return
        write_hparams(os.path.join(self.cfg.out, "tensorboard"), self.cfg.to_dict(), final, writer=self._tb)

    def _close_outputs(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._tb is not None:
            self._tb.close()
