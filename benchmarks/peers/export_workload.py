"""Write the peers benchmark's workloads from fedhpc itself, one ``.npz`` each (runs in the project venv).

    .venv/bin/python benchmarks/peers/export_workload.py --out benchmarks/peers/.work

The other frameworks' venvs have no fedhpc, so this is how they get fedhpc's work: the
clients of fedhpc's digits split, the initial weights of fedhpc's model, the cohort of
every round and the order of every client's mini-batches (layout: ``peerlib.Workload``).
Everything is taken from a real :class:`fedhpc.engine.Engine` built from the same
configuration that the fedhpc runner passes to ``python -m fedhpc.launch``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

#: The two workloads of issue 14. (a) the cross-device shape; (b) a compute-bound one.
WORKLOADS: Dict[str, Dict] = {
    "a": dict(model="mlp", model_options={"hidden": 128}, num_clients=100, clients_per_round=10, rounds=50,
              local_epochs=1, batch_size=5, lr=0.05, eval_every=10),
    "b": dict(model="cnn", model_options={}, num_clients=10, clients_per_round=10, rounds=20,
              local_epochs=1, batch_size=10, lr=0.05, eval_every=10),
}


def launch_args(name: str, **overrides) -> List[str]:
    """The ``python -m fedhpc.launch`` flags of workload ``name`` (without --out / --threads);
    ``overrides`` replace entries of ``WORKLOADS[name]`` (the tests use shorter runs)."""
    w = {**WORKLOADS[name], **overrides}
    args = ["--dataset", "digits", "--partition", "iid", "--client-test-fraction", "0",
            "--model", w["model"], "--num-clients", str(w["num_clients"]),
            "--clients-per-round", str(w["clients_per_round"]), "--rounds", str(w["rounds"]),
            "--local-epochs", str(w["local_epochs"]), "--batch-size", str(w["batch_size"]),
            "--lr", str(w["lr"]), "--eval-every", str(w["eval_every"]), "--seed", "0"]
    for k, v in w["model_options"].items():
        args += ["--model-opt", f"{k}={v}"]
    return args


def export(name: str, path: str, **overrides) -> Dict:
    from fedhpc.algorithms.base import derive_seed
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine, sample_clients
    from fedhpc.world import World

    flags = launch_args(name, **overrides) + ["--threads", "1", "--quiet", "--no-tensorboard"]
    cfg, algo_opts, data_opts = parse_args(flags)
    engine = Engine(cfg, algo_opts, data_opts, World(threads=1))
    data = engine.data
    if engine.cold_start or data.augments:
        raise SystemExit("the peers benchmark assumes no cold-start clients and no augmentation")

    xs, ys, offsets = [], [], [0]
    for cid in range(data.num_clients):
        c = data.client(cid)
        # The runners feed what fedhpc's model sees: the dataset's evaluation-mode transform.
        xs.append(data.transform(c.x, False, None).numpy())
        ys.append(c.y.numpy())
        offsets.append(offsets[-1] + len(c.y))
    x_test, y_test = data.test_slice(0, data.num_test())

    R, K, E = cfg.rounds, cfg.clients_per_round, cfg.local_epochs
    sizes = np.diff(offsets)
    cohorts = np.array([sample_clients(cfg.seed, t, data.num_clients, K) for t in range(R)], dtype=np.int64)
    perms = np.full((R, K, E, int(sizes.max())), -1, dtype=np.int32)
    for t in range(R):
        for k, cid in enumerate(cohorts[t]):
            for e in range(E):
                # fedhpc's batch-order rule (ClientContext.batches' docstring)
                g = torch.Generator().manual_seed(derive_seed(cfg.seed, "batches", t, int(cid), e))
                perms[t, k, e, :sizes[cid]] = torch.randperm(int(sizes[cid]), generator=g).numpy()

    init = engine.flat.state_dict_from(engine.global_state)
    meta = dict(name=name, **{**WORKLOADS[name], **overrides}, seed=cfg.seed, num_classes=data.num_classes,
                dataset="digits", partition="iid", launch_args=launch_args(name, **overrides))
    arrays = {"x": np.concatenate(xs).astype(np.float32), "y": np.concatenate(ys).astype(np.int64),
              "offsets": np.asarray(offsets, dtype=np.int64),
              "x_test": data.transform(x_test, False, None).numpy().astype(np.float32),
              "y_test": y_test.numpy().astype(np.int64), "cohorts": cohorts, "perms": perms,
              "meta": np.array(json.dumps(meta))}
    arrays.update({f"w:{k}": v.detach().cpu().numpy() for k, v in init.items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # atomic: a runner never reads half a workload
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, ".work"), help="folder for <workload>.npz")
    ap.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in a.workloads:
        meta = export(name, os.path.join(a.out, f"{name}.npz"))
        print(f"workload {name}: {meta['model']}, {meta['num_clients']} clients, {meta['clients_per_round']} "
              f"per round, {meta['rounds']} rounds -> {os.path.join(a.out, name + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
