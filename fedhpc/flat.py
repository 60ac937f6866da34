"""One flat buffer behind all of a model's parameters and float buffers.

The engine trains every client of a rank on one model instance. Re-pointing each
parameter (and float buffer, e.g. BatchNorm statistics) at a slice of a single
contiguous tensor makes "load the global model" one ``copy_`` and "add this
client's weights to the round's sum" one ``add_``, with no per-client copy of the
model and no per-tensor Python loop on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch
from torch import nn

from .errors import ConfigError


@dataclass(frozen=True)
class FlatEntry:
    name: str
    shape: torch.Size
    offset: int
    numel: int
    is_param: bool


class FlatModel:
    """The model's parameters and float buffers in one flat tensor (see the module docstring).

    Integer buffers (BatchNorm's ``num_batches_tracked``) stay outside: they are not federated
    (nothing averages a step counter), and each rank's model instance counts the batches of
    whatever clients it trained. No fedhpc model reads them (only BatchNorm with
    ``momentum=None`` would: the engine refuses it, :func:`refuse_cumulative_batchnorm`), and
    the state dicts written
    from a flat state (``final_model.pt``, saved client models) hold their initial values, so
    those files are the same on any number of ranks and after a resume.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        #: integer buffers as built: what state dicts written from a flat state hold
        self.initial_integer_buffers = {n: b.detach().clone().cpu() for n, b in model.named_buffers()
                                        if not b.is_floating_point()}
        tensors = [(n, p, True) for n, p in model.named_parameters()]
        tensors += [(n, b, False) for n, b in model.named_buffers() if b.is_floating_point()]
        dtypes = {t.dtype for _, t, _ in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"FlatModel needs one floating dtype, model has {dtypes}")
        total = sum(t.numel() for _, t, _ in tensors)
        device = tensors[0][1].device
        self.flat = torch.empty(total, dtype=tensors[0][1].dtype, device=device)
        self.entries: List[FlatEntry] = []
        offset = 0
        for name, t, is_param in tensors:
            n = t.numel()
            view = self.flat[offset: offset + n].view_as(t)
            view.copy_(t.detach())
            if is_param:
                t.data = view
            else:
                mod_name, _, buf = name.rpartition(".")
                model.get_submodule(mod_name)._buffers[buf] = view
            self.entries.append(FlatEntry(name, t.shape, offset, n, is_param))
            offset += n
        self.numel = total
        #: parameters come first: they are flat[:num_params], buffers (BN statistics) the rest
        self.num_params = sum(e.numel for e in self.entries if e.is_param)

    def load_(self, vector: torch.Tensor) -> None:
        """Overwrite the model's weights with ``vector`` (a flat state)."""
        self.flat.copy_(vector)

    def views(self, vector: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Name -> tensor views into any flat vector laid out like this model."""
        return {e.name: vector[e.offset: e.offset + e.numel].view(e.shape) for e in self.entries}

    def param_views(self, vector: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``vector`` aligned with ``model.parameters()``."""
        return [vector[e.offset: e.offset + e.numel].view(e.shape) for e in self.entries if e.is_param]

    def mask(self, names) -> torch.Tensor:
        """Boolean mask over the flat vector selecting the entries whose name starts with any of ``names``."""
        m = torch.zeros(self.numel, dtype=torch.bool, device=self.flat.device)
        for e in self.entries:
            if any(e.name == n or e.name.startswith(n + ".") for n in names):
                m[e.offset: e.offset + e.numel] = True
        return m

    def state_dict_from(self, vector: torch.Tensor) -> Dict[str, torch.Tensor]:
        """A regular state dict (what final_model.pt holds) for a flat vector; integer buffers
        at their initial values (see the class)."""
        sd = {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}
        for name, view in self.views(vector).items():
            sd[name] = view.detach().clone().cpu()
        for name, value in self.initial_integer_buffers.items():
            sd[name] = value.clone()
        return sd


def refuse_cumulative_batchnorm(model: nn.Module) -> None:
    """BatchNorm with ``momentum=None`` weights each update by 1 / its own step counter, an
    integer buffer that is not federated: every rank's model instance counts the batches of
    the clients it trained, so the running statistics would depend on the ranks. (The server
    trainer alone counts the same steps on every rank, so it accepts such a model.)"""
    cumulative = [n or type(model).__name__ for n, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._NormBase) and m.momentum is None]
    if cumulative:
        raise ConfigError(f"BatchNorm with momentum=None ({', '.join(cumulative)}) averages its running "
                          f"statistics over its own step counter, which each rank's model instance counts "
                          f"for whatever clients it trained: results would depend on the ranks. Give it a "
                          f"momentum (torch's default is 0.1)")
