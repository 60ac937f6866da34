"""What the engine reports of a model: the global model on the global test set (with per-label
accuracy), each client's own model on its local test split (over all clients, with the spread
and the worst tenth), the reference device's model, and cold-start clients (and, with
--final-adapt, every trained client) adapted from the final global model at the end.

A mixin of :class:`fedhpc.engine.Engine`, kept apart from the round loop: it reads the
engine's data, model, flat state, world and algorithm, and shards every evaluation over ranks
before one all-reduce: the global model's by contiguous runs of test batches (the global test
set, or the clients' local splits laid end to end), a client's own model on the rank holding it.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .losses import task_loss
from .round import ClientContext, RoundInfo
from .seeding import derive_seed, seed_torch


class Evaluation:
    """Evaluation methods of the engine (see the module docstring)."""

    @torch.no_grad()
    def evaluate(self, round_number: Optional[int] = None) -> Dict[str, float]:
        """Every eval round: the global model on the global test set (unless the method trains
        none, ``algo.has_global_model``); with local splits, the
        model each client would use on its own split; with a personal or channel-affected
        model, the reference device's model on the global test set (Mix2FLD's Fig. 2).

        ``round_number`` (1-based) draws the clients of a sampled local evaluation
        (--local-eval-clients); without it every client is evaluated."""
        has_global = self.algo.has_global_model  # else the global state is the untrained initial model
        metrics = self._evaluate_global(self.global_state) if has_global else {}
        if self.cfg.local_eval and self.cfg.client_test_fraction > 0:
            clients = self._local_eval_clients(round_number)
            metrics.update(self._evaluate_local(clients))
            if len(clients) < len(self.training_clients):
                metrics["local_eval_clients"] = len(clients)
        if self.uses_store:
            state = self._holder_broadcast(self.reference_device)  # None: it uses the global model
            metrics["reference_device_accuracy"] = (
                metrics["test_accuracy"] if state is None and has_global
                else self._evaluate_global(self.global_state if state is None else state)["test_accuracy"])
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
        batches, mine = self._my_eval_batches(n)
        per_label = self.cfg.per_label_accuracy
        classes = self.data.num_classes
        width = 3 + (2 * classes if per_label else 0)
        sums = torch.zeros(width + batches, dtype=torch.float64, device=self.world.device)
        for b in mine:
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

    def _my_eval_batches(self, n: int) -> Tuple[int, range]:
        """(the eval batches ``n`` samples make, this rank's contiguous run of them): cut once, the
        same for any rank count, so every sample meets the same batch (see _evaluate_global)."""
        batches, rank, size = -(-n // self.cfg.eval_batch_size), self.world.rank, self.world.size
        return batches, range(batches * rank // size, batches * (rank + 1) // size)

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

    def _hits(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Correct predictions of the loaded model per sample (per sequence, for next-character
        prediction: its positions predicted right), float64."""
        x, y = x.to(self.world.device), y.to(self.world.device)
        hit = self.model(self.data.transform(x, False, None)).argmax(-1) == y
        return hit.reshape(hit.shape[0], -1).sum(1).double()

    def _correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Correct predictions of the loaded model on a client's split, in eval-sized batches."""
        bs = self.cfg.eval_batch_size
        return sum(self._hits(x[s:s + bs], y[s:s + bs]).sum() for s in range(0, y.shape[0], bs))

    def _add_global_model_hits(self, table: torch.Tensor, correct_row: int, count_row: int, clients) -> None:
        """Add this rank's part of the global model's correct predictions and sample counts on the
        local test splits of ``clients`` into ``table[correct_row / count_row, cid]``.

        One pass over the splits laid end to end in client order and cut into eval batches, each
        rank taking a contiguous run of whole batches, as :meth:`_evaluate_global` shards the
        global test set: a forward per client (20,000 clients with a few test samples each) cost
        a hundred times the round it evaluated. A batch mixes clients; the batches are the same
        for any rank count, so every count is too."""
        sizes = self._client_test_sizes()
        clients = [c for c in clients if sizes[c] > 0]
        if not clients:
            return
        ends = torch.from_numpy(sizes[clients]).cumsum(0)
        starts = ends - torch.from_numpy(sizes[clients])
        n, bs = int(ends[-1]), self.cfg.eval_batch_size
        self.flat.load_(self.global_state)
        self.model.eval()
        ids = torch.tensor(clients, dtype=torch.long)
        for b in self._my_eval_batches(n)[1]:
            r0, r1 = b * bs, min((b + 1) * bs, n)
            i0 = int(torch.searchsorted(ends, r0, right=True))   # first client ending after r0
            i1 = int(torch.searchsorted(starts, r1))              # first client starting at or after r1
            x, y = self.data.client_test_rows(clients[i0:i1])
            cut = slice(r0 - int(starts[i0]), r1 - int(starts[i0]))
            x, y = x[cut], y[cut]
            owner = torch.repeat_interleave(ids[i0:i1], ends[i0:i1] - starts[i0:i1])[cut].to(table.device)
            table[correct_row].index_add_(0, owner, self._hits(x, y))
            table[count_row].index_add_(0, owner, torch.full((len(owner),), float(y[0].numel()),
                                                             dtype=torch.float64, device=table.device))

    def _client_test_sizes(self):
        """Every client's local test size (numpy), read from the data once per engine."""
        if getattr(self, "_test_sizes", None) is None:
            self._test_sizes = self.data.client_test_sizes()
        return self._test_sizes

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

    def _local_eval_clients(self, round_number: Optional[int]) -> List[int]:
        """Whom the local evaluation covers: every training client; with --local-eval-clients N,
        at an evaluation that is not the run's final one, N of them drawn by (seed, round), the
        same on any rank count and on resume (the stream is the evaluation's own: no training
        draw moves)."""
        pool, n = self.training_clients, self.cfg.local_eval_clients
        if round_number is None or n <= 0 or n >= len(pool) or self.algo.final_evaluation:
            return pool
        rng = np.random.default_rng([self.cfg.seed, 0x10CA1E, round_number])
        return [pool[i] for i in sorted(rng.choice(len(pool), size=n, replace=False).tolist())]

    def _evaluate_local(self, clients: Optional[List[int]] = None) -> Dict[str, float]:
        """Every client's own model (``algo.client_model``) on its own local test split, over
        all training clients (not only this round's) or the given ones, sharded over ranks; also
        the global model on the same splits when some client's model differs from it, and the
        spread across clients."""
        clients = self.training_clients if clients is None else clients  # cold-start ones: at the end
        n = self.data.num_clients
        dev = self.world.device
        # per client: correct (own model), count, correct (global model), has own model; row 4
        # counts failed ranks
        table = torch.zeros(5, n, dtype=torch.float64, device=dev)
        sizes = self._client_test_sizes()
        failure: Optional[Exception] = None  # one rank's failure stops every rank: see _summed_over_ranks
        try:
            self._add_global_model_hits(table, 2, 1, clients)  # a read failing here is one rank's too
            self.model.eval()
            for cid in clients:
                if self._evaluator_rank(cid) != self.world.rank or sizes[cid] == 0:
                    continue
                own = self.algo.client_model(cid)
                if own is not None:
                    self.flat.load_(own)
                    table[0, cid] = self._correct(*self.data.client_test_split(cid))
                    table[3, cid] = 1
        except Exception as e:
            failure = e
            table[-1, 0] = 1.0
        table = self._summed_over_ranks(table, 1, failure, "the clients' own models' evaluation")
        if table is None:
            return {}
        table[0] = torch.where(table[3] > 0, table[0], table[2])  # a client without its own model uses the global one
        has = table[1] > 0
        acc = table[0, has] / table[1, has]
        worst = torch.sort(acc).values[: max(1, int(math.ceil(0.1 * len(acc))))]
        out = {
            "local_test_accuracy": float(table[0].sum() / table[1].sum().clamp_min(1)),
            "local_test_accuracy_mean": float(acc.mean()),
            "local_test_accuracy_std": float(acc.std(unbiased=False)),
            "local_test_accuracy_worst10": float(worst.mean()),
        }
        if table[3].sum() > 0 and self.algo.has_global_model:
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
        sizes = self._client_test_sizes()
        failure: Optional[Exception] = None  # one rank's failure stops every rank: see _summed_over_ranks
        try:
            self._add_global_model_hits(table, 0, 2, clients)
            for cid in clients:
                if self._evaluator_rank(cid) != self.world.rank or sizes[cid] == 0:
                    continue
                self.flat.load_(self.global_state)
                seed_torch(derive_seed(self.cfg.seed, "adapt", cid), self.world.device)
                self.model.zero_grad(set_to_none=True)  # no gradient left from the last training step
                self.model.train()
                data = self.data.client(cid).training_on(self.world.device)
                ctx = ClientContext(self.algo, cid, data, rnd)
                with torch.enable_grad():
                    self.algo.adapt(self.model, ctx)
                self.model.eval()
                with torch.no_grad():
                    table[1, cid] = self._correct(data.x_test, data.y_test)
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
            "cold_start_clients": len(self.cold_start),
        }
        if self.algo.has_global_model:  # else it is the untrained initial model's
            out["cold_start_accuracy_global_model"] = float(table[0].sum() / table[2].sum())
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
