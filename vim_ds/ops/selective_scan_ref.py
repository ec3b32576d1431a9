"""Pure-PyTorch selective scan: the reference every compiled backend is checked against.

Written straight from the recurrence (see ``csrc/README.md``), one time step at a time, so that it is easy to
read and trivially correct; autograd gives its gradients. It is the ``ref`` backend and the slow fallback.

B and C come in mamba_ssm's three forms (each independently):

* input-dependent ``(batch, d_state, seqlen)``: shared by all channels (Vim's form);
* constant ``(dim, d_state)``: one vector per channel, the same at every step (time-invariant, S4-like);
* grouped ``(batch, groups, d_state, seqlen)``: channel d uses group ``d // (dim // groups)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def per_channel(X: torch.Tensor, dim: int) -> torch.Tensor:
    """B or C in any form as a broadcastable (batch or 1, dim or 1, d_state, seqlen or 1) tensor."""
    if X.dim() == 3:  # input-dependent: the same for every channel
        return X.unsqueeze(1)
    if X.dim() == 2:  # constant: per channel, the same at every step
        return X[None, :, :, None]
    groups = X.shape[1]  # grouped: channel d reads group d // (dim // groups)
    return X.repeat_interleave(dim // groups, dim=1)


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
    return_last_state: bool = False,
    *,
    reverse: bool = False,
    h0: Optional[torch.Tensor] = None,
):
    """u, delta, z: (batch, dim, L); A: (dim, N); B, C: (batch, N, L), (dim, N) or (batch, groups, N, L);
    D, delta_bias: (dim,).

    Computes in float32 (float64 for float64 input) and returns the input dtype; with ``return_last_state`` also
    the state after the last step, (batch, dim, N) in that float32 / float64 (as mamba_ssm's reference).
    ``reverse=True`` runs the recurrence from t = L-1 down to 0 (h[L] = 0): the result of flipping u, delta, B, C,
    z along time, scanning, and flipping the output back, with the same operations in the same order; its last
    state is the one after t = 0.

    ``h0`` (batch, dim, N), optional: the state before the first step (h[-1], or h[L] with ``reverse``) instead of
    zero, as when this is one chunk of a longer sequence (``vim_ds/ops/scan_chunks.py``); autograd gives its
    gradient. Left out, the scan starts from zero exactly as before.
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
    if B.dim() == 3:
        drive = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
    else:
        drive = (delta * u).unsqueeze(-1) * per_channel(B, dim).transpose(-1, -2)
    Cc = None if C.dim() == 3 else per_channel(C, dim)  # (batch or 1, dim, N, L or 1)
    if h0 is not None and tuple(h0.shape) != (batch, dim, A.shape[1]):
        raise ValueError(f"selective_scan_ref: h0 must be of shape (batch, dim, d_state) = {(batch, dim, A.shape[1])}, "
                         f"got {tuple(h0.shape)}")
    h = u.new_zeros(batch, dim, A.shape[1]) if h0 is None else h0.to(acc)
    ys = []
    steps = range(L - 1, -1, -1) if reverse else range(L)
    for t in steps:
        h = decay[:, :, t] * h + drive[:, :, t]
        if Cc is None:
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        else:
            ys.append((h * Cc[..., t if Cc.shape[-1] > 1 else 0]).sum(-1))
    if reverse:
        ys.reverse()
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(acc)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(acc))
    y = y.to(in_dtype)
    return (y, h) if return_last_state else y
