"""``selective_scan_fn``: mamba_ssm's selective-scan interface on the registered op
``torch.ops.vim_ds.selective_scan_fwd`` (see ``library.py``), with autograd.

Shapes and semantics are mamba_ssm's (real A; B and C input-dependent):
u, delta, z: (batch, dim, seqlen); A: (dim, d_state); B, C: (batch, d_state, seqlen); D, delta_bias: (dim,).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .library import selective_scan_fwd

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_D_STATE = 256


def _fail(name, expected, got):
    raise ValueError(f"selective_scan_fn: {name} must be {expected}, got {got}")


def _check_tensor(name, t, shape: Sequence[int], shape_text: str, device, dtype=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"of shape {shape_text} = {tuple(shape)}", f"shape {tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"on {device} like u", f"a tensor on {t.device}")
    if dtype is not None and t.dtype != dtype:
        _fail(name, f"of dtype {dtype} like u", f"{t.dtype}")
    if not t.dtype.is_floating_point:
        _fail(name, "a floating-point tensor", f"{t.dtype}")
    if not t.is_contiguous():
        _fail(name, "contiguous (call .contiguous())", f"a tensor with strides {t.stride()}")


def validate(u, delta, A, B, C, D=None, z=None, delta_bias=None):
    """Raise ValueError naming the first bad argument; return (batch, dim, seqlen, d_state)."""
    if not isinstance(u, torch.Tensor) or u.dim() != 3:
        _fail("u", "a 3-D tensor (batch, dim, seqlen)", getattr(u, "shape", type(u).__name__))
    if u.dtype not in INPUT_DTYPES:
        _fail("u", "float32, float16, bfloat16 or float64", u.dtype)
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        _fail("u", "a tensor with seqlen >= 1", f"shape {tuple(u.shape)}")
    if not isinstance(A, torch.Tensor) or A.dim() != 2:
        _fail("A", f"a 2-D tensor (dim, d_state) with dim={dim}", getattr(A, "shape", type(A).__name__))
    d_state = A.shape[1]
    if not 1 <= d_state <= MAX_D_STATE:
        _fail("A", f"of shape (dim, d_state) with 1 <= d_state <= {MAX_D_STATE}", f"d_state={d_state}")
    if A.is_complex():
        _fail("A", "real (complex A is not supported)", A.dtype)
    device = u.device
    _check_tensor("u", u, (batch, dim, seqlen), "(batch, dim, seqlen)", device)
    _check_tensor("delta", delta, (batch, dim, seqlen), "(batch, dim, seqlen)", device, u.dtype)
    _check_tensor("A", A, (dim, d_state), "(dim, d_state)", device)
    _check_tensor("B", B, (batch, d_state, seqlen), "(batch, d_state, seqlen)", device, u.dtype)
    _check_tensor("C", C, (batch, d_state, seqlen), "(batch, d_state, seqlen)", device, u.dtype)
    if D is not None:
        _check_tensor("D", D, (dim,), "(dim,)", device)
    if z is not None:
        _check_tensor("z", z, (batch, dim, seqlen), "(batch, dim, seqlen)", device, u.dtype)
    if delta_bias is not None:
        _check_tensor("delta_bias", delta_bias, (dim,), "(dim,)", device)
    return batch, dim, seqlen, d_state


def _param_dtype(u):
    # A, D and delta_bias are kept in fp32 by the kernels (fp64 for fp64 input), as in mamba_ssm.
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def scan_with_backend(backend, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      reverse=False):
    """The op on a given backend (an object from ``backends`` or a name: auto, ref, cpu, cuda), inputs already
    validated; A, D, delta_bias cast to the kernels' fp32."""
    name = backend if isinstance(backend, str) else backend.name
    p = _param_dtype(u)
    A = A.to(p)
    D = None if D is None else D.to(p)
    delta_bias = None if delta_bias is None else delta_bias.to(p)
    out, _ = selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(reverse), name)
    return out


def selective_scan_fn(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    *,
    reverse: bool = False,
) -> torch.Tensor:
    """Selective scan with gradients for every input; the backend follows the device (or ``VIM_DS_SCAN``).

    ``out[b,d,t] = (sum_n h[b,d,n,t] C[b,n,t] + D[d] u[b,d,t]) * silu(z[b,d,t])`` with
    ``h[.,t] = exp(delta'[t] A) h[.,t-1] + delta'[t] B[t] u[t]`` and ``delta' = softplus(delta + delta_bias)``.

    ``reverse=True`` (keyword only; not in mamba_ssm) scans from the last step to the first,
    ``h[.,t] = exp(delta'[t] A) h[.,t+1] + delta'[t] B[t] u[t]``: the same as flipping u, delta, B, C, z along time
    and flipping the output back, without the copies (Vim's backward direction).
    """
    validate(u, delta, A, B, C, D, z, delta_bias)
    return scan_with_backend("auto", u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse=reverse)
