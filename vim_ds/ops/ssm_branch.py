"""The fused SSM branch of a Mamba mixer: causal conv1d + SiLU -> x_proj -> dt_proj -> selective scan -> SiLU(z) gate.

This is how the model calls the scan on every backend. Only the branch inputs ``x``, ``z`` and the weights are kept
for backward; the cheap intermediates (conv output, projections: several times the size of ``x``) are recomputed
there, which is what keeps Vim's activation memory close to a transformer's of the same width.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .backends import get_backend


class CausalConv1dCpuFn(torch.autograd.Function):
    """Depthwise causal conv1d with the CPU kernel (csrc/causal_conv1d_cpu.cpp), forward and backward.

    The generic depthwise F.conv1d is slow on CPU for Mamba's kernel size 4, and so is its backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, module, reverse=False):
        ctx.module, ctx.reverse = module, reverse
        ctx.save_for_backward(x, weight, bias)
        return module.conv_fwd(x, weight, bias, reverse)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = ctx.module.conv_bwd(x, weight, bias, dout.contiguous(), ctx.reverse)
        return dx, dweight, dbias, None, None


def conv1d_silu(x, weight, bias, backend=None, reverse=False):
    """u = silu(causal depthwise conv1d(x)): x (batch, d, L), weight (d, 1, K), bias (d,) or None.

    The CPU kernel when the scan runs on the `cpu` backend, else PyTorch's conv (cuDNN/MIOpen on GPUs).
    ``reverse``: the conv of the time-reversed sequence, in the original order (anti-causal, reads the K-1 *next*
    steps), i.e. ``flip(conv(flip(x)))`` without the copies.
    """
    if getattr(backend, "name", None) == "cpu" and x.dtype in (torch.float32, torch.float64, torch.bfloat16):
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        k = weight.shape[-1]
        if x.stride(-1) != 1 or x.stride(1) != x.shape[-1]:  # the kernel reads whole rows
            x = x.contiguous()
        return F.silu(CausalConv1dCpuFn.apply(x, weight.reshape(-1, k).to(wide),
                                              None if bias is None else bias.to(wide), backend.module,
                                              bool(reverse)))
    seqlen, k = x.shape[-1], weight.shape[-1]
    if reverse:  # y[t] = sum_j w[j] x[t + K-1 - j]: the flipped taps over a window starting at t
        y = F.conv1d(x, weight.flip(-1), bias, padding=k - 1, groups=x.shape[1])[..., k - 1:]
    else:
        y = F.conv1d(x, weight, bias, padding=k - 1, groups=x.shape[1])[..., :seqlen]
    return F.silu(y)


def project(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight (out, in) @ x (batch, in, L) -> (batch, out, L): a linear layer in the channels-first layout.

    bmm over a stride-0 expanded weight: torch.matmul would first copy x into an (in, batch, L) layout.
    """
    return torch.bmm(weight.expand(x.shape[0], -1, -1), x)


def branch_inputs(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, d_state, backend=None, reverse=False):
    """From x (batch, d_inner, L), the first half of in_proj's output, to the scan's u, delta, B, C (contiguous).

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


class SSMBranchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, backend,
                reverse=False):
        u, delta, B, C = branch_inputs(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A.shape[1], backend,
                                       reverse)
        out, saved = backend.fwd(u, delta, A, B, C, D, z, delta_bias, True, reverse)
        ctx.backend, ctx.reverse = backend, reverse
        # backward runs outside the caller's autocast region; the recompute must see the same casts as forward
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.has_conv_bias = conv_bias is not None
        ctx.has_saved = saved is not None
        tensors = [x, z, conv_weight, x_proj_weight, dt_proj_weight, A, D, delta_bias]
        tensors += [conv_bias] if conv_bias is not None else []
        tensors += [saved] if saved is not None else []
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, z, conv_weight, x_proj_weight, dt_proj_weight, A, D, delta_bias, *rest = ctx.saved_tensors
        conv_bias = rest.pop(0) if ctx.has_conv_bias else None
        saved = rest.pop(0) if ctx.has_saved else None
        leaves = [t.detach().requires_grad_(True) if t is not None else None
                  for t in (x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight)]
        device, autocast_on, autocast_dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
            u, delta, B, C = branch_inputs(*leaves, A.shape[1], ctx.backend, ctx.reverse)
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = ctx.backend.bwd(
            u.detach(), delta.detach(), A, B.detach(), C.detach(), D, z, delta_bias, dout.contiguous(), saved, True,
            ctx.reverse)
        # Chain the scan's input gradients through the recomputed conv and projections.
        torch.autograd.backward([u, delta, B, C], [du, ddelta, dB, dC])
        dx, dconv_w, dconv_b, dxproj_w, ddtproj_w = (t.grad if t is not None else None for t in leaves)
        return dx, dz, dconv_w, dconv_b, dxproj_w, ddtproj_w, dA, dD, ddelta_bias, None, None


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
    return SSMBranchFn.apply(x, z.contiguous(), conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                             A.to(wide), D.to(wide), delta_bias.to(wide), get_backend(x.device), bool(reverse))
