"""Pure-PyTorch selective scan: the reference every compiled backend is checked against.

Written straight from the recurrence (see ``csrc/README.md``), one time step at a time, so that it is easy to
read and trivially correct; autograd gives its gradients. It is the ``ref`` backend and the slow fallback.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    reverse: bool = False,
) -> torch.Tensor:
    """u, delta, z: (batch, dim, L); A: (dim, N); B, C: (batch, N, L); D, delta_bias: (dim,).

    Computes in float32 (float64 for float64 input) and returns the input dtype. ``reverse=True`` runs the
    recurrence from t = L-1 down to 0 (h[L] = 0): the result of flipping u, delta, B, C, z along time, scanning,
    and flipping the output back, with the same operations in the same order.
    """
    in_dtype = u.dtype
    acc = torch.float64 if in_dtype == torch.float64 else torch.float32
    u, delta, B, C = u.to(acc), delta.to(acc), B.to(acc), C.to(acc)
    A = A.to(acc)
    if delta_bias is not None:
        delta = delta + delta_bias.to(acc)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, L = u.shape
    # decay[b, d, t, n] = exp(delta[b, d, t] * A[d, n]); drive[b, d, t, n] = delta * B[b, n, t] * u
    decay = torch.exp(delta.unsqueeze(-1) * A[None, :, None, :])
    drive = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
    h = u.new_zeros(batch, dim, A.shape[1])
    ys = []
    steps = range(L - 1, -1, -1) if reverse else range(L)
    for t in steps:
        h = decay[:, :, t] * h + drive[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    if reverse:
        ys.reverse()
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(acc)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(in_dtype)
