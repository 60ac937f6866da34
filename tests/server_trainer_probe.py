"""Runs the server trainer on a few cases, as a script (also under mpiexec).

Usage: python tests/server_trainer_probe.py DUMP_DIR
Each rank writes DUMP_DIR/rank<r>.pt: case -> {"init", "flat", "ints", "loss", "samples", "steps"}.
The cases cover what could make ranks disagree: momentum and Nesterov, dropout,
augmentation drawn from the transform's generator, soft targets, Adam with
clipping, BatchNorm (ghost batches and running statistics), a custom loss with
per-sample extras, a last batch smaller than the others, and batches with fewer
micro-batches than ranks (rank 2 idle).
"""

import torch
import torch.nn.functional as F
from torch import nn

from fedhpc.algorithms.base import derive_seed
from fedhpc.flat import FlatModel
from fedhpc.models import build_model
from fedhpc.server.trainer import ServerTrainConfig, ServerTrainer


def data(tag, n, shape, classes, uint8=False):
    g = torch.Generator().manual_seed(derive_seed(0, "probe_data", tag))
    if uint8:
        x = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
    else:
        x = torch.randn(n, *shape, generator=g)
    return x, torch.randint(0, classes, (n,), generator=g), g


def noisy(x, train, generator):
    """uint8 -> [0, 1] plus noise from the trainer's generator (a stand-in for augmentation)."""
    x = x.float() / 255.0
    return x + 0.1 * torch.randn(x.shape, generator=generator, device=x.device) if train else x


def mix2fld_like(logits, y, teacher):
    """Mix2FLD Eq. 5's shape: CE(label) + beta * psi(softmax output, teacher output of the label)."""
    return F.cross_entropy(logits, y, reduction="none") + 0.5 * ((logits.softmax(1) - teacher) ** 2).sum(1)


def cases():
    torch.manual_seed(1)  # model initialisation only: the same on every rank
    out = {}

    x, y, _ = data("mlp", 50, (1, 8, 8), 10)
    out["mlp"] = (build_model("mlp", (1, 8, 8), 10), dict(x=x, targets=y),
                  ServerTrainConfig(steps=7, batch_size=24, micro_batch=5, lr=0.1, momentum=0.9,
                                    nesterov=True, weight_decay=1e-3))

    x, y, g = data("dropout", 45, (1, 8, 8), 10, uint8=True)
    soft = torch.rand(45, 10, generator=g).softmax(1)
    drop = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
    out["dropout"] = (drop, dict(x=x, targets=soft, transform=noisy),
                      ServerTrainConfig(epochs=2, batch_size=16, micro_batch=4, lr=0.01, optimizer="adam",
                                        weight_decay=1e-4, grad_clip=0.5))

    x, y, g = data("bn", 40, (1, 8, 8), 5)
    teacher = torch.rand(5, 5, generator=g).softmax(1)[y]
    bn = nn.Sequential(nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(),
                       nn.Linear(6 * 36, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 5))
    out["bn"] = (bn, dict(x=x, targets=y, loss_fn=mix2fld_like, extra=teacher),
                 ServerTrainConfig(steps=5, batch_size=16, micro_batch=6, lr=0.05, momentum=0.5))

    x, y, _ = data("mix2fld", 20, (1, 28, 28), 10)
    out["mix2fld_cnn"] = (build_model("mix2fld_cnn", (1, 28, 28), 10), dict(x=x, targets=y),
                          ServerTrainConfig(steps=3, batch_size=12, micro_batch=4, lr=0.05))
    return out


def trained(world):
    results = {}
    for name, (model, kw, cfg) in cases().items():
        flat = FlatModel(model)
        init = flat.flat.clone()
        res = ServerTrainer(world, model, flat).fit(cfg=cfg, seed=derive_seed(7, name), **kw)
        results[name] = {"init": init, "flat": flat.flat.clone(),
                         "ints": [b.clone() for b in model.buffers() if not b.is_floating_point()],
                         "loss": res["loss"], "samples": res["samples"], "steps": res["steps"]}
    return results


if __name__ == "__main__":
    import rank_probe

    rank_probe.run(trained)
