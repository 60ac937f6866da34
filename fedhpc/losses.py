"""The task losses that the engine's evaluation, the server trainer and the algorithms share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def task_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for classification (B, C) and next-character prediction (B, T, V)."""
    if logits.dim() > 2:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)
    return F.cross_entropy(logits, y, reduction=reduction)


def soft_loss(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft targets (mixed one-hot labels, teacher outputs)."""
    logp = F.log_softmax(logits, dim=-1)
    return -(target_probs * logp).sum(-1).mean()
