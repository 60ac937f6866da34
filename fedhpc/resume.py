"""The engine's side of checkpoints: what a checkpoint holds of the run, restoring it, and the
log record a resume writes again when it moves the run's end.

A mixin of :class:`fedhpc.engine.Engine`, like :mod:`fedhpc.evaluation` and :mod:`fedhpc.run_log`:
it reads and sets the engine's state (global model, algorithm state, byte and clock totals,
round range). :mod:`fedhpc.checkpoint` writes and finds the files; this module decides their
contents, so that a resumed run ends where the uninterrupted one would have.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import checkpoint
from .errors import CheckpointError


def to_device(obj, device):
    """``obj`` (nested dicts / lists / tuples of tensors) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class Resume:
    """Checkpoint methods of the engine (see the module docstring)."""

    def save_checkpoint(self, round_done: int) -> None:
        server = {
            "identity": self._identity(),
            "model": self.model_name,
            "global_state": self.global_state.cpu(),
            "algo_state": to_device(self.algo.state_dict(), "cpu"),
            "cum_bytes": dict(self.cum_bytes),
            "sim_seconds_total": self.sim_seconds_total,
            "round_seconds_total": self.round_seconds_total,
            "previous_convergence_state": self._previous_convergence_state,
            # the run converged: it ends there whatever --rounds a resume gives (also when that
            # was the last round: a longer run would have stopped there too)
            "stop_round": self._converged_round,
            # the round's training metrics, and its whole log record when it was logged with the
            # final evaluation: a resume that moves the run's end logs that round again (_resume_records)
            "round_metrics": self._round_metrics,
            "final_record": self._final_record,
        }
        store = self.client_state if self.uses_store else None
        checkpoint.save(self.cfg.out, round_done, self.world, server, store)

    def _identity(self) -> Dict:
        """The settings a checkpoint must share with the run resuming it: the config's, plus
        those the algorithm's updates read (``Algorithm.identity_settings``)."""
        return self.cfg.identity(self.algo.identity_settings)

    def restore(self) -> None:
        found = checkpoint.load_latest_intact(self.cfg.out, self._identity(), warn=self._warn, world=self.world,
                                              auto_means={"model": self.data.default_model()})
        if found is None:
            if self.is_main:
                print(f"no checkpoint in {self.cfg.out}: starting from round 0", flush=True)
            return
        directory, body = found
        state = body["global_state"]
        if state.shape != self.global_state.shape:
            raise CheckpointError(f"checkpoint {directory} holds a model of {state.numel()} values, "
                                  f"this run builds {self.global_state.numel()}; resume with the same model")
        device = self.world.device
        self.global_state = state.to(device)
        self.algo.global_state = self.global_state
        # Device contract: algorithms get their saved tensors back on the run's device.
        self.algo.load_state_dict(to_device(body.get("algo_state") or {}, device))
        self.cum_bytes = dict(body.get("cum_bytes", self.cum_bytes))
        self.sim_seconds_total = float(body.get("sim_seconds_total", 0.0))
        self.round_seconds_total = float(body.get("round_seconds_total", 0.0))
        self._previous_convergence_state = body.get("previous_convergence_state")
        if self.uses_store:
            self.client_state.load_shards(body["client_state_dirs"], body.get("client_state_indexed", True))
        self.start_round = int(body["round"])
        old_final = body.get("last_round_metrics")  # checkpoints before round_metrics / final_record
        self._resumed = {"round_metrics": body.get("round_metrics", old_final),
                         "final_record": body.get("final_record"),
                         "final_logged": body.get("final_record") is not None or old_final is not None}
        self._round_metrics, self._final_record = self._resumed["round_metrics"], self._resumed["final_record"]
        self.algo.rounds_done = self.start_round
        if self.start_round > self.cfg.rounds:
            raise CheckpointError(
                f"checkpoint {directory} is after round {self.start_round}, past --rounds {self.cfg.rounds}; "
                f"resume with --rounds {self.start_round} or more (its final model is "
                f"{self.cfg.out}/final_model.pt if that run finished), or use another --out")
        converged = body.get("stop_round") or ((old_final or {}).get("converged") and self.start_round)
        if converged:
            self.stop_round = self._converged_round = int(converged)  # the run had converged: nothing left to do
        if self.is_main:
            print(f"resumed from {directory} after round {self.start_round}", flush=True)

    def _resume_records(self) -> Tuple[Optional[Dict[str, float]], Optional[Dict[str, float]]]:
        """Collective. The log record that replaces the checkpoint round's on resume, and the
        run's final metrics when that round is its last; (None, None): the log stays as it is.

        The last round of a run is logged with the final evaluation (FedBABU's fine-tuned heads,
        cold-start clients, --final-adapt), even off the --eval-every grid; any other round is
        logged as an ordinary one. So when a resume moves the run's end:
          * a finished run extended with more --rounds: its last round becomes an ordinary one
            (its training metrics, kept in the checkpoint, with on the grid an ordinary
            evaluation of the restored model);
          * a finished run resumed as it is: its final record, as the checkpoint keeps it (an
            extension that failed before its first round ended had replaced it);
          * a run resumed with --rounds equal to its checkpoint's round: that round is now the
            last, evaluated and logged as the run of that length logs it."""
        saved = self._resumed
        if saved is None or saved["round_metrics"] is None:
            return None, None
        if self.start_round < self.stop_round:
            if not saved["final_logged"]:
                return None, None
            record = dict(saved["round_metrics"])
            if self.start_round % self.cfg.eval_every == 0:
                self._evaluate_round(record, last=False)
            record.pop("stop", None)
            return record, None
        if saved["final_record"] is not None:
            return dict(saved["final_record"]), dict(saved["final_record"])
        if saved["final_logged"]:
            return None, None  # an older checkpoint of a finished run: its record was not kept
        record = dict(saved["round_metrics"])
        self._evaluate_round(record, last=True)
        record.pop("stop", None)
        self._final_record = dict(record)
        return record, dict(record)
