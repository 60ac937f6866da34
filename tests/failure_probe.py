"""Errors raised on one rank only, run under ``mpiexec -n 2`` by tests/test_rank_failures.py.

Usage:
  python tests/failure_probe.py dataset OUT [launcher flags...]
      python -m fedhpc.launch on a digits whose files are missing on rank 1's node alone (a
      DataError while the dataset loads, before any collective of the run).
  python tests/failure_probe.py client OUT [launcher flags...]
      python -m fedhpc.launch with a FedAvg whose client training fails on rank 1 alone in
      round 2 (a DataError naming the client), as a corrupt shard of one client would.
  python tests/failure_probe.py evaluation OUT [launcher flags...]
      the same with a FedAvg whose client_model (the model a client evaluates on its local test
      split) fails on rank 1 alone.
  python tests/failure_probe.py local_split OUT [launcher flags...]
      FedAvg on a digits whose clients' local test splits cannot be read on rank 1 (the global
      model's pass over every client's split, which each rank reads a run of).
  python tests/failure_probe.py reference OUT [launcher flags...]
      the same with a FedAvg keeping client state whose client_model fails wherever it runs:
      with --no-local-eval only the rank holding the reference device runs it.
  python tests/failure_probe.py server KIND OUT
      ServerTrainer.fit whose loss fails on rank 1 alone (KIND "config": a ConfigError; "bug": a
      RuntimeError; "custom": a FedHPCError subclass whose __init__ takes no message; "local": one
      defined inside a function, which cannot pickle). Each rank writes "ERRORTYPE: MESSAGE" and,
      for fedhpc's errors, a second line "exit code N" to OUT/rank<r>.txt and exits 0.
"""

import os
import sys

import torch
import torch.distributed as dist

from fedhpc.algorithms import register_algorithm
from fedhpc.algorithms.fedavg import FedAvg
from fedhpc.data import register_dataset
from fedhpc.data.digits import DigitsOptions, build_digits
from fedhpc.errors import ConfigError, DataError, FedHPCError


def on_rank_1() -> bool:
    return dist.is_initialized() and dist.get_rank() == 1


@register_algorithm("fails_on_rank_1")
class FailsOnRank1(FedAvg):
    """FedAvg whose clients on rank 1 fail in round 2."""

    def local_update(self, model, ctx):
        if ctx.round.index == 1 and on_rank_1():
            raise DataError(f"client {ctx.cid}'s shard is corrupt; prepare the dataset again")
        super().local_update(model, ctx)


@register_algorithm("client_model_fails_on_rank_1")
class ClientModelFailsOnRank1(FedAvg):
    """FedAvg whose clients on rank 1 have no model to evaluate."""

    def client_model(self, cid):
        if on_rank_1():
            raise DataError(f"client {cid}'s model file is unreadable; rerun with --resume")
        return super().client_model(cid)


@register_algorithm("reference_model_fails")
class ReferenceModelFails(FedAvg):
    """FedAvg with client state (so the reference device's model is fetched from its holder)
    whose client_model always fails."""

    uses_client_state = True

    def client_model(self, cid):
        raise DataError(f"client {cid}'s model file is unreadable; rerun with --resume")


@register_dataset("digits_missing_on_rank_1", DigitsOptions, "digits, whose files rank 1 cannot find")
def digits_missing_on_rank_1(cfg, options=None):
    if on_rank_1():
        raise DataError("/scratch/node2/digits.npz is missing; copy the dataset to every node")
    return build_digits(cfg, options)


@register_dataset("digits_local_splits_unreadable_on_rank_1", DigitsOptions,
                  "digits, whose clients' local test splits rank 1 cannot read")
def digits_local_splits_unreadable_on_rank_1(cfg, options=None):
    data = build_digits(cfg, options)
    read = data.client_test_rows

    def client_test_rows(cids):
        if on_rank_1():
            raise DataError("client_test/x of the store is truncated; prepare the dataset again")
        return read(cids)

    data.client_test_rows = client_test_rows
    return data


class ShardMissing(FedHPCError):
    """An error class built from its own arguments, not from a message."""

    exit_code = 5

    def __init__(self, cid: int, path: str):
        super().__init__(f"client {cid}'s shard {path} is missing; prepare the dataset again")


def server(kind: str, out: str) -> None:
    from fedhpc.flat import FlatModel
    from fedhpc.models import build_model
    from fedhpc.server.trainer import ServerTrainConfig, ServerTrainer
    from fedhpc.world import World

    def loss(logits, y, extra):
        if on_rank_1():
            if kind == "config":
                raise ConfigError("the teacher outputs have 9 labels for a 10-label model; gather them again")
            if kind == "custom":
                raise ShardMissing(7, "shards/7.h5")
            if kind == "local":
                class TeacherMissing(FedHPCError):
                    exit_code = 6
                raise TeacherMissing("the teacher outputs are missing; gather them again")
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return torch.nn.functional.cross_entropy(logits, y, reduction="none")

    world = World("cpu", threads=1, timeout=60)
    try:
        torch.manual_seed(0)
        model = build_model("mlp", (1, 8, 8), 10)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
        try:
            ServerTrainer(world, model, FlatModel(model)).fit(
                x, y, ServerTrainConfig(steps=4, batch_size=16, micro_batch=4), seed=1, loss_fn=loss,
                transform=lambda xb, train, gen: xb)
            said = "nothing raised"
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
            if isinstance(e, FedHPCError):
                said += f"\nexit code {e.exit_code}"
        with open(os.path.join(out, f"rank{world.rank}.txt"), "w") as f:
            f.write(said)
    finally:
        world.close()


if __name__ == "__main__":
    from fedhpc.launch import exit_now, main

    algo = {"client": "fails_on_rank_1", "evaluation": "client_model_fails_on_rank_1",
            "reference": "reference_model_fails"}.get(sys.argv[1])
    if algo is not None:
        exit_now(main(["--algo", algo, "--out", sys.argv[2], *sys.argv[3:]]))
    dataset = {"dataset": "digits_missing_on_rank_1", "local_split": "digits_local_splits_unreadable_on_rank_1"}
    if sys.argv[1] in dataset:
        exit_now(main(["--dataset", dataset[sys.argv[1]], "--out", sys.argv[2], *sys.argv[3:]]))
    server(sys.argv[2], sys.argv[3])
    exit_now(0)
