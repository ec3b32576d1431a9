"""The fused SSM branch of a Mamba mixer: causal conv1d + SiLU -> x_proj -> dt_proj -> selective scan -> SiLU(z) gate.

This is how the model calls the scan on every backend. Only the branch input ``xz`` and the weights are kept for
backward; the cheap intermediates (conv output, projections: several times the size of ``xz``) are recomputed there,
which is what keeps Vim's activation memory close to a transformer's of the same width.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .backends import get_backend


def branch_inputs(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, d_state):
    """From xz (batch, 2*d_inner, L) to the scan's u, delta, B, C, z (all contiguous, dtype of xz)."""
    seqlen = xz.shape[-1]
    d_inner = xz.shape[1] // 2
    dt_rank = dt_proj_weight.shape[1]
    x, z = xz.chunk(2, dim=1)
    # Causal depthwise conv: pad k-1 on both sides, keep the first L outputs (each sees only the past).
    x = F.conv1d(x, conv_weight, conv_bias, padding=conv_weight.shape[-1] - 1, groups=d_inner)[..., :seqlen]
    u = F.silu(x).contiguous()
    x_dbl = F.linear(u.transpose(1, 2), x_proj_weight)  # (batch, L, dt_rank + 2 * d_state)
    dt, B, C = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    delta = F.linear(dt, dt_proj_weight).transpose(1, 2).contiguous()  # dt_proj bias is added inside the scan
    return u, delta, B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), z.contiguous()


class SSMBranchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, backend):
        u, delta, B, C, z = branch_inputs(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A.shape[1])
        out, saved = backend.fwd(u, delta, A, B, C, D, z, delta_bias, True)
        ctx.backend = backend
        ctx.has_conv_bias = conv_bias is not None
        ctx.has_saved = saved is not None
        tensors = [xz, conv_weight, x_proj_weight, dt_proj_weight, A, D, delta_bias]
        tensors += [conv_bias] if conv_bias is not None else []
        tensors += [saved] if saved is not None else []
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, dout):
        xz, conv_weight, x_proj_weight, dt_proj_weight, A, D, delta_bias, *rest = ctx.saved_tensors
        conv_bias = rest.pop(0) if ctx.has_conv_bias else None
        saved = rest.pop(0) if ctx.has_saved else None
        leaves = [t.detach().requires_grad_(True) if t is not None else None
                  for t in (xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight)]
        with torch.enable_grad():
            u, delta, B, C, z = branch_inputs(*leaves, A.shape[1])
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = ctx.backend.bwd(
            u.detach(), delta.detach(), A, B.detach(), C.detach(), D, z.detach(), delta_bias,
            dout.contiguous(), saved, True)
        # Chain the scan's input gradients through the recomputed conv and projections.
        torch.autograd.backward([u, delta, B, C, z], [du, ddelta, dB, dC, dz])
        dxz, dconv_w, dconv_b, dxproj_w, ddtproj_w = (t.grad if t is not None else None for t in leaves)
        return dxz, dconv_w, dconv_b, dxproj_w, ddtproj_w, dA, dD, ddelta_bias, None


def ssm_branch_fn(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    delta_bias: torch.Tensor,
) -> torch.Tensor:
    """Gated SSM output (batch, d_inner, L) for xz (batch, 2*d_inner, L); A, D, delta_bias in fp32 (fp64)."""
    if xz.dim() != 3 or xz.shape[1] % 2:
        raise ValueError(f"ssm_branch_fn: xz must be (batch, 2*d_inner, seqlen), got shape {tuple(xz.shape)}")
    wide = torch.float64 if xz.dtype == torch.float64 else torch.float32
    return SSMBranchFn.apply(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                             A.to(wide), D.to(wide), delta_bias.to(wide), get_backend(xz.device))
