"""``selective_scan_fn``: mamba_ssm's selective-scan interface on the registered op
``torch.ops.vim_ds.selective_scan_fwd`` (see ``library.py``), with autograd.

Shapes and semantics are mamba_ssm's (real A): u, delta, z: (batch, dim, seqlen); A: (dim, d_state);
D, delta_bias: (dim,); B and C each in one of three forms (they may differ):

=======================  ====================================  ================================================
form                     shape                                 how the kernels run it
=======================  ====================================  ================================================
input-dependent          (batch, d_state, seqlen)              one kernel call (Vim's form; the fast path)
grouped                  (batch, groups, d_state, seqlen)      groups == 1: a view of the above; else one call
                                                               per group on its channel slice
                                                               (channel d reads group d // (dim // groups))
constant                 (dim, d_state)                        one call per channel, B[d] / C[d] broadcast over
                                                               batch and time (exact: the same recurrence)
=======================  ====================================  ================================================

With B and C in different forms the channels are cut into lcm(groups of B, groups of C) slices (a constant form
counts as dim groups), one kernel call each, so that every slice reads one B and one C. Slices are computed in
float32 (float64 for float64 input) whenever a low-precision B or C group would otherwise have its gradient
rounded more than once (split across slices, or broadcast), or when the backend has no kernel for the dtype
(float16 on the CPU kernel); the results are then rounded to the input dtype once, as a kernel would.
"""
from __future__ import annotations

import math
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
    if dtype is not None and t.dtype not in ((dtype,) if isinstance(dtype, torch.dtype) else dtype):
        _fail(name, f"of dtype {dtype} like u" if isinstance(dtype, torch.dtype)
              else f"of dtype {' or '.join(map(str, dtype))}", f"{t.dtype}")
    if not t.dtype.is_floating_point:
        _fail(name, "a floating-point tensor", f"{t.dtype}")


def _check_BC(name, X, u, batch, dim, seqlen, d_state) -> int:
    """Check B or C in any of its three forms; return its number of groups (dim for the constant form)."""
    device = u.device
    ndim = X.dim() if isinstance(X, torch.Tensor) else None
    if ndim == 2:  # constant: mamba_ssm keeps it in the weights' dtype; u's dtype is accepted too
        _check_tensor(name, X, (dim, d_state), "(dim, d_state)", device, (u.dtype, _param_dtype(u)))
        return dim
    if ndim == 4:
        groups = X.shape[1]
        if groups < 1 or dim % groups:
            _fail(name, f"grouped (batch, groups, d_state, seqlen) with dim={dim} divisible by groups",
                  f"shape {tuple(X.shape)}")
        _check_tensor(name, X, (batch, groups, d_state, seqlen), "(batch, groups, d_state, seqlen)", device, u.dtype)
        return groups
    if ndim not in (None, 3):
        _fail(name, "(batch, d_state, seqlen), (batch, groups, d_state, seqlen) or (dim, d_state)",
              f"shape {tuple(X.shape)}")
    _check_tensor(name, X, (batch, d_state, seqlen), "(batch, d_state, seqlen)", device, u.dtype)
    return 1


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
    _check_BC("B", B, u, batch, dim, seqlen, d_state)
    _check_BC("C", C, u, batch, dim, seqlen, d_state)
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


def _groups(X, dim):
    """Groups of B or C: 1 input-dependent, G grouped, dim constant."""
    return 1 if X.dim() == 3 else dim if X.dim() == 2 else X.shape[1]


def _slice_BC(X, s, slices, dim, batch, seqlen, dtype):
    """The (batch, d_state, seqlen) B or C that the channels of slice `s` (of `slices`) read, contiguous."""
    if X.dim() == 3:
        part = X
    elif X.dim() == 4:
        part = X[:, s // (slices // X.shape[1])]
    else:  # constant: slices == dim, one channel per slice
        part = X[s][None, :, None].expand(batch, X.shape[1], seqlen)
    return part.to(dtype).contiguous()


def scan_with_backend(backend, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, *, reverse=False):
    """The op on a given backend (an object from ``backends`` or a name: auto, ref, cpu, cuda, mamba), inputs already
    validated (any strides; B and C in any form, see the module docstring); A, D, delta_bias cast to the kernels'
    fp32. Returns out, or (out, last_state) with ``return_last_state``."""
    name = backend if isinstance(backend, str) else backend.name
    p = _param_dtype(u)
    A = A.to(p).contiguous()
    D = None if D is None else D.to(p).contiguous()
    delta_bias = None if delta_bias is None else delta_bias.to(p).contiguous()
    batch, dim, seqlen = u.shape
    g_B, g_C = _groups(B, dim), _groups(C, dim)
    if B.dim() == 4 and g_B == 1:
        B = B[:, 0]
    if C.dim() == 4 and g_C == 1:
        C = C[:, 0]
    slices = g_B * g_C // math.gcd(g_B, g_C)
    # Kernel dtype: u's, unless a low-precision B / C group would be split over slices or broadcast (its gradient
    # would be rounded once per piece), or the CPU kernel has no such dtype (float16).
    same_groups = g_B == g_C and B.dim() != 2 and C.dim() != 2
    wide = u.dtype != p and (not same_groups or B.dtype != u.dtype or C.dtype != u.dtype
                             or (u.device.type == "cpu" and u.dtype == torch.float16))
    kdt = p if wide else u.dtype
    in_dtype = u.dtype
    # Cast whole tensors once, before slicing: the gradients of the slices then meet in kdt and are rounded back
    # to the input's dtype once.
    u, delta, B, C = u.to(kdt), delta.to(kdt), B.to(kdt), C.to(kdt)
    z = None if z is None else z.to(kdt)
    opts = (bool(delta_softplus), bool(reverse), name, bool(return_last_state))
    if slices == 1:
        out, _, last = selective_scan_fwd(u.contiguous(), delta.contiguous(), A,
                                          _slice_BC(B, 0, 1, dim, batch, seqlen, kdt),
                                          _slice_BC(C, 0, 1, dim, batch, seqlen, kdt), D,
                                          None if z is None else z.contiguous(), delta_bias, *opts)
    else:
        width = dim // slices
        outs, lasts = [], []
        for s in range(slices):
            ch = slice(s * width, (s + 1) * width)

            def part(t):
                return None if t is None else t[:, ch].contiguous()

            o, _, last_s = selective_scan_fwd(
                part(u), part(delta), A[ch], _slice_BC(B, s, slices, dim, batch, seqlen, kdt),
                _slice_BC(C, s, slices, dim, batch, seqlen, kdt), None if D is None else D[ch], part(z),
                None if delta_bias is None else delta_bias[ch], *opts)
            outs.append(o)
            lasts.append(last_s)
        out = torch.cat(outs, dim=1)
        last = torch.cat(lasts, dim=1) if return_last_state else None
    out = out.to(in_dtype)
    return (out, last) if return_last_state else out


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
    return_last_state: bool = False,
    *,
    reverse: bool = False,
):
    """Selective scan with gradients for every input; the backend follows the device (or ``VIM_DS_SCAN``).

    ``out[b,d,t] = (sum_n h[b,d,n,t] C[b,n,t] + D[d] u[b,d,t]) * silu(z[b,d,t])`` with
    ``h[.,t] = exp(delta'[t] A) h[.,t-1] + delta'[t] B[t] u[t]`` and ``delta' = softplus(delta + delta_bias)``.
    B and C may each be input-dependent (batch, d_state, seqlen), grouped (batch, groups, d_state, seqlen) or
    constant (dim, d_state) (see the module docstring). Inputs of any strides are made contiguous.

    ``return_last_state=True`` returns ``(out, last_state)``: the state after the last step, (batch, dim, d_state)
    in float32 (float64 for float64 input). As in mamba_ssm, gradients flow through ``out`` only: ``last_state``
    is not differentiable (it carries no gradient back to the inputs).

    ``reverse=True`` (keyword only; not in mamba_ssm) scans from the last step to the first,
    ``h[.,t] = exp(delta'[t] A) h[.,t+1] + delta'[t] B[t] u[t]``: the same as flipping u, delta, B, C, z along time
    and flipping the output back, without the copies (Vim's backward direction); its last state is the one after
    t = 0.
    """
    validate(u, delta, A, B, C, D, z, delta_bias)
    return scan_with_backend("auto", u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                             reverse=reverse)
