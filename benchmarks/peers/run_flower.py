"""The Flower column: FedAvg in Flower's simulation engine (flwr[simulation], ray), in Flower's venv.

    .venvs/flwr/bin/python run_flower.py WORKLOAD.npz RESULT.json [--actors 2]

A ``ServerApp`` runs Flower's message-API ``FedAvg`` strategy (``strategy.start``: send
train messages, wait for the replies, average the returned weights weighted by
``num-examples``) against ``num_clients`` virtual SuperNodes whose ``ClientApp``
(``flower_client.py``) runs in ray actors, started by ``flwr.simulation.run_simulation``.
``--actors`` sets ray's CPUs and ``client_resources = {num_cpus: 1}``, so that many
ClientApps run at once (2 = both cores of this machine, the counterpart of 2 processes).

Same work as fedhpc:
* cohorts: ``configure_train`` is overridden to send round t's message to fedhpc's
  cohort of round t: client c is always the c-th SuperNode by node id, and the message's
  config names the client (the ClientApp trains that client's exported data).
* batch order: the ClientApp walks the client's batches in fedhpc's order.
* not removable: FedAvg averages in float32 numpy (weights n_k / n applied before the
  sum), in the order the replies arrive, so the final weights differ from fedhpc's in the
  last bits; no federated (client-side) evaluation (``fraction_evaluate=0``).
Loop time: ``strategy.start`` on the ServerApp's clock, minus the central evaluations
(its ``evaluate_fn``, every ``eval_every`` rounds, the shared ``Workload.evaluate``). It
includes Flower's wait for replies, which polls every 0.1 s (``InMemoryGrid.pull_interval``),
and the serialisation of the weights into and out of messages.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # ray actors get the driver's sys.path: flower_client and peerlib import by name

import peerlib  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("result")
    ap.add_argument("--actors", type=int, default=2, help="ClientApps running at once (ray CPUs, 1 each)")
    a = ap.parse_args(argv)
    peerlib.set_threads(1)

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    import flower_client

    work_path = os.path.abspath(a.workload)
    work = peerlib.Workload(work_path)
    model = work.build_model()
    out = {}

    class CohortFedAvg(FedAvg):
        """Flower's FedAvg, sending each round to fedhpc's cohort instead of a random sample."""

        def configure_train(self, server_round, arrays, config, grid):
            nodes = sorted(grid.get_node_ids())
            t = server_round - 1
            messages = []
            for cid in work.cohort(t):
                cfg = ConfigRecord({"round": t, "cid": cid, "workload": work_path})
                messages.append(Message(content=RecordDict({"arrays": arrays, "config": cfg}),
                                        message_type=MessageType.TRAIN, dst_node_id=nodes[cid]))
            return messages

    evals, acc, ends = peerlib.Stopwatch(), {}, []

    def evaluate_fn(server_round: int, arrays: ArrayRecord):
        # Called before round 1 and after every round: the differences are the rounds' times.
        ends.append(time.perf_counter() - evals.total)
        if server_round == 0 or not work.is_eval_round(server_round - 1):
            return None
        with evals:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc[server_round] = work.evaluate(model)[0]
        return None

    server_app = ServerApp()

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        # Wait for every SuperNode to be registered, so that node ids -> clients is stable.
        while len(list(grid.get_node_ids())) < work.num_clients:
            time.sleep(0.05)
        strategy = CohortFedAvg(fraction_train=1.0, fraction_evaluate=0.0)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=work.rounds, evaluate_fn=evaluate_fn)
        out["state"] = result.arrays.to_torch_state_dict()

    # Flower logs every round at INFO; fedhpc runs --quiet and pfl without its metrics printout.
    logging.getLogger("flwr").setLevel(logging.WARNING)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": a.actors, "num_gpus": 0}}
    run_simulation(server_app=server_app, client_app=flower_client.app, num_supernodes=work.num_clients,
                   backend_config=backend)
    if "state" not in out:
        print("error: Flower's simulation ended without finishing the rounds", file=sys.stderr)
        return 1
    from importlib.metadata import version

    peerlib.write_result(a.result, f"Flower ({a.actors} actor{'s' if a.actors > 1 else ''})",
                         [b - e for e, b in zip(ends, ends[1:])], evals.total, acc, out["state"],
                         ranks=a.actors, flwr_version=version("flwr"),
                         ray_version=version("ray"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
