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

from .library import _weight_grad, _wide, bimamba_branch_fwd, causal_conv1d, project, ssm_branch_fwd

__all__ = ["bimamba_branch_fn", "branch_inputs", "conv1d_silu", "in_projection", "out_projection", "project",
           "ssm_branch_fn"]


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


class _InProjection(torch.autograd.Function):
    """x, z = W_x @ hidden^T, W_z @ hidden^T, in the scan's (batch, channels, L) layout without a transposed copy of
    hidden. Backward, the input's gradient is dx^T W_x + dz^T W_z: one GEMM, then one that adds into it, written in
    hidden's own (batch, L, d_model) layout. Autograd's own would be two GEMMs in the transposed layout, their sum and
    a transposing copy for the norm's backward: 3 extra passes over a (batch, d_model, L) tensor a block.

    Under autocast the products run in autocast's dtype, the one x and z come in, and so do the backward's; the
    gradients are returned in the inputs' dtypes (as autograd through autocast's casts would)."""

    @staticmethod
    def compute(hidden, w_x, w_z):
        hidden_t = hidden.transpose(1, 2)
        return project(w_x, hidden_t), project(w_z, hidden_t)

    @staticmethod
    def forward(ctx, hidden, w_x, w_z):
        x, z = _InProjection.compute(hidden, w_x, w_z)
        ctx.save_for_backward(hidden, w_x, w_z)
        ctx.dtype = x.dtype
        return x, z

    @staticmethod
    def backward(ctx, dx, dz):
        hidden, w_x, w_z = ctx.saved_tensors
        h = hidden.to(ctx.dtype)
        batch = h.shape[0]
        dhidden, dw = None, []
        for dy, w in ((dx, w_x), (dz, w_z)):
            if dy is None:
                dw.append(torch.zeros_like(w))
                continue
            w_t = w.to(ctx.dtype).expand(batch, -1, -1)
            dhidden = (torch.bmm(dy.transpose(1, 2), w_t) if dhidden is None
                       else torch.baddbmm(dhidden, dy.transpose(1, 2), w_t))
            dw.append(_weight_grad(dy, h.transpose(1, 2)).to(w.dtype))
        dhidden = torch.zeros_like(hidden) if dhidden is None else dhidden.to(hidden.dtype)
        return dhidden, dw[0], dw[1]


class _OutProjection(torch.autograd.Function):
    """out = y^T W^T (batch, L, d_model), written in that layout, from y (batch, d_inner, L): what the residual add
    reads row by row (project(W, y).transpose(1, 2) would be a transposed view, to be copied or read across rows).
    Backward, dy = W^T dout^T comes back in y's (batch, d_inner, L) layout, as the scan's backward reads it. Autocast
    as in _InProjection."""

    @staticmethod
    def compute(y, w):
        return torch.bmm(y.transpose(1, 2), w.t().expand(y.shape[0], -1, -1))

    @staticmethod
    def forward(ctx, y, w):
        out = _OutProjection.compute(y, w)
        ctx.save_for_backward(y, w)
        ctx.dtype = out.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        dout_t = dout.transpose(1, 2)  # (batch, d_model, L)
        dy = project(w.to(ctx.dtype).t(), dout_t)
        return dy.to(y.dtype), _weight_grad(dout_t, y.to(ctx.dtype)).to(w.dtype)


def out_projection(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(batch, L, d_model) from y (batch, d_inner, L) and out_proj's weight (d_model, d_inner), in that layout (see
    _OutProjection)."""
    if torch.jit.is_tracing():  # a traced module saves only ops: the forward's, as ops (inference)
        return _OutProjection.compute(y, w)
    return _OutProjection.apply(y, w)


def in_projection(hidden: torch.Tensor, w_x: torch.Tensor, w_z: torch.Tensor):
    """(x, z), each (batch, d_inner, L), from hidden (batch, L, d_model) and in_proj's two halves (d_inner, d_model):
    a Mamba mixer's input projection in the scan's layout (see _InProjection)."""
    if torch.jit.is_tracing():  # a traced module saves only ops: the forward's, as ops (inference)
        return _InProjection.compute(hidden, w_x, w_z)
    return _InProjection.apply(hidden, w_x, w_z)


def _branch_weights(fn: str, x, z, weights):
    """The weights (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias) as the branch ops take
    them, A, D and delta_bias in fp32 (fp64 for fp64 input), after checking x and z (one line naming `fn`)."""
    if x.dim() != 3 or z.shape != x.shape:
        raise ValueError(f"{fn}: x and z must both be (batch, d_inner, seqlen), got shapes "
                         f"{tuple(x.shape)} and {tuple(z.shape)}")
    wide = _wide(x.dtype)
    *rest, A, D, delta_bias = weights
    return (*rest, A.to(wide), D.to(wide), delta_bias.to(wide))


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
    weights = _branch_weights("ssm_branch_fn", x, z, (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D,
                                                      delta_bias))
    out, _ = ssm_branch_fwd(x, z.contiguous(), *weights, bool(reverse), "auto")
    return out


def bimamba_branch_fn(x: torch.Tensor, z: torch.Tensor, forward_weights, backward_weights) -> torch.Tensor:
    """ssm_branch_fn(x, z, *forward_weights) + ssm_branch_fn(x, z, *backward_weights, reverse=True), as one op
    (``torch.ops.vim_ds.bimamba_branch_fwd``): a Vim mixer's two directions. On GPUs the second direction's scan
    adds its output into the first's in its store, and backward its conv's dx into the first's: two of the three
    (batch, d_inner, L) sums need no passes of their own (dz's is one add). Each weights tuple: (conv_weight,
    conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias), as ssm_branch_fn takes them."""
    forward = _branch_weights("bimamba_branch_fn", x, z, forward_weights)
    backward = _branch_weights("bimamba_branch_fn", x, z, backward_weights)
    out, _, _ = bimamba_branch_fwd(x, z.contiguous(), *forward, *backward, "auto")
    return out
