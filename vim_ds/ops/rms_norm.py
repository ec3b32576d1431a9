"""RMSNorm, and a Vim block's residual add fused with it: ``add_rms_norm`` (issue 51, item 5).

A block starts with ``stream = residual + hidden`` (the fp32 residual stream plus the previous block's mixer output,
through the block's stochastic depth: a per-sample scale) and normalises the stream for its mixer. ``add_rms_norm``
returns both, ``(normed, stream)``:

- on GPUs (CUDA and ROCm) with Triton, one kernel forward and one backward, registered as
  ``torch.ops.vim_ds.add_rms_norm_fwd`` / ``_bwd`` (``rms_norm_triton.py``): half the traffic of the composition;
- elsewhere, and with ``VIM_DS_NORM=ref``, the composition ``add_rms_norm_ref``: the add, then ``rms_norm`` (torch's
  own fused RMSNorm where it has one), the reference the kernels are tested against.

The stream is fp32 (fp64 for fp64 input) whatever the hidden states' dtype; ``normed`` is in the weight's dtype.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import rms_norm_triton
from .library import NAMESPACE, custom_op

ENV_NORM = "VIM_DS_NORM"  # ref|triton: force the composition or the kernel
NORM_BACKENDS = ("ref", "triton")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Whether torch has a fused RMSNorm kernel (``aten::_fused_rms_norm``, CUDA and ROCm) behind ``F.rms_norm``. Older
# torch (2.4 among the supported) has ``F.rms_norm`` as the formula itself, and its export then fixes the batch size.
TORCH_FUSES_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


def at_least_fp32(t: Tensor) -> Tensor:
    """fp32 for half types, unchanged for fp32/fp64 (the residual stream and norms never run in half precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32 (or wider), returned in the weight's
    dtype. Where torch has it, through ``F.rms_norm``: one fused kernel forward and one backward on GPUs (x and the
    weight then share a dtype, hence the weight's cast); on CPU ``F.rms_norm`` runs the formula's operations: the
    same bits (tests/test_model_reference.py)."""
    x = at_least_fp32(x)
    w = weight.to(x.dtype)
    if TORCH_FUSES_RMS_NORM:
        y = F.rms_norm(x, weight.shape, w, eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return y.to(weight.dtype)


def scaled_by_sample(hidden: Tensor, scale: Optional[Tensor]) -> Tensor:
    """hidden times each sample's scale, as timm's DropPath multiplies by its mask (a (batch, 1, ...) tensor)."""
    return hidden if scale is None else hidden * scale.view((-1,) + (1,) * (hidden.dim() - 1))


def add_rms_norm_ref(hidden: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                     scale: Optional[Tensor] = None):
    """(rms_norm(stream), stream), stream = residual + hidden * scale in fp32 or wider (hidden alone without a
    residual; scale (batch,) or None)."""
    hidden = scaled_by_sample(hidden, scale)
    stream = at_least_fp32(hidden if residual is None else residual + hidden)
    return rms_norm(stream, weight, eps), stream


@torch.compiler.assume_constant_result
def _forced_when_traced() -> Optional[str]:
    """VIM_DS_NORM, read where torch.compile or torch.export traces the model as a constant of the graph (torch
    2.4's dynamo cannot trace os.environ.get of an unset variable; a graph keeps the value it was traced with)."""
    return forced_backend()


def forced_backend(value: Optional[str] = None) -> Optional[str]:
    """The backend VIM_DS_NORM (or `value`) names (None when unset), or a one-line ValueError saying what it
    accepts."""
    value = os.environ.get(ENV_NORM, "") if value is None else value
    if value and value not in NORM_BACKENDS:
        raise ValueError(f"{ENV_NORM}={value}: expected ref (PyTorch's composition) or triton (the fused kernel), "
                         f"or leave it unset")
    return value or None


def describe() -> str:
    """What a block's add and norm run on GPUs here, for `vim-ds env`."""
    try:
        forced = forced_backend()
    except ValueError as exc:
        return f"error: {exc}"
    if forced == "ref":
        return f"PyTorch's add and RMSNorm ({ENV_NORM}=ref)"
    if not rms_norm_triton.available():
        return "PyTorch's add and RMSNorm (triton is not installed: pip install triton, or torch's GPU wheels)"
    return f"one triton {rms_norm_triton.triton.__version__} kernel each way on GPUs (PyTorch's on CPU)"


def _kernel_runs(hidden: Tensor, residual: Optional[Tensor], weight: Tensor, backend: str) -> bool:
    """Whether add_rms_norm takes the Triton kernel: on GPUs with Triton ("auto"; meta tensors too, which trace
    what a GPU runs: `vim-ds bench anatomy`), or where asked ("triton": on CPU tensors only in a process under
    TRITON_INTERPRET=1)."""
    if backend == "auto":
        backend = _forced_when_traced() or "auto"
    if backend == "ref":
        return False
    if backend not in ("auto", "triton"):
        raise ValueError(f"add_rms_norm: backend must be auto, ref or triton, got {backend!r}")
    fits = (rms_norm_triton.available() and hidden.shape[-1] <= rms_norm_triton.MAX_DIM
            and all(t.dtype in _KERNEL_DTYPES for t in (hidden, weight))
            and (residual is None or residual.dtype in _KERNEL_DTYPES))
    if backend == "auto":
        return fits and hidden.device.type in ("cuda", "meta")
    if not fits:
        raise ValueError(f"add_rms_norm: the triton backend needs triton, rows of at most {rms_norm_triton.MAX_DIM} "
                         f"and dtypes among {[str(d) for d in _KERNEL_DTYPES]}")
    if hidden.device.type == "cpu" and not rms_norm_triton.interpreted():
        raise ValueError("add_rms_norm: the triton backend runs on CPU tensors only under TRITON_INTERPRET=1")
    return True


def add_rms_norm(hidden: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, backend: str = "auto",
                 scale: Optional[Tensor] = None):
    """(normed, stream): stream = residual + hidden * scale (hidden alone when residual is None; scale (batch,), a
    sample's stochastic-depth mask over the keep probability, or None) in fp32 or wider, normed = rms_norm(stream) *
    weight in the weight's dtype; differentiable in hidden, residual and weight. ``backend``: "auto" (the kernel on
    GPUs, unless VIM_DS_NORM says otherwise), "ref" or "triton"."""
    if not _kernel_runs(hidden, residual, weight, backend):
        return add_rms_norm_ref(hidden, residual, weight, eps, scale)
    normed, stream, _ = add_rms_norm_fwd(hidden, residual, weight, float(eps),
                                         None if scale is None else scale.reshape(-1))
    return normed, stream


def _stream_dtype(hidden: Tensor, residual: Optional[Tensor]) -> torch.dtype:
    dtype = hidden.dtype if residual is None else torch.promote_types(residual.dtype, hidden.dtype)
    return torch.promote_types(dtype, torch.float32)


@custom_op(f"{NAMESPACE}::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(hidden: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                     scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (normed, stream, rstd): rstd (rows,) the stream's 1 / sqrt(mean(stream^2) + eps), for the backward;
    scale (batch,): each sample's hidden rows times it before the add."""
    return rms_norm_triton.forward(hidden, residual, weight, eps, _stream_dtype(hidden, residual), scale)


@add_rms_norm_fwd.register_fake
def _(hidden, residual, weight, eps, scale=None):
    stream_dtype = _stream_dtype(hidden, residual)
    rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
    return (hidden.new_empty(hidden.shape, dtype=weight.dtype), hidden.new_empty(hidden.shape, dtype=stream_dtype),
            hidden.new_empty((rows,), dtype=stream_dtype))


@custom_op(f"{NAMESPACE}::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd(dnormed: Tensor, dstream: Optional[Tensor], stream: Tensor, weight: Tensor, rstd: Tensor,
                     hidden_dtype: torch.dtype, scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (the stream's gradient (the residual's), the hidden states' (in hidden_dtype, times the sample's scale),
    the weight's). ``dstream``: the gradient the stream gets from downstream, added in (None: none)."""
    return rms_norm_triton.backward(dnormed, dstream, stream, weight, rstd, hidden_dtype, scale)


@add_rms_norm_bwd.register_fake
def _(dnormed, dstream, stream, weight, rstd, hidden_dtype, scale=None):
    return (stream.new_empty(stream.shape), stream.new_empty(stream.shape, dtype=hidden_dtype),
            weight.new_empty(weight.shape))


def _setup_context(ctx, inputs, output):
    hidden, residual, weight, _eps, scale = inputs
    ctx.has_residual = residual is not None
    ctx.hidden_dtype = hidden.dtype
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # an unused output's gradient is None, not a tensor of zeros to read
    ctx.save_for_backward(output[1], weight, output[2], scale)


def _backward(ctx, dnormed, dstream, _drstd):
    stream, weight, rstd, scale = ctx.saved_tensors
    if dnormed is None:
        dnormed = torch.zeros_like(stream, dtype=weight.dtype)
    d_stream, d_hidden, d_weight = add_rms_norm_bwd(dnormed.contiguous(), dstream, stream, weight, rstd,
                                                    ctx.hidden_dtype, scale)
    return d_hidden, d_stream if ctx.has_residual else None, d_weight, None, None


add_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
