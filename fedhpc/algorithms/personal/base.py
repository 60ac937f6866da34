"""Shared pieces of the personalised family (pMixFed and the baselines of its Tables 1-2).

* :class:`LayerMap`: a model's declared ``layers()`` blocks (base first, head last) as
  segments of the flat state, so that "one coefficient per layer" is one
  :func:`fedhpc.ops.segment_mix` call over the whole flat buffer (pMixFed's mixing) and
  "the personal part" is a handful of contiguous ranges (FedPer's head, LG-FedAvg's
  representation layers...). In a :class:`~fedhpc.flat.FlatModel` every parameter comes
  before every float buffer, so a block with BatchNorm owns two segments (its parameters,
  later its running statistics); a layer is a set of segments, not one.
* :func:`select_layers`: the personal / shared / global part chosen by name.
* :class:`Part`: gather / scatter of a selection of layers (the compact personal state a
  client keeps in the client-state store, the shared upload).
* :class:`PersonalAlgorithm`: training helpers (fresh optimisers over a subset of the
  parameters, truly frozen blocks, fine-tuning for evaluation) and :class:`PartialAlgorithm`,
  the shared/personal split that FedPer, FedSim, FedAlt and LG-FedAvg are variations of.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...batched import weighted_task_loss
from ...errors import ConfigError
from ...models import model_layers
from ...ops import segment_mix, segment_offsets
from ..base import Algorithm, ClientContext, RoundInfo, Upload, derive_seed, seed_torch


# ----------------------------------------------------------------------------- layers as flat segments

class LayerMap:
    """Layers of a model (input side first) as segments of its flat state.

    ``unit="block"``: a layer is one declared ``layers()`` block with everything under it
    (parameters and float buffers). ``unit="tensor"``: a layer is one parameter tensor, in
    ``named_parameters`` order; a float buffer (BatchNorm statistics) joins the last
    parameter of its own module, else the last parameter of its block.
    """

    def __init__(self, model: nn.Module, flat, unit: str = "block"):
        if unit not in ("block", "tensor"):
            raise ConfigError(f"layer unit must be block or tensor, got {unit!r}")
        blocks = model_layers(model)
        if not blocks:
            raise ConfigError(f"{type(model).__name__} declares no layers with parameters")

        def block_of(name: str) -> int:
            for b, (prefix, _) in enumerate(blocks):
                if name == prefix or name.startswith(prefix + "."):
                    return b
            raise ConfigError(f"{name!r} of {type(model).__name__} lies in none of its declared layers "
                              f"{[n for n, _ in blocks]}; layers() must cover every parameter and buffer")

        entry_layer: List[int] = []
        if unit == "block":
            self.names = [n for n, _ in blocks]
            entry_layer = [block_of(e.name) for e in flat.entries]
        else:
            params = [e for e in flat.entries if e.is_param]
            self.names = [e.name for e in params]
            for e in flat.entries:
                if e.is_param:
                    entry_layer.append(self.names.index(e.name))
                    continue
                module = e.name.rpartition(".")[0]
                same = [i for i, p in enumerate(params) if p.name.rpartition(".")[0] == module]
                block = [i for i, p in enumerate(params) if block_of(p.name) == block_of(e.name)]
                if not (same or block):
                    raise ConfigError(f"buffer {e.name!r} has no parameter in its layer block to join")
                entry_layer.append((same or block)[-1])
        # consecutive entries of one layer make one segment
        lengths, seg_layer = [], []
        for e, layer in zip(flat.entries, entry_layer):
            if seg_layer and seg_layer[-1] == layer:
                lengths[-1] += e.numel
            else:
                lengths.append(e.numel)
                seg_layer.append(layer)
        self.unit = unit
        self.numel = flat.numel
        self.offsets = segment_offsets(lengths)                       # (S+1,) int64, CPU
        self.seg_layer = torch.tensor(seg_layer, dtype=torch.long)    # (S,)
        self.modules = [m for _, m in blocks] if unit == "block" else None

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def expand(self, lam_layers: torch.Tensor) -> torch.Tensor:
        """Per-layer coefficients (L,) or (C, L) -> per-segment (S,) or (C, S)."""
        return lam_layers.index_select(-1, self.seg_layer.to(lam_layers.device))

    def mix(self, a: torch.Tensor, b: torch.Tensor, lam_layers: torch.Tensor,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """lam_i * a + (1 - lam_i) * b, layer by layer, over whole flat states (one op)."""
        return segment_mix(a, b, self.offsets, self.expand(lam_layers.to(torch.float64)), out=out)

    def ranges(self, layers: Iterable[int]) -> List[Tuple[int, int]]:
        """Merged [start, stop) ranges of the flat state covered by ``layers``."""
        chosen = set(int(i) for i in layers)
        out: List[Tuple[int, int]] = []
        o = self.offsets.tolist()
        for s, layer in enumerate(self.seg_layer.tolist()):
            if layer in chosen and o[s + 1] > o[s]:
                if out and out[-1][1] == o[s]:
                    out[-1] = (out[-1][0], o[s + 1])
                else:
                    out.append((o[s], o[s + 1]))
        return out


def select_layers(names: Sequence[str], spec: str, what: str) -> List[int]:
    """Indices of the layers named by ``spec`` (comma-separated items, any mix of):

    ``head`` / ``base`` (the last / first layer), ``first:K`` / ``last:K`` (K an integer or
    ``half`` = floor(L/2)), or a layer name (``convs.3``) or a prefix of dotted names
    (``convs`` = every ``convs.*``).
    """
    n = len(names)
    chosen = set()
    for raw in str(spec).split(","):
        item = raw.strip()
        if not item:
            continue
        if item in ("head", "base") and item not in names:
            chosen.add(n - 1 if item == "head" else 0)
        elif item.startswith(("first:", "last:")):
            side, _, count = item.partition(":")
            k = n // 2 if count == "half" else _int(count, what, item)
            if not 0 <= k <= n:
                raise ConfigError(f"{what}: {item!r} asks for {k} of the model's {n} layers")
            chosen.update(range(k) if side == "first" else range(n - k, n))
        else:
            hit = [i for i, m in enumerate(names) if m == item or m.startswith(item + ".")]
            if not hit:
                raise ConfigError(f"{what}: no layer named {item!r}; the model's layers are {list(names)} "
                                  f"(or use head, base, first:K, last:K, first:half)")
            chosen.update(hit)
    return sorted(chosen)


def _int(text: str, what: str, item: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}: {item!r} needs an integer count or 'half'")


def split_layers(names: Sequence[str], spec: str, what: str) -> List[int]:
    """Like :func:`select_layers`, but the selection must leave at least one layer out."""
    chosen = select_layers(names, spec, what)
    if not chosen or len(chosen) == len(names):
        raise ConfigError(f"{what} {spec!r} selects {len(chosen)} of the model's {len(names)} layers "
                          f"{list(names)}; it must select some but not all")
    return chosen


class Part:
    """Some layers of the flat state, as a compact vector (gather) and back (scatter)."""

    def __init__(self, lmap: LayerMap, layers: Sequence[int]):
        self.layers = sorted(int(i) for i in layers)
        self.ranges = lmap.ranges(self.layers)
        self.numel = sum(b - a for a, b in self.ranges)
        self.names = [lmap.names[i] for i in self.layers]

    def gather(self, vec: torch.Tensor) -> torch.Tensor:
        return torch.cat([vec[a:b] for a, b in self.ranges])

    def scatter_(self, vec: torch.Tensor, compact: torch.Tensor) -> torch.Tensor:
        compact = compact.to(vec.device, vec.dtype)
        pos = 0
        for a, b in self.ranges:
            vec[a:b].copy_(compact[pos:pos + b - a])
            pos += b - a
        return vec


# ----------------------------------------------------------------------------- training helpers

def fresh_optimizer(cfg, params: Sequence[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """A new optimiser of the run's kind (--optimizer, momentum, weight decay) over ``params``."""
    params = list(params)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)


@contextlib.contextmanager
def frozen(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Truly freeze ``modules`` for the duration: no gradient (so no optimiser, momentum or
    weight decay touches them) and BatchNorm in evaluation mode (running statistics fixed)."""
    params = [p for m in modules for p in m.parameters()]
    before = [p.requires_grad for p in params]
    norms = [(m, m.training) for mod in modules for m in mod.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for p in params:
        p.requires_grad_(False)
    for m, _ in norms:
        m.eval()
    try:
        yield
    finally:
        for p, r in zip(params, before):
            p.requires_grad_(r)
        for m, was in norms:
            m.train(was)


@dataclass
class PersonalOptions:
    finetune_epochs: int = field(default=4, metadata={
        "help": "epochs a cold-start client (--cold-start-fraction) adapts the final global model with the "
                "method's own local update before it is evaluated (pMixFed App. 10.1: r = 4)"})

    def validate(self):
        if self.finetune_epochs < 0:
            raise ConfigError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")


class PersonalAlgorithm(Algorithm):
    """Helpers every personalised method uses; the hooks stay FedAvg's until overridden."""

    Options = PersonalOptions

    def setup(self):
        self.options = self.options or self.Options()
        self.layer_map = LayerMap(self.model, self.flat, getattr(self.options, "layer_unit", "block"))

    def train_epochs(self, model: nn.Module, ctx: ClientContext, epochs: int, params=None,
                     first_epoch: int = 0, loss_fn: Optional[Callable] = None) -> None:
        """``epochs`` passes of mini-batch steps with a fresh optimiser over ``params`` (default:
        every trainable parameter); epochs are numbered from ``first_epoch`` for the batch order."""
        params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        opt = fresh_optimizer(self.cfg, params, ctx.lr)
        loss_fn = loss_fn or self.loss
        for epoch in range(first_epoch, first_epoch + epochs):
            for x, y in ctx.batches(epoch):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, x, y, ctx)
                loss.backward()
                if self.cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
                opt.step()
                ctx.record(loss, y.shape[0])

    def batched_loss(self, group, x, y, weight):
        """``loss`` (the task loss) for K clients at once (fedhpc.batched), for the methods of this
        family that declare ``batchable``: those whose clients train on it with plain SGD steps
        (FedPer, LG-FedAvg, FedSim, pMixFed), from what their ``download`` loaded, or part of the
        model in phases (FedBABU, FedAlt), and Ditto's global model."""
        return weighted_task_loss(group.forward(x), y, weight)

    def modules_of(self, layers: Sequence[int]) -> List[nn.Module]:
        return [self.layer_map.modules[i] for i in layers]

    def evaluation_context(self, cid: int) -> ClientContext:
        """A training context for client ``cid`` outside a round (fine-tuning for evaluation):
        its data, round index = the evaluated round + 1, so batches never repeat a round's."""
        index = min(self.rounds_done, self.cfg.rounds)
        rnd = RoundInfo(index, [], [], self.cfg.lr * self.cfg.lr_decay ** index)
        client = self.data.client(cid)
        if self.device.type != "cpu":
            from ...data import ClientData
            client = ClientData(client.cid, client.x.to(self.device), client.y.to(self.device),
                                client.x_test, client.y_test)
        return ClientContext(self, cid, client, rnd)

    def personalise_for_evaluation(self, cid: int, tune: Callable[[nn.Module, ClientContext], None]) -> torch.Tensor:
        """Client ``cid``'s evaluated model: the global model tuned by ``tune`` on its training
        data (gradients on, training mode, seeded like a client's round); returns a copy."""
        ctx = self.evaluation_context(cid)
        was_training = self.model.training
        kept = self.kept_model(cid)  # a device that missed the last broadcast tunes the model it kept
        self.flat.load_(self.global_state if kept is None else kept)
        seed_torch(derive_seed(self.cfg.seed, "personalise", ctx.round.index, cid), self.device)
        with torch.enable_grad():
            self.model.train()
            tune(self.model, ctx)
        self.model.train(was_training)
        return self.flat.flat.detach().clone()

    def accuracy(self, state: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accuracy of the flat ``state`` on (x, y) in evaluation mode (no gradient, no
        optimiser, BatchNorm statistics untouched); leaves ``state`` loaded."""
        if y.numel() == 0:
            return float("nan")
        self.flat.load_(state)
        was_training = self.model.training
        self.model.eval()
        correct = 0
        bs = self.cfg.eval_batch_size
        with torch.no_grad():
            for s in range(0, y.shape[0], bs):
                xb = self.data.transform(x[s:s + bs].to(self.device), False, None)
                correct += int((self.model(xb).argmax(-1) == y[s:s + bs].to(self.device)).sum())
        self.model.train(was_training)
        return correct / y.shape[0]


# ----------------------------------------------------------------------------- shared / personal split

class PartialAlgorithm(PersonalAlgorithm):
    """A model split into a shared part (averaged by the server) and a personal part (kept by
    each client in the client-state store, never sent). Subclasses say which layers are
    personal (:meth:`personal_layers`) and how a client trains (:meth:`local_update`).

    The personal part of the *global* state is never aggregated: it keeps the seeded initial
    values, which is what a client that has not trained yet starts from (and what
    ``local_test_accuracy_global_model`` evaluates).
    """

    uses_client_state = True
    global_model_is_partial = True

    def personal_layers(self) -> List[int]:
        raise NotImplementedError

    def setup(self):
        super().setup()
        personal = self.personal_layers()
        shared = [i for i in range(self.layer_map.num_layers) if i not in personal]
        self.personal = Part(self.layer_map, personal)
        self.shared = Part(self.layer_map, shared)

    def upload_spec(self):
        return {"shared": Upload(self.shared.numel, "parameters")}

    def download(self, ctx):
        self.restore_kept_model(ctx)  # a device whose last downlink failed keeps its model
        mine = ctx.load_state()
        if mine is not None:
            self.personal.scatter_(self.flat.flat, mine)
        ctx.ledger.add("down", "parameters", self.shared.numel * self.flat.flat.element_size())

    def upload(self, model, ctx):
        ctx.save_state(self.personal.gather(self.flat.flat))
        return {"shared": self.shared.gather(self.flat.flat)}

    def aggregate(self, global_state, totals, weight_total, rnd):
        if weight_total <= 0:
            return global_state
        new = global_state.to(torch.float64).clone()
        return self.shared.scatter_(new, totals["shared"] / weight_total)

    def client_model(self, cid):
        mine = self.client_state.get_slot(cid, "algo")
        kept = self.kept_model(cid)  # a device that missed the last broadcast holds its own shared part
        if mine is None:
            return kept
        return self.personal.scatter_((self.global_state if kept is None else kept).clone(), mine)

    def personal_modules(self) -> List[nn.Module]:
        return self.modules_of(self.personal.layers)

    def shared_modules(self) -> List[nn.Module]:
        return self.modules_of(self.shared.layers)

    def joint_update(self, model, ctx, epochs: int) -> None:
        """Shared and personal layers trained together (FedSim, FedPer, LG-FedAvg)."""
        self.train_epochs(model, ctx, epochs)

    def adapt(self, model, ctx):
        """A cold-start client: the method's local update for ``finetune_epochs`` from the global
        model (its personal part at the initial values); App. 10.1 trains all layers jointly."""
        self.joint_update(model, ctx, self.options.finetune_epochs)

