"""The fused SSM branch of a Mamba mixer: causal conv1d + SiLU -> x_proj -> dt_proj -> selective scan -> SiLU(z) gate.

This is how the model calls the scan on every backend, through the registered op
``torch.ops.vim_ds.ssm_branch_fwd`` (see ``library.py``). Only the branch inputs ``x``, ``z`` and the weights are
kept for backward; the cheap intermediates (conv output, projections: several times the size of ``x``) are
recomputed there, which is what keeps Vim's activation memory close to a transformer's of the same width.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .library import causal_conv1d, project, ssm_branch_fwd

__all__ = ["branch_inputs", "conv1d_silu", "project", "ssm_branch_fn"]


def _backend_name(backend) -> str:
    return "auto" if backend is None else backend if isinstance(backend, str) else backend.name


def conv1d_silu(x, weight, bias, backend=None, reverse=False):
    """u = silu(causal depthwise conv1d(x)): x (batch, d, L), weight (d, 1, K), bias (d,) or None; differentiable.

    The CPU kernel when `backend` is the `cpu` backend (or "auto" picks it), else PyTorch's conv (cuDNN/MIOpen on
    GPUs); `backend=None` means PyTorch's conv. ``reverse``: the conv of the time-reversed sequence, in the
    original order (anti-causal, reads the K-1 *next* steps), i.e. ``flip(conv(flip(x)))`` without the copies.
    """
    name = "ref" if backend is None else _backend_name(backend)
    return F.silu(causal_conv1d(x, weight, bias, bool(reverse), name))


def branch_inputs(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, d_state, backend=None, reverse=False):
    """From x (batch, d_inner, L), the first half of in_proj's output, to the scan's u, delta, B, C (contiguous),
    differentiably (the unfused composition, for tests and reading; the fused op computes the same).

    Everything stays in the (batch, channels, L) layout the scan wants: projections are W @ u, not linear layers
    over transposed copies.
    """
    dt_rank = dt_proj_weight.shape[1]
    u = conv1d_silu(x, conv_weight, conv_bias, backend, reverse)
    x_dbl = project(x_proj_weight, u)  # (batch, dt_rank + 2 * d_state, L)
    delta = project(dt_proj_weight, x_dbl[:, :dt_rank])  # dt_proj's bias is added inside the scan
    B = x_dbl[:, dt_rank:dt_rank + d_state]
    C = x_dbl[:, dt_rank + d_state:]
    return u.contiguous(), delta.contiguous(), B.contiguous(), C.contiguous()


def ssm_branch_fn(
    x: torch.Tensor,
    z: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    delta_bias: torch.Tensor,
    *,
    reverse: bool = False,
) -> torch.Tensor:
    """Gated SSM output (batch, d_inner, L) from the two halves of in_proj's output, x and z (batch, d_inner, L).

    A, D and delta_bias are used in fp32 (fp64 for fp64 input). x and z come separately (not as one xz tensor as
    in mamba_ssm) so that their gradients need no concatenation.

    ``reverse=True`` runs the whole branch back to front (anti-causal conv, reversed scan): the result of flipping x
    and z along time and the output back, without the copies. Vim's backward direction uses it.
    """
    if x.dim() != 3 or z.shape != x.shape:
        raise ValueError(f"ssm_branch_fn: x and z must both be (batch, d_inner, seqlen), got shapes "
                         f"{tuple(x.shape)} and {tuple(z.shape)}")
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    out, _ = ssm_branch_fwd(x, z.contiguous(), conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A.to(wide),
                            D.to(wide), delta_bias.to(wide), bool(reverse), "auto")
    return out
