"""Plasticity: the similarity-preserving (SP) loss between two activations of one batch.

Egeria (EuroSys '23, §4.2.1, Eq. 1) measures a stage's plasticity as the SP
loss (Tung & Mori, ICCV '19) between the training model's and the reference
model's activations for the same mini-batch; the formula is in Appendix B of
the extended paper::

    Q = A.reshape(b, -1);  G~ = Q Q^T;  G[i, :] = G~[i, :] / ||G~[i, :]||_2
    SP(A_T, A_R) = ||G_T - G_R||_F^2 / b^2

Rows are normalised by the plain L2 norm, as Tung & Mori do (the appendix's
square is a transcription artefact), so a global rescaling changes nothing.
Only the b x b similarity matrices are compared: feature sizes may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from actcache.errors import ConfigError, ConfigTypeError

__all__ = ["sp_loss"]


def _first_tensor(state: torch.Tensor | Sequence[torch.Tensor], name: str) -> torch.Tensor:
    # a stage state such as (hidden, attention_mask): compare the hidden part
    tensor = state[0] if isinstance(state, (tuple, list)) and state else state
    if not isinstance(tensor, torch.Tensor):
        raise ConfigTypeError(f"{name} must be a Tensor or a tuple whose first item is a Tensor, "
                              f"got {type(state).__name__}")
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise ConfigError(f"{name} needs a leading batch dimension of size >= 1, got shape {tuple(tensor.shape)}")
    return tensor


def _similarity(tensor: torch.Tensor) -> torch.Tensor:
    q = tensor.reshape(tensor.shape[0], -1).to(torch.float64)
    return F.normalize(q @ q.T, p=2.0, dim=1)


def sp_loss(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """SP loss of activations ``a`` and ``b`` of shape (batch, ...); 0.0 when they match.

    Tuple stage states contribute their first tensor; computed in float64 on ``a``'s device without
    gradients; an all-zero activation gets a zero similarity row.

    Args:
        a: Activations (or a stage state) of one model.
        b: The same batch's activations of the other model.
    """
    ta = _first_tensor(a, "a")
    tb = _first_tensor(b, "b")
    if ta.shape[0] != tb.shape[0]:
        raise ConfigError(f"a and b must come from the same batch: batch sizes {ta.shape[0]} and {tb.shape[0]} "
                          "differ")
    with torch.no_grad():
        ga = _similarity(ta.detach())
        gb = _similarity(tb.detach().to(ga.device))
        batch = ta.shape[0]
        return float(((ga - gb) ** 2).sum() / (batch * batch))
