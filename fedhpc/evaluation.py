"""What the engine reports of a model: the global model on the global test set (with per-label
accuracy), each client's own model on its local test split (over all clients, with the spread
and the worst tenth), the reference device's model, and cold-start clients (and, with
--final-adapt, every trained client) adapted from the final global model at the end.

A mixin of :class:`fedhpc.engine.Engine`, kept apart from the round loop: it reads the
engine's data, model, flat state, world and algorithm, and shards every evaluation over ranks
(contiguous test slices, or clients by the rank that holds them) before one all-reduce.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .algorithms import ClientContext, RoundInfo
from .algorithms.base import derive_seed, seed_torch, task_loss


class Evaluation:
    """Evaluation methods of the engine (see the module docstring)."""

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Every eval round: the global model on the global test set; with local splits, the
        model each client would use on its own split; with a personal or channel-affected
        model, the reference device's model on the global test set (Mix2FLD's Fig. 2)."""
        metrics = self._evaluate_global(self.global_state)
        if self.cfg.local_eval and self.cfg.client_test_fraction > 0:
            metrics.update(self._evaluate_local())
        if self.uses_store:
            state = self._holder_broadcast(self.reference_device)
            metrics["reference_device_accuracy"] = (
                metrics["test_accuracy"] if state is None else self._evaluate_global(state)["test_accuracy"])
        return metrics

    def _evaluate_global(self, state: torch.Tensor) -> Dict[str, float]:
        """A flat model on the global test set, sharded over ranks by contiguous runs of batches."""
        self.flat.load_(state)
        self.model.eval()
        # The test set is cut into eval batches once, the same for any number of ranks, and each
        # rank takes a contiguous run of whole batches: every sample then meets the same batch
        # (a matmul's float32 rounding depends on the batch's size), so each batch's sums are the
        # same for any rank count. Counts add up exactly; the loss of each batch has its own slot
        # (one nonzero term each in the all-reduce) and the batches' losses are added exactly
        # (fsum): a float64 sum in rank order would move the test loss's last bits with the rank
        # count, as losses from 1e-9 to 10 do not add exactly.
        n, batch = self.data.num_test(), self.cfg.eval_batch_size
        batches = -(-n // batch)
        first, last = batches * self.world.rank // self.world.size, batches * (self.world.rank + 1) // self.world.size
        per_label = self.cfg.per_label_accuracy
        classes = self.data.num_classes
        width = 3 + (2 * classes if per_label else 0)
        sums = torch.zeros(width + batches, dtype=torch.float64, device=self.world.device)
        for b in range(first, last):
            x, y = self.data.test_slice(b * batch, min((b + 1) * batch, n))
            part = self._eval_sums(x, y, per_label)
            sums[width + b] = part[0]
            part[0] = 0.0
            sums[:width] += part
        self.world.all_reduce_sum_(sums)
        sums = sums.cpu()
        count = max(float(sums[2]), 1.0)
        out = {"test_loss": math.fsum(sums[width:].tolist()) / count, "test_accuracy": float(sums[1]) / count}
        if per_label:
            # one label's accuracy on the global test set (XorMixFL's Fig. 3 / Table 4 report the target label's)
            correct, seen = sums[3:3 + classes], sums[3 + classes:width]
            for c in range(classes):
                if seen[c] > 0:
                    out[f"test_accuracy_label{c}"] = float(correct[c] / seen[c])
        return out

    def _eval_sums(self, x: torch.Tensor, y: torch.Tensor, per_label: bool = False) -> torch.Tensor:
        """(loss sum, correct, count[, correct per label, count per label]) of the loaded model on one batch."""
        x, y = x.to(self.world.device), y.to(self.world.device)
        logits = self.model(self.data.transform(x, False, None))
        hit = logits.argmax(-1) == y
        # each sample's float32 loss, summed in float64 in one fixed order per batch
        losses = task_loss(logits, y, reduction="none").double()
        sums = torch.stack([losses.sum(), hit.sum().double(),
                            torch.tensor(float(y.numel())).to(logits.device, torch.float64)])
        if not per_label:
            return sums
        c = self.data.num_classes
        return torch.cat([sums, torch.bincount(y, weights=hit.double(), minlength=c).double(),
                          torch.bincount(y, minlength=c).double()])

    def _correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Correct predictions of the loaded model on a client's split, in eval-sized batches."""
        bs = self.cfg.eval_batch_size
        return sum(self._eval_sums(x[s:s + bs], y[s:s + bs])[1] for s in range(0, y.shape[0], bs))

    def _summed_over_ranks(self, table: torch.Tensor, count_row: int, failure: Optional[Exception],
                           where: str) -> Optional[torch.Tensor]:
        """All-reduce a per-client table; None when no client had a test split.

        The table's last row holds, in its first entry, 1 on a rank whose part failed
        (``failure``): a client's model or adaptation is the algorithm's code on one rank's
        clients, and an error there alone must not leave the other ranks in this all-reduce
        (World.raise_together). The row is dropped from what is returned."""
        self.world.all_reduce_sum_(table)
        table = table.cpu()
        if table[-1, 0] > 0:
            self.world.raise_together(failure, where)
        table = table[:-1]
        return table if bool((table[count_row] > 0).any()) else None

    def _evaluator_rank(self, cid: int) -> int:
        """Where client ``cid`` is evaluated: the rank holding its state, else cid % size."""
        if self.uses_store:
            return self.client_state.location.get(cid, cid % self.world.size)
        return cid % self.world.size

    def _evaluate_local(self) -> Dict[str, float]:
        """Every client's own model (``algo.client_model``) on its own local test split, over
        all clients (not only this round's), sharded over ranks; also the global model on the
        same splits when some client's model differs from it, and the spread across clients."""
        n = self.data.num_clients
        dev = self.world.device
        # per client: correct (own model), count, correct (global model), has own model; row 4
        # counts failed ranks
        table = torch.zeros(5, n, dtype=torch.float64, device=dev)
        self.model.eval()
        failure: Optional[Exception] = None  # one rank's failure stops every rank: see _summed_over_ranks
        try:
            for cid in self.training_clients:  # cold-start clients are evaluated once, at the end
                if self._evaluator_rank(cid) != self.world.rank:
                    continue
                x, y = self.data.client_test_split(cid)
                if y.numel() == 0:
                    continue
                own = self.algo.client_model(cid)
                for col, state in ((2, self.global_state), (0, own)):
                    if state is None:
                        continue
                    self.flat.load_(state)
                    table[col, cid] = self._correct(x, y)
                table[1, cid] = y.numel()
                if own is None:
                    table[0, cid] = table[2, cid]
                else:
                    table[3, cid] = 1
        except Exception as e:
            failure = e
            table[-1, 0] = 1.0
        table = self._summed_over_ranks(table, 1, failure, "the clients' own models' evaluation")
        if table is None:
            return {}
        has = table[1] > 0
        acc = table[0, has] / table[1, has]
        worst = torch.sort(acc).values[: max(1, int(math.ceil(0.1 * len(acc))))]
        out = {
            "local_test_accuracy": float(table[0].sum() / table[1].sum().clamp_min(1)),
            "local_test_accuracy_mean": float(acc.mean()),
            "local_test_accuracy_std": float(acc.std(unbiased=False)),
            "local_test_accuracy_worst10": float(worst.mean()),
        }
        if table[3].sum() > 0:
            out["local_test_accuracy_global_model"] = float(table[2].sum() / table[1].sum().clamp_min(1))
        return out

    def _adapted_table(self, clients, where: str) -> Optional[torch.Tensor]:
        """Rows (correct with the global model, correct after ``algo.adapt``, count) per client:
        each of ``clients`` takes the final global model, adapts it on its training data and is
        evaluated on its own test split; on the rank holding its state (cid % size if none).
        The clients join after the last round run (``stop_round``: --rounds, or where
        --stop-epsilon ended the run), with that round index for their batches and the learning
        rate decayed to it; the adaptation is seeded by (seed, cid), whatever the rank."""
        dev, n = self.world.device, self.data.num_clients
        table = torch.zeros(4, n, dtype=torch.float64, device=dev)  # correct before, after, count; failed ranks
        end = self.stop_round
        rnd = RoundInfo(end, [], [], self.cfg.lr * self.cfg.lr_decay ** end)
        failure: Optional[Exception] = None  # one rank's failure stops every rank: see _summed_over_ranks
        try:
            for cid in clients:
                if self._evaluator_rank(cid) != self.world.rank:
                    continue
                x, y = self.data.client_test_split(cid)
                if y.numel() == 0:
                    continue
                for col in (0, 1):
                    self.flat.load_(self.global_state)
                    if col == 1:
                        seed_torch(derive_seed(self.cfg.seed, "adapt", cid), self.world.device)
                        self.model.zero_grad(set_to_none=True)  # no gradient left from the last training step
                        self.model.train()
                        ctx = ClientContext(self.algo, cid, self._to_device(self.data.client(cid)), rnd)
                        with torch.enable_grad():
                            self.algo.adapt(self.model, ctx)
                    self.model.eval()
                    with torch.no_grad():
                        table[col, cid] = self._correct(x, y)
                table[2, cid] = y.numel()
        except Exception as e:
            failure = e
            table[-1, 0] = 1.0
        return self._summed_over_ranks(table, 2, failure, where)

    def _evaluate_cold_start(self, trained: Dict[str, float]) -> Dict[str, float]:
        """Each held-out client: the global model on its own test split, then ``algo.adapt`` on
        its data and the adapted model on the same split (see :meth:`_adapted_table`)."""
        table = self._adapted_table(self.cold_start, "the cold-start clients' adaptation")
        if table is None:
            return {}
        has = table[2] > 0
        after = table[1, has] / table[2, has]
        out = {
            "cold_start_accuracy": float(table[1].sum() / table[2].sum()),
            "cold_start_accuracy_mean": float(after.mean()),
            "cold_start_accuracy_global_model": float(table[0].sum() / table[2].sum()),
            "cold_start_clients": len(self.cold_start),
        }
        if "local_test_accuracy_mean" in trained:
            # the participation gap: what a client that never trained loses against one that did
            out["participation_gap"] = trained["local_test_accuracy_mean"] - out["cold_start_accuracy_mean"]
        return out

    def _evaluate_final_adapted(self) -> Dict[str, float]:
        """--final-adapt (pMixFed App. 10.1: "The final global model ... is then personalized
        according to each baseline's personalization or fine-tuning algorithm for r = 4 local
        epochs"): every trained client adapts the final global model with the method's
        ``adapt`` (its cold-start adaptation) and is evaluated on its own split, beside the
        models the clients kept (``local_test_accuracy*``)."""
        table = self._adapted_table(self.training_clients, "the trained clients' final adaptation")
        if table is None:
            return {}
        has = table[2] > 0
        acc = table[1, has] / table[2, has]
        worst = torch.sort(acc).values[: max(1, int(math.ceil(0.1 * len(acc))))]
        return {
            "local_test_accuracy_adapted": float(table[1].sum() / table[2].sum()),
            "local_test_accuracy_adapted_mean": float(acc.mean()),
            "local_test_accuracy_adapted_std": float(acc.std(unbiased=False)),
            "local_test_accuracy_adapted_worst10": float(worst.mean()),
        }

    def _holder_broadcast(self, cid: int) -> Optional[torch.Tensor]:
        """Client ``cid``'s model (``algo.client_model``) on every rank, or None for the global one."""
        holder = self._evaluator_rank(cid)
        own, failure = None, None
        if holder == self.world.rank:
            try:  # the holder alone runs it: its failure must not leave the others in the broadcast
                own = self.algo.client_model(cid)
            except Exception as e:
                failure = e
        has_own = self.world.broadcast_object("failed" if failure is not None else own is not None, src=holder)
        if has_own == "failed":
            self.world.raise_together(failure, f"client {cid}'s model (the reference device)")
        if not has_own:
            return None
        state = own.to(self.world.device, self.flat.flat.dtype) if own is not None else torch.empty_like(self.flat.flat)
        return self.world.broadcast_(state.contiguous(), src=holder)
