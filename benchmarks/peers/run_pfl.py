"""The pfl-research column (pfl 0.6.0): FedAvg through pfl's simulator, in pfl's own venv.

    .venvs/pfl/bin/python run_pfl.py WORKLOAD.npz RESULT.json                          # one process
    .venvs/pfl/bin/torchrun --standalone --nproc-per-node 2 run_pfl.py WORKLOAD.npz RESULT.json

pfl's pieces, as its documentation composes them: a ``FederatedDataset`` with a user
sampler, a ``SimulatedBackend`` that trains each worker's share of the cohort and
all-reduces the sums (torch.distributed, gloo, under ``torchrun``), ``FederatedAveraging``
with the local SGD of ``NNTrainHyperParams``, and ``PyTorchModel`` whose central optimizer
applies the averaged model difference (SGD, lr 1: w <- w + mean of (w_k - w)).
``WeightByDatapoints`` makes the average weighted by n_k, as fedhpc's is.

Same work as fedhpc:
* cohorts: the user sampler is pfl's ``MinimizeReuseUserSampler`` over the exported
  sequence of (round, client) pairs, i.e. it hands out fedhpc's cohort of round t, in
  order. With 2 workers pfl's sampler draws 2 users per step and keeps one per worker, so
  the two workers together still train exactly that cohort (5 clients each).
* batch order: a pfl ``Dataset`` is cut into consecutive batches, so each (round, client)
  user is built from the client's samples already permuted in fedhpc's order for that round.
* differences that pfl does not let one remove: the model differences are summed in
  float32 (fedhpc and the plain loop sum weights in float64), and pfl evaluates every
  user of round 1 on its own data before and after training (``do_evaluation`` is true at
  iteration 0 whatever ``evaluation_frequency`` is; 20 evaluations of ~15 samples).
Central evaluation (every ``eval_every`` rounds, on rank 0's clock, excluded from the loop
time) runs the shared ``Workload.evaluate`` in a callback, the same code as the plain loop.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import peerlib


class PflNet(nn.Module):
    """The benchmark model with the ``loss`` and ``metrics`` methods pfl's PyTorchModel calls."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def loss(self, x, y):
        return F.cross_entropy(self.net(x), y)

    @torch.no_grad()
    def metrics(self, x, y):
        from pfl.metrics import Weighted

        out = self.net(x)
        return {"loss": Weighted(float(F.cross_entropy(out, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y))}


def main(work_path: str, out_path: str) -> int:
    peerlib.set_threads(1)
    peerlib.warm_up_torch()
    np.random.seed(0)  # pfl derives its per-worker seeds from numpy's global state: equal on every worker
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as get_ops
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    work = peerlib.Workload(work_path)
    rank, world = get_ops().distributed.global_rank, get_ops().distributed.world_size
    net = PflNet(work.build_model())
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))

    users = [(t, cid) for t in range(work.rounds) for cid in work.cohort(t)]
    train = FederatedDataset(lambda u: Dataset(work.shuffled_client(*u), user_id=str(u[1])),
                             MinimizeReuseUserSampler(users))
    backend = SimulatedBackend(training_data=train, val_data=train, postprocessors=[WeightByDatapoints()])

    evals, acc, ends = peerlib.Stopwatch(), {}, []

    class CentralEvaluation(TrainingProcessCallback):
        """Times every round (pfl calls this after each) and evaluates every ``eval_every`` rounds."""

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            ends.append(time.perf_counter() - evals.total)
            if work.is_eval_round(central_iteration):
                with evals:
                    acc[central_iteration + 1] = work.evaluate(net.net)[0]
            return False, Metrics()

    params = NNAlgorithmParams(central_num_iterations=work.rounds, evaluation_frequency=work.rounds,
                               train_cohort_size=len(work.cohort(0)), val_cohort_size=None)
    train_params = NNTrainHyperParams(local_num_epochs=work.epochs, local_learning_rate=work.lr,
                                      local_batch_size=work.batch_size)
    ends.append(time.perf_counter())
    FederatedAveraging().run(algorithm_params=params, backend=backend, model=model,
                             model_train_params=train_params,
                             model_eval_params=NNEvalHyperParams(local_batch_size=None),
                             callbacks=[CentralEvaluation()], send_metrics_to_platform=False)
    if rank == 0:
        peerlib.write_result(out_path, f"pfl ({world} process{'es' if world > 1 else ''})",
                             [b - a for a, b in zip(ends, ends[1:])], evals.total,
                             acc, net.net.state_dict(), ranks=world, pfl_version=_version("pfl"))
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")
    sys.exit(main(*sys.argv[1:3]))
