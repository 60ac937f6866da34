"""The round's contract between the engine and an algorithm: what a round is (:class:`RoundInfo`),
what one client's training sees (:class:`ClientContext`), what a client uploads
(:class:`Upload`) and the communication ledger that counts the bytes (:class:`CommLedger`).

The engine (:mod:`fedhpc.engine`, :mod:`fedhpc.batched`, :mod:`fedhpc.evaluation`), the
exchanges and the algorithms all stand on this module; it stands on nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

from .data.base import host_to_device
from .seeding import derive_seed

if TYPE_CHECKING:  # pragma: no cover
    from .algorithms.base import Algorithm
    from .data import ClientData


class CommLedger:
    """Bytes a client sends (up) and receives (down), by kind; summed over ranks each round."""

    def __init__(self, kinds: Tuple[str, ...]):
        self.kinds = tuple(kinds)
        self.values = torch.zeros(2 * len(self.kinds), dtype=torch.float64)

    def add(self, direction: str, kind: str, nbytes: float) -> None:
        if kind not in self.kinds:
            raise KeyError(f"ledger kind {kind!r} is not declared in the algorithm's ledger_kinds {self.kinds}")
        self.values[(0 if direction == "up" else 1) * len(self.kinds) + self.kinds.index(kind)] += nbytes

    def reset(self) -> None:
        self.values.zero_()

    def as_metrics(self, values: torch.Tensor) -> Dict[str, float]:
        k = len(self.kinds)
        out = {"bytes_up": float(values[:k].sum()), "bytes_down": float(values[k:].sum())}
        for i, kind in enumerate(self.kinds):
            out[f"bytes_up_{kind}"] = float(values[i])
            out[f"bytes_down_{kind}"] = float(values[k + i])
        return out


@dataclass
class RoundInfo:
    index: int                 # 0-based round number
    sampled: List[int]         # every client sampled this round (same list on every rank)
    my_clients: List[int]      # the sampled clients this rank trains
    lr: float                  # client learning rate this round


@dataclass(frozen=True)
class Upload:
    """One tensor every client sends, as declared in :meth:`Algorithm.upload_spec`.

    ``weighted``: the engine adds ``client_weight * tensor`` (model averaging) or the
    tensor as it is (sums and counts, e.g. per-label outputs). ``wire_bytes``: bytes a
    client puts on the wire for it, when that differs from the tensor's own size (a
    per-label *average* table is sent, the engine carries its sum and count); None
    means ``numel * element_size``.

    ``bound`` (unweighted uploads only): every entry lies in [-bound, bound]. The engine
    then rounds each client's tensor to a grid of step 2**(ceil(log2(bound * clients per
    round)) - 52) before adding it, on which every partial sum is exact in float64: the
    round's sum, and all an algorithm derives from it, is then the same for any number of
    ranks, where a float64 sum in rank order differs in its last bits. The step is far
    below float32's resolution (2**-48 for probabilities from 10 clients).
    """

    numel: int
    kind: str
    weighted: bool = True
    wire_bytes: Optional[int] = None
    bound: Optional[float] = None


class ClientContext:
    """Everything an algorithm sees while one client trains."""

    def __init__(self, algo: "Algorithm", cid: int, data: "ClientData", rnd: RoundInfo,
                 loss_sum: Optional[torch.Tensor] = None):
        """``loss_sum``: a float64 zero scalar on the device to add the training loss into (a batched
        group's clients get the elements of one tensor); default a fresh one."""
        self.algo, self.cid, self.data, self.round = algo, cid, data, rnd
        self.cfg = algo.cfg
        self.device = algo.device
        self.lr = rnd.lr
        self.ledger = algo.ledger
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=algo.device) if loss_sum is None else loss_sum
        self._steps: List[torch.Tensor] = []  # recorded batch losses not yet added (see record)
        self._step_samples: List[int] = []
        self.samples = 0
        self._loss_read: Optional[float] = None
        self.extra: Dict[str, Any] = {}

    @property
    def num_train(self) -> int:
        return self.data.num_train

    def generator(self, tag: str) -> torch.Generator:
        """A CPU generator fixed by (seed, round, client, tag): independent of rank and order."""
        return torch.Generator().manual_seed(derive_seed(self.cfg.seed, tag, self.round.index, self.cid))

    def batches(self, epoch: int, batch_size: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled mini-batches (x transformed for training, y) on the device.

        Order rule (tests rely on it): permutation = torch.randperm(n, generator=
        torch.Generator().manual_seed(derive_seed(seed, "batches", round, cid, epoch))),
        cut into consecutive chunks of batch_size, the last one possibly smaller.
        """
        bs = batch_size or self.cfg.batch_size
        n = self.data.num_train
        perm = host_to_device(self.permutation(epoch), self.device)
        aug = None
        if self.algo.data.augments:
            aug = torch.Generator(device=self.device).manual_seed(
                derive_seed(self.cfg.seed, "augment", self.round.index, self.cid, epoch))
        transform = self.algo.data.transform
        for start in range(0, n, bs):
            idx = perm[start: start + bs]
            yield transform(self.data.x[idx], True, aug), self.data.y[idx]

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of this client's training rows in ``epoch``, on the CPU (where it is drawn):
        :meth:`batches` cuts it into consecutive mini-batches."""
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "batches", self.round.index, self.cid, epoch))
        return torch.randperm(self.data.num_train, generator=g)

    def record(self, loss: torch.Tensor, n: int) -> None:
        """Add a mean batch loss over n samples to this client's training-loss sum (``loss_sum``).

        The step's loss is kept and added when the sum is read, on the host, in the order of the
        steps: no operation a step (on a GPU a kernel launch each, which a hand-written loop does not
        make), and the same float64 sum as adding ``n * loss`` step by step on the device (each
        product is exact: a float32 loss times a batch size fits float64's 53 bits)."""
        self._steps.append(loss.detach())
        self._step_samples.append(n)
        self.samples += n

    def _add_steps(self) -> Optional[float]:
        """Add the recorded steps to the device sum; the new sum on the host (None: none recorded)."""
        if not self._steps:
            return None
        values = torch.cat([self._loss_sum.view(1), torch.stack(self._steps).double().view(-1)]).tolist()
        total = values[0]
        for value, n in zip(values[1:], self._step_samples):
            total += n * value
        self._steps, self._step_samples = [], []
        self._loss_sum.fill_(total)
        return total

    @property
    def loss_sum(self) -> torch.Tensor:
        """The training-loss sum as a float64 scalar on the device, the recorded steps added (a device
        sync when there are any); a method may add to it in place (Ditto's guard)."""
        self._add_steps()
        return self._loss_sum

    def loss_total(self) -> float:
        """The training-loss sum on the host, once training is over: one device sync, unless a batched
        group read its clients' sums together (:meth:`settle_losses`)."""
        if self._loss_read is None:
            total = self._add_steps()
            self._loss_read = float(self._loss_sum) if total is None else total
        return self._loss_read

    @staticmethod
    def settle_losses(ctxs: List["ClientContext"]) -> None:
        """Read the trained clients' loss sums in one device sync (a batched group's)."""
        for ctx, value in zip(ctxs, torch.stack([c.loss_sum for c in ctxs]).tolist()):
            ctx._loss_read = value

    def load_state(self, default: Any = None) -> Any:
        """This client's state from earlier rounds (whichever rank trained it), or ``default``."""
        return self.algo.client_state.get_slot(self.cid, "algo", default)

    def save_state(self, state: Any) -> None:
        self.algo.client_state.put_slot(self.cid, "algo", state)
