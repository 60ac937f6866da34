"""What every runner of the peers benchmark shares: the exported workload, the models, evaluation.

Only numpy and torch are imported here, because this module runs in every virtual
environment (the project's, pfl's, Flower's), and only the project's has fedhpc.
``export_workload.py`` writes one ``.npz`` per workload from fedhpc itself; every runner
reads it through :class:`Workload`, so they all train

* the same clients (fedhpc's digits split: ``x``/``y`` cut by ``offsets``),
* the same cohort per round (fedhpc's ``sample_clients(seed, t, N, K)``: ``cohorts[t]``),
* the same mini-batches in the same order (fedhpc's rule, ``ClientContext.batches``: a
  ``torch.randperm`` per (seed, round, client, epoch), stored in ``perms``),
* from the same initial weights (``w:<name>``), and evaluate on the same global test set.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


# ---------------------------------------------------------------------------- models
# The two digits models of fedhpc (fedhpc/models/simple.py), rebuilt here with the same
# parameter names, so that the exported initial weights load with strict=True: a model
# that differed in any layer's name or shape would refuse them.

class MLP(nn.Module):
    """Flatten, (depth - 1) x [Linear(hidden), ReLU], Linear(num_classes)."""

    def __init__(self, input_shape, num_classes: int, hidden: int = 64, depth: int = 2):
        super().__init__()
        dims = [math.prod(input_shape)] + [hidden] * (depth - 1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        x = x.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CNN(nn.Module):
    """conv3x3(width) ReLU, conv3x3(2 width) ReLU maxpool2, Linear(hidden) ReLU, Linear(classes)."""

    def __init__(self, input_shape, num_classes: int, width: int = 16, hidden: int = 64):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * (h // 2) * (w // 2), hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.fc(self.conv2(self.conv1(x))))


MODELS = {"mlp": MLP, "cnn": CNN}


# ---------------------------------------------------------------------------- workload
class Workload:
    """One exported workload (see the module docstring); tensors on the CPU."""

    def __init__(self, path: str):
        with np.load(path) as z:
            self.meta: Dict = json.loads(str(z["meta"]))
            self.x = torch.from_numpy(z["x"])
            self.y = torch.from_numpy(z["y"])
            self.offsets = z["offsets"].astype(np.int64)
            self.x_test = torch.from_numpy(z["x_test"])
            self.y_test = torch.from_numpy(z["y_test"])
            self.cohorts = z["cohorts"].astype(np.int64)          # (rounds, K)
            self.perms = z["perms"].astype(np.int64)              # (rounds, K, epochs, max n), -1 padded
            self.init = {k[2:]: torch.from_numpy(z[k]) for k in z.files if k.startswith("w:")}
        m = self.meta
        self.name: str = m["name"]
        self.rounds: int = m["rounds"]
        self.epochs: int = m["local_epochs"]
        self.batch_size: int = m["batch_size"]
        self.lr: float = m["lr"]
        self.eval_every: int = m["eval_every"]
        self.num_clients = len(self.offsets) - 1

    # clients -----------------------------------------------------------------
    def client(self, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[cid], self.offsets[cid + 1]
        return self.x[a:b], self.y[a:b]

    def size(self, cid: int) -> int:
        return int(self.offsets[cid + 1] - self.offsets[cid])

    def cohort(self, t: int) -> List[int]:
        """The clients of round ``t`` (0-based), sorted as fedhpc samples them."""
        return [int(c) for c in self.cohorts[t]]

    def order(self, t: int, cid: int, epoch: int) -> torch.Tensor:
        """fedhpc's permutation of client ``cid``'s samples in round ``t``, epoch ``epoch``."""
        k = int(np.flatnonzero(self.cohorts[t] == cid)[0])
        n = self.size(cid)
        perm = self.perms[t, k, epoch, :n]
        assert (perm >= 0).all(), f"no exported batch order for client {cid} in round {t}"
        return torch.from_numpy(perm)

    def batches(self, t: int, cid: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """All local mini-batches of client ``cid`` in round ``t``, epochs one after another."""
        x, y = self.client(cid)
        for e in range(self.epochs):
            idx = self.order(t, cid, e)
            for s in range(0, len(idx), self.batch_size):
                j = idx[s:s + self.batch_size]
                yield x[j], y[j]

    def shuffled_client(self, t: int, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Client ``cid``'s data permuted in its round-``t`` order (one local epoch): a framework
        that cuts a dataset into consecutive batches then sees fedhpc's batches."""
        assert self.epochs == 1, "a pre-shuffled dataset reproduces one epoch's order only"
        x, y = self.client(cid)
        idx = self.order(t, cid, 0)
        return x[idx], y[idx]

    def is_eval_round(self, t: int) -> bool:
        """fedhpc's rule: evaluate after every ``eval_every``-th round and after the last."""
        return (t + 1) % self.eval_every == 0 or t + 1 == self.rounds

    # model -------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        m = self.meta
        model = MODELS[m["model"]](tuple(self.x.shape[1:]), m["num_classes"], **m["model_options"])
        model.load_state_dict(self.init, strict=True)
        return model

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 1000) -> Tuple[float, float]:
        """(accuracy, mean loss) of ``model`` on the global test set."""
        model.eval()
        correct, loss = 0, 0.0
        for s in range(0, len(self.y_test), batch_size):
            out = model(self.x_test[s:s + batch_size])
            y = self.y_test[s:s + batch_size]
            correct += int((out.argmax(1) == y).sum())
            loss += float(F.cross_entropy(out, y, reduction="sum"))
        model.train()
        n = len(self.y_test)
        return correct / n, loss / n


# ---------------------------------------------------------------------------- results
def set_threads(n: int = 1) -> None:
    """One intra-op thread, as every runner of the benchmark uses (fedhpc: ``--threads 1``)."""
    torch.set_num_threads(n)


def warm_up_torch() -> None:
    """Build and drop one optimizer before the timed loop.

    torch imports ``torch._dynamo`` lazily when the first optimizer is built: 1-3 s on this
    machine, once per process. pfl builds its central optimizer before its loop, fedhpc and
    the plain loop inside round 1; every runner calls this first, so that the loop times
    compare rounds, not where that import happens. The process times still include it.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def write_result(path: str, framework: str, round_seconds: List[float], eval_seconds: float,
                 accuracies: Dict[int, float], state: Dict[str, torch.Tensor], **extra) -> None:
    """A runner's result: ``path`` (JSON) and the final weights next to it (``.weights.npz``).

    ``round_seconds`` holds every round's wall time: training, aggregation and the
    framework's own per-round machinery, without the central evaluations (their total is
    ``eval_seconds``). ``loop_seconds`` is their sum; ``steady_seconds`` leaves out round 1,
    which carries each framework's warm-up (lazy imports, Flower's ray actors starting).
    Written to a temporary name and renamed, so a killed runner leaves no partial file.
    """
    weights = {k: v.detach().cpu().float().numpy() for k, v in state.items()}
    tmp = path + ".weights.tmp.npz"
    np.savez(tmp, **weights)
    os.replace(tmp, path + ".weights.npz")
    body = {"framework": framework, "loop_seconds": float(sum(round_seconds)),
            "steady_seconds": float(sum(round_seconds[1:])), "eval_seconds": eval_seconds,
            "round_seconds": [float(r) for r in round_seconds],
            "accuracies": {str(k): v for k, v in sorted(accuracies.items())},
            "final_accuracy": accuracies[max(accuracies)] if accuracies else None,
            "torch": torch.__version__, **extra}
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=1)
    os.replace(path + ".tmp", path)


class Stopwatch:
    """Accumulates the seconds spent inside ``with watch:`` blocks."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self._t0
        return False
