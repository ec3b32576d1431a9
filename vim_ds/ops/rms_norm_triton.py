"""The residual add and RMSNorm of a Vim block in one Triton kernel, forward and backward (issue 51, item 5).

Forward, one program a row of the (rows, dim) stream:

    stream = residual + hidden * scale    (in the accumulation type: fp32, fp64 for fp64; scale: the sample's
                                           stochastic-depth mask / keep probability, when given)
    rstd   = 1 / sqrt(mean(stream^2) + eps)
    normed = stream * rstd * weight       (stored in normed's dtype: the weight's)

Backward, each program a run of consecutive rows, for dnormed (and the stream's own gradient from downstream):

    xhat = stream * rstd,  g = weight * dnormed,  c = sum(xhat * g) / dim
    dstream = (g - xhat * c) * rstd + dstream_downstream     -> d residual (wide); d hidden = dstream * scale
                                                                (hidden's dtype)
    dweight = sum over rows of dnormed * xhat                -> one partial row a program, summed after in order

What PyTorch runs for the same (the add, the fused RMSNorm, the cast to the weight's dtype; backward the cast's, the
norm's and the gradients' sum and cast; the mask's multiply each way) moves 24 bytes an element forward and 36
backward in a bf16 step with an fp32 stream, 4 more each way with stochastic depth; these kernels move 12 and 16.
No atomics: every run gives the same bits on the same GPU (the backward's program count follows its multiprocessor
count).

Under TRITON_INTERPRET=1 the same functions run on CPU tensors in Triton's interpreter, which is how the tests check
them against the float64 reference without a GPU (tests/test_rms_norm.py).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch without it (CPU-only wheels; torch's CUDA wheels bring it, its ROCm wheels
    # pytorch-triton-rocm, else pip install triton): PyTorch's composition runs instead
    triton = tl = None

MAX_DIM = 16384  # a row is one block of registers


def available() -> bool:
    return triton is not None


if triton is not None:
    def _fwd(HIDDEN, RESIDUAL, SCALE, WEIGHT, NORMED, STREAM, RSTD, dim, rows_a_sample, s_hidden, s_residual,
             s_normed, s_stream, EPS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
             BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        x = tl.load(HIDDEN + row * s_hidden + cols, mask=inside, other=0.0).to(ACC)
        if HAS_SCALE:  # stochastic depth: the sample's mask / keep probability
            x = x * tl.load(SCALE + row // rows_a_sample).to(ACC)
        if HAS_RESIDUAL:
            x = tl.load(RESIDUAL + row * s_residual + cols, mask=inside, other=0.0).to(ACC) + x
        tl.store(STREAM + row * s_stream + cols, x, mask=inside)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + EPS)
        tl.store(RSTD + row, rstd)
        w = tl.load(WEIGHT + cols, mask=inside, other=0.0).to(ACC)
        tl.store(NORMED + row * s_normed + cols, (x * rstd * w).to(NORMED.dtype.element_ty), mask=inside)

    def _bwd(DNORMED, DSTREAM_IN, STREAM, WEIGHT, RSTD, SCALE, DSTREAM, DHIDDEN, DWEIGHT_PART, rows, dim, rows_each,
             rows_a_sample, s_dnormed, s_dstream_in, s_stream, s_dstream, s_dhidden,
             HAS_DSTREAM_IN: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        w = tl.load(WEIGHT + cols, mask=inside, other=0.0).to(ACC)
        dw = tl.zeros([BLOCK], dtype=ACC)
        first = program.to(tl.int64) * rows_each
        end = tl.minimum(first + rows_each, rows)
        for row in range(first, end):
            x = tl.load(STREAM + row * s_stream + cols, mask=inside, other=0.0).to(ACC)
            dy = tl.load(DNORMED + row * s_dnormed + cols, mask=inside, other=0.0).to(ACC)
            rstd = tl.load(RSTD + row).to(ACC)
            xhat = x * rstd
            g = w * dy
            c = tl.sum(xhat * g, axis=0) / dim
            dx = (g - xhat * c) * rstd
            if HAS_DSTREAM_IN:
                dx += tl.load(DSTREAM_IN + row * s_dstream_in + cols, mask=inside, other=0.0).to(ACC)
            tl.store(DSTREAM + row * s_dstream + cols, dx, mask=inside)
            if HAS_SCALE:
                dx = dx * tl.load(SCALE + row // rows_a_sample).to(ACC)
            tl.store(DHIDDEN + row * s_dhidden + cols, dx.to(DHIDDEN.dtype.element_ty), mask=inside)
            dw += dy * xhat
        tl.store(DWEIGHT_PART + program.to(tl.int64) * dim + cols, dw, mask=inside)


def interpreted() -> bool:
    """Whether this process runs Triton kernels in Triton's interpreter (TRITON_INTERPRET=1 when triton was
    imported: triton.language's own functions are made for one mode or the other then)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels():
    """(forward, backward): compiled for the GPU, or, under TRITON_INTERPRET=1, run by the interpreter."""
    return triton.jit(_fwd), triton.jit(_bwd)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(dim: int) -> int:
    if dim > MAX_DIM:
        raise ValueError(f"add_rms_norm: rows of {dim} elements; the kernel takes at most {MAX_DIM}")
    return triton.next_power_of_2(dim)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, dim) with unit stride along dim (a view where the layout allows, else a copy)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows_a_sample(t: torch.Tensor) -> int:
    return max(t.numel() // max(t.shape[0] * t.shape[-1], 1), 1) if t.dim() > 1 else 1


class Launch(NamedTuple):
    """One kernel launch: ``kernel`` 0 (forward) or 1 (backward) of ``_kernels()``, its grid, its arguments in
    order, its compile-time constants and warps (tools/triton_report.py compiles the same for each GPU target)."""
    kernel: int
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int


def _run(launch: Launch) -> None:
    _kernels()[launch.kernel][launch.grid](*launch.args, **launch.constexprs, num_warps=launch.num_warps)


def forward_launch(hidden: torch.Tensor, residual, weight: torch.Tensor, eps: float, stream_dtype: torch.dtype,
                   scale=None):
    """((normed, stream, rstd) allocated, the Launch that fills them, or None where there are no rows)."""
    shape, dim = hidden.shape, hidden.shape[-1]
    h = _rows(hidden)
    r = h if residual is None else _rows(residual)
    rows = h.shape[0]
    normed = torch.empty(shape, dtype=weight.dtype, device=hidden.device)
    stream = torch.empty(shape, dtype=stream_dtype, device=hidden.device)
    rstd = torch.empty(rows, dtype=stream_dtype, device=hidden.device)
    if not rows:
        return (normed, stream, rstd), None
    block = _block(dim)
    sc = weight if scale is None else scale.contiguous()
    # eps is a compile-time constant: an argument would be an fp32 scalar, rounded before an fp64 sum met it
    return (normed, stream, rstd), Launch(
        0, (rows,), (h, r, sc, weight.contiguous(), normed, stream, rstd, dim, _rows_a_sample(hidden), h.stride(0),
                     r.stride(0), dim, dim),
        dict(EPS=float(eps), HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None, BLOCK=block,
             ACC=_acc(stream_dtype)), _warps(block))


def forward(hidden: torch.Tensor, residual, weight: torch.Tensor, eps: float, stream_dtype: torch.dtype,
            scale=None):
    """(normed in the weight's dtype, stream in stream_dtype, rstd (rows,) in stream_dtype), shaped like hidden;
    ``scale`` (batch,): hidden's rows of sample b multiplied by scale[b] before the add (stochastic depth)."""
    outputs, launch = forward_launch(hidden, residual, weight, eps, stream_dtype, scale)
    if launch is not None:
        _run(launch)
    return outputs


def _programs(rows: int, device: torch.device) -> int:
    if device.type != "cuda":  # (ROCm's GPUs are "cuda" too) the interpreter, or the meta tensors that
        return min(rows, 4)    # tools/triton_report.py compiles for: few programs, each a run of rows
    return min(rows, torch.cuda.get_device_properties(device).multi_processor_count * 8)


def backward_launch(dnormed: torch.Tensor, dstream_in, stream: torch.Tensor, weight: torch.Tensor,
                    rstd: torch.Tensor, hidden_dtype, scale=None):
    """((dstream, dhidden, the weight's partials (programs, dim)) allocated, the Launch that fills them, or None)."""
    shape, dim = stream.shape, stream.shape[-1]
    x, dy = _rows(stream), _rows(dnormed)
    dsi = dy if dstream_in is None else _rows(dstream_in)
    rows = x.shape[0]
    dstream = torch.empty(shape, dtype=stream.dtype, device=stream.device)
    dhidden = torch.empty(shape, dtype=hidden_dtype, device=stream.device)
    programs = max(_programs(rows, stream.device), 1)
    rows_each = -(-rows // programs)
    programs = -(-rows // rows_each) if rows else 1
    parts = torch.zeros((programs, dim), dtype=stream.dtype, device=stream.device)
    if not rows:
        return (dstream, dhidden, parts), None
    block = _block(dim)
    sc = weight if scale is None else scale.contiguous()
    return (dstream, dhidden, parts), Launch(
        1, (programs,), (dy, dsi, x, weight.contiguous(), rstd, sc, dstream, dhidden, parts, rows, dim, rows_each,
                         _rows_a_sample(stream), dy.stride(0), dsi.stride(0), x.stride(0), dim, dim),
        dict(HAS_DSTREAM_IN=dstream_in is not None, HAS_SCALE=scale is not None, BLOCK=block,
             ACC=_acc(stream.dtype)), _warps(block))


def backward(dnormed: torch.Tensor, dstream_in, stream: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             hidden_dtype, scale=None):
    """(dstream in the stream's dtype, dhidden in hidden_dtype (times the sample's scale), dweight in the weight's
    dtype)."""
    (dstream, dhidden, parts), launch = backward_launch(dnormed, dstream_in, stream, weight, rstd, hidden_dtype, scale)
    if launch is not None:
        _run(launch)
    return dstream, dhidden, parts.sum(0).to(weight.dtype)
