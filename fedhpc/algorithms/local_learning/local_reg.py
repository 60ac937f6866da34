"""Shared pieces of the FedAlign family (Mendieta et al., CVPR 2022, "Local Learning Matters").

The study trains FedAvg with local-learning regularisers (Mixup, StochDepth,
GradAug), compares them with FL methods (FedProx, MOON) and proposes FedAlign.
What more than one of them needs lives here:

* :class:`LocalRegOptions` / :class:`LocalRegAlgorithm`: the family's base (the client
  models the Hessian analysis reads are saved by the engine's ``--save-client-models``,
  for every method, FedAvg and FedProx included);
* :func:`require_resnet`: the check that a model has the hooks a method needs
  (slimmable last block, width-sliced forward, residual blocks, projection head);
* FedAlign's Lipschitz estimate: :func:`transmitting_matrix` (Eqs. 6-7) and
  :func:`top_singular_value` (power iteration), :func:`lipschitz_loss` (L_Lip of Eq. 5);
* GradAug's draws: :func:`draw_widths` and :func:`resize` (random resolution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ..base import Algorithm


# --------------------------------------------------------------------------- the family's base

@dataclass
class LocalRegOptions:
    """The family's options base (each method adds its own). Saving client models for the
    Hessian analysis is the engine's ``--save-client-models``, open to every method."""

    def validate(self):
        pass


class LocalRegAlgorithm(Algorithm):
    """FedAvg plus a local regulariser; subclasses override ``loss`` (or ``local_update``)."""

    Options = LocalRegOptions
    #: the kind of network ``--model auto`` must give this method (:mod:`fedhpc.config.auto`):
    #: ``"residual"`` (FedAlign, MOON, StochDepth, GradAug need :class:`fedhpc.models.resnet.ResNet`'s
    #: hooks) takes the dataset's residual model (digits: ``resnet_digits``, mnist5k: ``resnet_mnist``) where its
    #: default has none; '' (Mixup) keeps the dataset's default
    auto_model_kind = ""
    #: model options ``--model auto`` adds to that network where the run gives none (MOON's head)
    auto_model_options: dict = {}

    def setup(self):
        self.options = self.options or self.Options()

    @classmethod
    def configure_model(cls, model: nn.Module, options) -> None:
        """Set up the model the way this method trains and evaluates it (StochDepth: keep
        probabilities). The Hessian analysis calls it, so it measures the network the run
        evaluated; the algorithm calls it when training starts."""


def require_resnet(algo: Algorithm, *hooks: str) -> None:
    """Refuse a model without the hooks the method ``algo`` needs, naming the models that have them."""
    missing = [h for h in hooks if not hasattr(algo.model, h)]
    if missing:
        raise ConfigError(
            f"{algo.cfg.algo} needs a residual model with {', '.join(missing)}; the run's model "
            f"{algo.model_named} has not: pass --model resnet56 or resnet18, or resnet_digits for the digits data")


# --------------------------------------------------------------------------- FedAlign's Lipschitz estimate

def transmitting_matrix(f_in: torch.Tensor, f_out: torch.Tensor) -> torch.Tensor:
    """X = f_{L-1}^T f_L per sample (FedAlign Eqs. 6-7, after Shang et al.'s LONDON).

    ``f_in`` (B, C1, H1, W1), ``f_out`` (B, C2, H2, W2). The paper writes only the
    product; the authors' code (followed here) first average-pools ``f_in`` to the
    spatial size of ``f_out`` when it is larger (the last stage halves it), flattens
    both over space and divides by the number of positions:
    X[b] = f_in[b] (C1 x HW) @ f_out[b]^T (HW x C2) / HW, shape (B, C1, C2).
    """
    if f_in.shape[2:] != f_out.shape[2:]:
        f_in = F.adaptive_avg_pool2d(f_in, f_out.shape[2:])
    b, hw = f_in.shape[0], f_out.shape[2] * f_out.shape[3]
    return torch.bmm(f_in.reshape(b, f_in.shape[1], hw), f_out.reshape(b, f_out.shape[1], hw).transpose(1, 2)) / hw


def top_singular_value(x: torch.Tensor, iters: int = 10) -> torch.Tensor:
    """sigma_max of every matrix of the batch ``x`` (B, m, n) by power iteration: shape (B,).

    The spectral norm K = ||X||_SN of FedAlign (Sec. 4: "approximated using the Power
    Iteration method"). ``iters`` steps of v <- A v / ||A v|| on A = X X^T started from
    the unit all-ones vector 1 / sqrt(m), then sigma = sqrt(||A v_prev||), differentiable
    through every step. A v is taken as X (X^T v), never forming A (2 m n multiply-adds
    a step instead of m^2 n once: 0.7 M against 4.4 M per sample on ResNet-56's
    128 x 256 teacher matrix). The ones start suits transmitting matrices (non-negative
    after ReLU, so the top singular vector is non-negative too). Since every v_prev is
    a unit vector, ||A v_prev|| <= sigma_max(A) = sigma^2 at every step, and for a
    symmetric A it never decreases from one step to the next: the result approaches
    ``torch.linalg.svdvals(x)[:, 0]`` from below as ``iters`` grows.

    The authors' code starts from the unnormalised all-ones vector. From the second
    step on the two agree to float rounding (v is normalised after the first step
    either way), but with ``iters = 1`` theirs returns sqrt(||X X^T 1||), m^(1/4) times
    the value here and above sigma_max (3.4x on ResNet-56's 128-row teacher matrix,
    2.4x on the 32-row sliced student one, so K_F and K_S would carry different biases).
    """
    v = torch.full((x.shape[0], x.shape[1], 1), x.shape[1] ** -0.5, dtype=x.dtype, device=x.device)
    xt = x.transpose(1, 2)
    norm = None
    for _ in range(max(1, iters)):
        m = torch.bmm(x, torch.bmm(xt, v))
        norm = m.norm(dim=1, keepdim=True).clamp_min(1e-30)  # all-zero features: sigma ~0, no NaN
        v = m / norm
    return norm.reshape(-1).sqrt()


def lipschitz_loss(k_student: torch.Tensor, k_teacher: torch.Tensor) -> torch.Tensor:
    """L_Lip(K_S, K_F) of Eq. 5: the mean squared error between the two per-sample vectors."""
    return F.mse_loss(k_student, k_teacher)


# --------------------------------------------------------------------------- GradAug's draws

def draw_widths(gen: torch.Generator, n: int, lower: float, sandwich: bool = False) -> List[float]:
    """n sub-network widths, largest first (the order does not change the loss).

    Paper (FedAlign Sec. 3.1 on GradAug): each omega_i ~ U(omega^b, 1). ``sandwich``:
    the GradAug code's rule, the first sub-network at the lower bound and n-1 draws.
    Stream rule (references rely on it): ``torch.rand(n, generator=gen)`` per batch,
    scaled to [lower, 1); with ``sandwich`` the first draw is replaced by ``lower``.
    """
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    widths = [lower + (1.0 - lower) * float(v) for v in u]
    if sandwich:
        widths[0] = lower
    return sorted(widths, reverse=True)


def draw_scales(gen: torch.Generator, n: int, scales: Sequence[float]) -> List[float]:
    """One resolution scale per sub-network: ``torch.randint(len(scales), (n,), generator=gen)``."""
    idx = torch.randint(len(scales), (n,), generator=gen)
    return [float(scales[int(i)]) for i in idx]


def resize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """GradAug's random-resolution transform T: bilinear resize of the batch to round(scale * H, W)."""
    if scale == 1.0:
        return x
    size: Tuple[int, int] = (max(1, round(scale * x.shape[2])), max(1, round(scale * x.shape[3])))
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def parse_scales(text: str) -> List[float]:
    try:
        scales = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        scales = []
    if not scales or not all(0 < s <= 1 for s in scales):
        raise ConfigError(f"--scales takes comma-separated resolution scales in (0, 1], e.g. "
                          f"'1,0.875,0.75,0.625'; got {text!r}")
    return scales
