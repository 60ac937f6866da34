"""The ClientApp of the Flower column (imported by name inside Flower's ray actors).

It lives in its own module, not in the runner script, so that the actors import it by
name and keep the workload and the model between messages (a script's functions would
be pickled by value, with an empty cache, for every message).

A train message carries the global weights (``arrays``) and a config naming the round,
the client whose data to train and the workload file; the reply carries the trained
weights and ``num-examples`` = n_k, the weight FedAvg averages with.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch.nn import functional as F

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import peerlib

app = ClientApp()
_loaded: Dict[str, Tuple[peerlib.Workload, torch.nn.Module]] = {}


def _workload(path: str) -> Tuple[peerlib.Workload, torch.nn.Module]:
    """The workload and one model instance per actor process, loaded on first use."""
    if path not in _loaded:
        peerlib.set_threads(1)
        peerlib.warm_up_torch()  # in round 1 all the same: the actors start while it runs
        work = peerlib.Workload(path)
        _loaded[path] = (work, work.build_model())
    return _loaded[path]


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    work, model = _workload(str(config["workload"]))
    t, cid = int(config["round"]), int(config["cid"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    for x, y in work.batches(t, cid):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                        "metrics": MetricRecord({"num-examples": work.size(cid)})})
    return Message(content=reply, reply_to=msg)
