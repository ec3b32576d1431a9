"""The selective scan from a given initial state, returning its last state, with gradients for both:
``selective_scan_with_state`` on the registered ops ``torch.ops.vim_ds.selective_scan_state_fwd`` / ``_bwd``.

This is what a chunk of a longer sequence needs (``vim_ds/models/sequence_parallel.py``): it starts from the state
the chunks before it leave (``h0``), hands its own last state on, and in backward takes that last state's gradient
from the chunks after it and returns ``dh0`` to those before. ``selective_scan_fn`` is left as it is (mamba_ssm's
interface, no initial state, a last state without gradient); this is a separate, narrower entry:

* B and C input-dependent, (batch, d_state, seqlen) (Vim's form);
* backends ``ref`` (``selective_scan_ref`` with ``h0``, gradients by autograd), ``cpu`` and ``cuda`` (the compiled
  kernels' ``h0`` / ``dlast`` arguments); ``auto`` picks one of them by device; mamba_ssm's kernel has none.

Semantics (the reference's): ``h0`` (batch, dim, d_state) is the state before the first scan step (h[-1]; with
``reverse``, h[L], before step L-1); the last state is the one after the last scan step (with ``reverse``, after
step 0), (batch, dim, d_state) in float32 (float64 for float64 input). Without ``h0`` the scan starts from zero and
its output is bitwise the plain scan's on the same backend.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .library import NAMESPACE, _absent, _no_autocast, _saved_like, custom_op, resolve
from .selective_scan import _param_dtype, validate


def _state_backend(backend: str, device: torch.device):
    impl = resolve(backend, device)
    if not hasattr(impl, "fwd_state"):
        raise NotImplementedError(f"selective scan with an initial state: the {impl.name} backend has none "
                                  f"(vim_ds's own, ref, cpu and cuda, have it)")
    return impl


@custom_op(f"{NAMESPACE}::selective_scan_state_fwd", mutates_args=())
def selective_scan_state_fwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                             z: Optional[Tensor], delta_bias: Optional[Tensor], h0: Optional[Tensor],
                             delta_softplus: bool, reverse: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (out, saved, last_state); ``saved`` is the backend's, for the backward (empty where it recomputes)."""
    with _no_autocast(u.device):
        out, saved, last = _state_backend(backend, u.device).fwd_state(u, delta, A, B, C, D, z, delta_bias,
                                                                       delta_softplus, reverse, h0)
    return out.contiguous(), _absent(u) if saved is None else saved, last.to(A.dtype).contiguous()


@selective_scan_state_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, reverse, backend):
    return (torch.empty_like(u, memory_format=torch.contiguous_format),
            _saved_like(resolve(backend, u.device), u, A, z is not None),
            u.new_empty((u.shape[0], u.shape[1], A.shape[1]), dtype=A.dtype))


@custom_op(f"{NAMESPACE}::selective_scan_state_bwd", mutates_args=())
def selective_scan_state_bwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                             z: Optional[Tensor], delta_bias: Optional[Tensor], h0: Optional[Tensor], dout: Tensor,
                             saved: Tensor, dlast: Optional[Tensor], delta_softplus: bool, reverse: bool,
                             backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                    Tensor]:
    """-> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dh0); an input given as None gets an empty tensor."""
    with _no_autocast(u.device):
        grads = _state_backend(backend, u.device).bwd_state(u, delta, A, B, C, D, z, delta_bias, dout, saved,
                                                            delta_softplus, reverse, h0, dlast)
    return tuple(_absent(u) if g is None else g.contiguous() for g in grads)


@selective_scan_state_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, h0, dout, saved, dlast, delta_softplus, reverse, backend):
    like = [u, delta, A, B, C, D, z, delta_bias, h0]
    return tuple(_absent(u) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in like)


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, reverse, backend = inputs
    ctx.options = (delta_softplus, reverse, backend)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, h0, output[1])


def _backward(ctx, dout, _dsaved, dlast):
    u, delta, A, B, C, D, z, delta_bias, h0, saved = ctx.saved_tensors
    dout = torch.zeros_like(u) if dout is None else dout.contiguous()
    dlast = None if dlast is None else dlast.to(A.dtype).contiguous()
    grads = selective_scan_state_bwd(u, delta, A, B, C, D, z, delta_bias, h0, dout, saved, dlast, *ctx.options)
    given = (u, delta, A, B, C, D, z, delta_bias, h0)
    return (*(g if t is not None else None for g, t in zip(grads, given)), None, None, None)


selective_scan_state_fwd.register_autograd(_backward, setup_context=_setup_context)


def selective_scan_with_state(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                              z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                              delta_softplus: bool = False, reverse: bool = False, h0: Optional[Tensor] = None,
                              backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(out, last_state)`` of the selective scan started from ``h0`` (None: zero), differentiable in both (so in
    every input and in ``h0``). Arguments as ``selective_scan_fn`` with B, C input-dependent (batch, d_state,
    seqlen); ``h0`` (batch, dim, d_state), cast to float32 (float64 for float64 input); see the module docstring."""
    batch, dim, _, d_state = validate(u, delta, A, B, C, D, z, delta_bias)
    if B.dim() != 3 or C.dim() != 3:
        raise ValueError("selective_scan_with_state: B and C must be input-dependent (batch, d_state, seqlen)")
    p = _param_dtype(u)
    if h0 is not None and tuple(h0.shape) != (batch, dim, d_state):
        raise ValueError(f"selective_scan_with_state: h0 must be of shape (batch, dim, d_state) = "
                         f"{(batch, dim, d_state)}, got {tuple(h0.shape)}")
    in_dtype = u.dtype
    # the CPU kernel has no float16: such input runs in float32 and is rounded back once
    kdt = torch.float32 if in_dtype == torch.float16 else in_dtype

    def prep(t, dtype):
        return None if t is None else t.to(dtype).contiguous()

    out, _, last = selective_scan_state_fwd(prep(u, kdt), prep(delta, kdt), prep(A, p), prep(B, kdt), prep(C, kdt),
                                            prep(D, p), prep(z, kdt), prep(delta_bias, p), prep(h0, p),
                                            bool(delta_softplus), bool(reverse), backend)
    return out.to(in_dtype), last
