"""The kernels as PyTorch operators in the ``vim_ds`` namespace (``torch.ops.vim_ds.*``).

Registered with ``torch.library.custom_op``, each with a fake implementation (shapes and dtypes only, for
``torch.compile``, ``torch.export`` and meta tensors) and, for the forward ops, registered autograd, so that the
compiler sees one opaque node per kernel call instead of a graph break.

============================  =====================================================================
``selective_scan_fwd``        the scan -> ``(out, saved, last_state)``; differentiable (through ``out``) by
                              ``selective_scan_bwd``
``selective_scan_bwd``        its gradients (8 tensors; an input given as None gets an empty tensor)
``causal_conv1d``             depthwise causal conv1d (anti-causal with ``reverse``); differentiable
``causal_conv1d_bwd``         its gradients ``(dx, dweight, dbias)``
``ssm_branch_fwd``            the fused Mamba branch (conv1d + SiLU, x_proj, dt_proj, scan, gate) -> ``(out, saved)``
``ssm_branch_bwd``            its gradients; recomputes the conv and projections instead of keeping them
``bimamba_branch_fwd``        both directions of a Vim mixer (the second reversed) -> ``(out summed, saved,
                              saved_b)``; the second adds into the first's output in the scan's store on GPUs
``bimamba_branch_bwd``        their gradients (dx, dz summed; 14 weight gradients); dx added in the conv's store
============================  =====================================================================

Every op takes a ``backend`` string: ``"auto"`` picks by device as ``backends.get_backend`` does (the compiled
kernel for the device, ``VIM_DS_SCAN`` if set, the pure-PyTorch reference as the fallback); ``"ref"``, ``"cpu"``,
``"cuda"`` or ``"mamba"`` (mamba_ssm's kernel, when installed) name one (tests and benchmarks). ``saved`` is the
backend's private state for the backward: the GPU kernel's chunk-boundary states, mamba_ssm's chunk states (and
its pre-gate output), an empty tensor elsewhere. Op implementations run with autocast off and cast
explicitly (weights to the activations' dtype), so eager, compiled and exported programs compute the same thing.
"""
from __future__ import annotations

import typing
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import backends

NAMESPACE = "vim_ds"


def custom_op(name: str, mutates_args=()):
    """``torch.library.custom_op`` for a function whose annotations may be strings (this package's modules use
    ``from __future__ import annotations``): they are evaluated first, in the function's module. torch 2.4's
    ``infer_schema`` reads the raw annotations and refuses strings (``Parameter u has unsupported type Tensor``);
    newer torch evaluates them itself, to the same objects, so the schema is the same there."""
    def register(fn):
        fn.__annotations__ = typing.get_type_hints(fn)
        return torch.library.custom_op(name, mutates_args=mutates_args)(fn)

    return register


def resolve(backend: str, device: torch.device):
    """The backend object for an op's ``backend`` argument on `device`."""
    if backend == "auto":
        return backends.get_backend(device)
    if backend == "ref":
        return backends.RefBackend()
    # mamba_ssm's kernel, when installed; it checks its own devices and dtypes
    if backend == "mamba":
        loaded = backends.load("mamba")
        if loaded.backend is None:
            raise RuntimeError(f"vim_ds ops: backend 'mamba' is unavailable: {loaded.reason}")
        return loaded.backend
    if backend not in backends.BACKENDS:
        raise ValueError(f"vim_ds ops: backend must be auto, ref, cpu, cuda or mamba, got {backend!r}")
    kind = "cpu" if device.type == "cpu" else "cuda"
    if backend != kind:
        raise ValueError(f"vim_ds ops: the {backend} backend cannot run on {device.type} tensors")
    loaded = backends.load(kind)
    if loaded.backend is None:
        raise RuntimeError(f"vim_ds ops: the {kind} kernel is unavailable: {loaded.reason}")
    return loaded.backend


def _absent(like: Tensor) -> Tensor:
    """The slot of a tensor that is None (custom ops return tensors only): empty, on the right device."""
    return like.new_empty((0,))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False)


# ---------------------------------------------------------------------------------------------------------------
# Selective scan
# ---------------------------------------------------------------------------------------------------------------

def _saved_like(backend_obj, u: Tensor, A: Tensor, has_z: bool = True) -> Tensor:
    """What the backend's forward returns as `saved`, as an empty tensor of the same shape and dtype."""
    if getattr(backend_obj, "name", None) == "mamba":
        batch, dim, seqlen = u.shape
        return u.new_empty((backend_obj.saved_numel(batch, dim, seqlen, A.shape[1], has_z, u.element_size(),
                                                    A.element_size()),))
    if getattr(backend_obj, "name", None) == "cuda":
        batch, dim, seqlen = u.shape
        d_state = A.shape[1]
        chunk = backend_obj.module.chunk_length(int(d_state), u.dtype == torch.float64)
        n_ckpt = (seqlen + chunk - 1) // chunk if chunk > 0 else 0  # every chunk's start state
        return u.new_empty((batch, dim, n_ckpt, d_state), dtype=_wide(u.dtype))
    return _absent(u)


def _last_state_like(u: Tensor, A: Tensor, return_last_state: bool) -> Tensor:
    return u.new_empty((u.shape[0], u.shape[1], A.shape[1]), dtype=A.dtype) if return_last_state else _absent(u)


@custom_op(f"{NAMESPACE}::selective_scan_fwd", mutates_args=())
def selective_scan_fwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                       z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool, reverse: bool,
                       backend: str, return_last_state: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """-> (out, saved, last_state): last_state (batch, dim, d_state) in A's dtype when asked for, else empty.
    Only `out` is differentiable (as in mamba_ssm, no gradient flows back from the last state)."""
    impl = resolve(backend, u.device)
    out, saved, last = impl.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, return_last_state)
    last = last.to(A.dtype).contiguous() if return_last_state else _absent(u)
    return out.contiguous(), _absent(u) if saved is None else saved, last


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, backend, return_last_state=False):
    return (torch.empty_like(u, memory_format=torch.contiguous_format),
            _saved_like(resolve(backend, u.device), u, A, z is not None),
            _last_state_like(u, A, return_last_state))


@custom_op(f"{NAMESPACE}::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                       z: Optional[Tensor], delta_bias: Optional[Tensor], dout: Tensor, saved: Tensor,
                       delta_softplus: bool, reverse: bool,
                       backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = resolve(backend, u.device)
    grads = impl.bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse)
    return tuple(_absent(u) if g is None else g.contiguous() for g in grads)


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse, backend):
    like = [u, delta, A, B, C, D, z, delta_bias]
    return tuple(_absent(u) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in like)


def _scan_setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, backend, _return_last_state = inputs
    ctx.options = (delta_softplus, reverse, backend)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, output[1])


def _scan_backward(ctx, dout, _dsaved, _dlast_state):
    u, delta, A, B, C, D, z, delta_bias, saved = ctx.saved_tensors
    grads = selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout.contiguous(), saved, *ctx.options)
    given = (u, delta, A, B, C, D, z, delta_bias)
    return (*(g if t is not None else None for g, t in zip(grads, given)), None, None, None, None)


selective_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# Depthwise causal conv1d
# ---------------------------------------------------------------------------------------------------------------

# The dtypes and widest conv of each compiled conv kernel (csrc/causal_conv1d_cpu.cpp, csrc/causal_conv1d_kernel.cuh),
# and whether it fuses the branch's SiLU (the GPU kernel's `silu`).
_CONV_KERNELS = {"cpu": ((torch.float32, torch.float64, torch.bfloat16), None, False),
                 "cuda": ((torch.float32, torch.float64, torch.bfloat16, torch.float16), 8, True)}


def _conv_uses_kernel(backend_obj, x: Tensor, width: int) -> bool:
    # The compiled kernel of the scan's backend (`cpu`, or `cuda`: the GPU kernel, for CUDA and ROCm alike); else
    # PyTorch's conv (the `ref` backend, and mamba_ssm's, whose module has no conv).
    dtypes, widest, _ = _CONV_KERNELS.get(getattr(backend_obj, "name", None), ((), None, False))
    return x.dtype in dtypes and (widest is None or width <= widest)


def _conv_fuses_silu(backend_obj, x: Tensor, width: int) -> bool:
    return _conv_uses_kernel(backend_obj, x, width) and _CONV_KERNELS[backend_obj.name][2]


def _rows_contiguous(x: Tensor) -> Tensor:
    # The CPU kernel reads whole rows; a channel slice of a wider tensor is fine, other layouts are copied.
    return x if x.stride(-1) == 1 and x.stride(1) == x.shape[-1] else x.contiguous()


def _conv_kernel_args(x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """x, the taps and the bias as the compiled kernels take them (rows contiguous; the accumulation type)."""
    wide = _wide(x.dtype)
    return (_rows_contiguous(x), weight.reshape(-1, weight.shape[-1]).to(wide).contiguous(),
            None if bias is None else bias.to(wide).contiguous())


def conv_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], reverse: bool, backend_obj,
                 silu: bool = False) -> Tensor:
    """Conv output in x's dtype, with ``silu`` its SiLU in the same kernel (only where the kernel fuses it:
    _conv_fuses_silu; elsewhere the caller applies it, as branch_inputs_fwd does, keeping the conv's output for the
    backward); plain computation, no autograd (op implementations use it)."""
    k = weight.shape[-1]
    if silu and not _conv_fuses_silu(backend_obj, x, k):
        raise ValueError("conv_forward: silu=True needs a conv kernel that fuses the SiLU (_conv_fuses_silu)")
    if _conv_uses_kernel(backend_obj, x, k):
        fused = {"silu": True} if silu else {}  # (the CPU kernel's binding has no silu argument)
        return backend_obj.module.conv_fwd(*_conv_kernel_args(x, weight, bias), reverse, **fused)
    w = weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    if reverse:  # y[t] = sum_j w[j] x[t + K-1 - j]: the flipped taps over a window starting at t
        return F.conv1d(x, w.flip(-1), b, padding=k - 1, groups=x.shape[1])[..., k - 1:]
    return F.conv1d(x, w, b, padding=k - 1, groups=x.shape[1])[..., :x.shape[-1]]


def _adds_into(backend_obj) -> bool:
    return getattr(backend_obj, "adds_into", False)


def conv_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], dout: Tensor, reverse: bool, backend_obj,
                  silu: bool = False, pre: Optional[Tensor] = None, dx_add_to: Optional[Tensor] = None):
    """(dx, dweight, dbias or None) of conv_forward, dweight and dbias in the weights' dtypes. With ``silu`` dout is
    the gradient of the SiLU's output: on GPUs the kernel recomputes the conv's output for silu' and never stores
    it; elsewhere the SiLU's gradient takes the conv's output ``pre`` (conv_forward without silu), or runs the
    conv again without it. ``dx_add_to`` (contiguous, x's shape and dtype): dx is added into it and it is returned
    as dx (the GPU kernel adds in its store; elsewhere one add after)."""
    k = weight.shape[-1]
    fused = silu and _conv_fuses_silu(backend_obj, x, k)
    if silu and not fused:
        if pre is None:
            pre = conv_forward(x, weight, bias, reverse, backend_obj)
        dout = torch.ops.aten.silu_backward(dout.to(x.dtype), pre)
    if _conv_uses_kernel(backend_obj, x, k):
        options = {"silu": True} if fused else {}
        if dx_add_to is not None and _adds_into(backend_obj):
            options["dx_add_to"], dx_add_to = dx_add_to, None
        dx, dw, db = backend_obj.module.conv_bwd(*_conv_kernel_args(x, weight, bias), dout.to(x.dtype).contiguous(),
                                                 reverse, **options)
    else:
        w = weight.to(x.dtype)
        # the output is the full convolution's last L steps, computed with the flipped taps
        if reverse:
            full, w = F.pad(dout, (k - 1, 0)), w.flip(-1)
        else:  # the full convolution's first L steps
            full = F.pad(dout, (0, k - 1))
        dx, dw, db = torch.ops.aten.convolution_backward(
            full.to(x.dtype), x, w, None if bias is None else [bias.shape[0]], [1], [k - 1], [1], False, [0],
            x.shape[1], [True, True, bias is not None])
        if reverse:
            dw = dw.flip(-1)
    dw = dw.reshape(weight.shape).to(weight.dtype)
    db = None if bias is None else db.to(bias.dtype)
    dx = dx.contiguous() if dx_add_to is None else dx_add_to.add_(dx)
    return dx, dw.contiguous(), db


@custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], reverse: bool, backend: str) -> Tensor:
    """x (batch, d, L), weight (d, 1, K), bias (d,) or None -> (batch, d, L) in x's dtype."""
    with _no_autocast(x.device):
        return conv_forward(x, weight, bias, reverse, resolve(backend, x.device)).contiguous()


@causal_conv1d.register_fake
def _(x, weight, bias, reverse, backend):
    return x.new_empty(x.shape)


@custom_op(f"{NAMESPACE}::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], dout: Tensor, reverse: bool,
                      backend: str) -> tuple[Tensor, Tensor, Tensor]:
    with _no_autocast(x.device):
        dx, dw, db = conv_backward(x, weight, bias, dout, reverse, resolve(backend, x.device))
    return dx, dw, _absent(x) if db is None else db


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, dout, reverse, backend):
    return x.new_empty(x.shape), torch.empty_like(weight), _absent(x) if bias is None else torch.empty_like(bias)


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, reverse, backend = inputs
    ctx.options = (reverse, backend)
    ctx.save_for_backward(x, weight, bias)


def _conv_backward(ctx, dout):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = causal_conv1d_bwd(x, weight, bias, dout.contiguous(), *ctx.options)
    return dx, dw, None if bias is None else db, None, None


causal_conv1d.register_autograd(_conv_backward, setup_context=_conv_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# The fused SSM branch
# ---------------------------------------------------------------------------------------------------------------

def project(weight: Tensor, x: Tensor) -> Tensor:
    """weight (out, in) @ x (batch, in, L) -> (batch, out, L): a linear layer in the channels-first layout.

    bmm over a stride-0 expanded weight: torch.matmul would first copy x into an (in, batch, L) layout.
    """
    return torch.bmm(weight.expand(x.shape[0], -1, -1), x)


def _weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    """d(weight) of project(weight, x) for output gradient dy: sum over the batch of dy @ x^T."""
    return torch.bmm(dy, x.transpose(1, 2)).sum(0)


def _with_halo(x: Tensor, halo: Optional[Tensor], reverse: bool) -> Tensor:
    if halo is None:
        return x
    return torch.cat((x, halo), -1) if reverse else torch.cat((halo, x), -1)


def branch_inputs_fwd(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, d_state, reverse, backend_obj,
                      halo=None):
    """u = silu(conv(x)) (one kernel on GPUs), x_dbl, the scan's delta, B, C (contiguous), for x's tokens, and the
    conv's output before the SiLU where the conv kernel does not fuse it (else None: the GPU kernel recomputes it in
    the backward), which ``branch_inputs_bwd`` takes so that the conv does not run a third time; no autograd (the
    fused branch and the sequence split build on it).

    ``halo`` (batch, d, K-1), optional: the tokens the conv reads beyond x, those before it (with ``reverse``, after
    it), which a chunk of a split sequence takes from its neighbours; without it the conv pads with zeros."""
    xh = _with_halo(x, halo, reverse)
    pre = None
    if _conv_fuses_silu(backend_obj, xh, conv_weight.shape[-1]):
        u = conv_forward(xh, conv_weight, conv_bias, reverse, backend_obj, silu=True)
    else:
        pre = conv_forward(xh, conv_weight, conv_bias, reverse, backend_obj)
        u = F.silu(pre)
    if halo is not None:
        u = u[..., :x.shape[-1]] if reverse else u[..., halo.shape[-1]:]
    u = u.contiguous()
    dt_rank = dt_proj_weight.shape[1]
    x_dbl = project(x_proj_weight.to(u.dtype), u)  # (batch, dt_rank + 2 * d_state, L)
    # dt_proj's bias is added inside the scan
    delta = project(dt_proj_weight.to(u.dtype), x_dbl[:, :dt_rank])
    B = x_dbl[:, dt_rank:dt_rank + d_state].contiguous()
    C = x_dbl[:, dt_rank + d_state:].contiguous()
    return u, x_dbl, delta.contiguous(), B, C, pre


def branch_inputs_bwd(x, u, x_dbl, du, ddelta, dB, dC, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                      reverse, backend_obj, halo=None, pre=None, dx_add_to=None):
    """The scan's input gradients chained back through dt_proj, x_proj, SiLU and the conv: (dx, dhalo or None,
    dconv_weight, dconv_bias or None, dx_proj_weight, ddt_proj_weight), from what ``branch_inputs_fwd`` gave
    (``pre``: its conv output before the SiLU, or None). ``du`` is added into (it holds the skip term's share);
    so is ``dx_add_to`` (without a halo), returned as dx."""
    dt_rank = dt_proj_weight.shape[1]
    ddt_proj_w = _weight_grad(ddelta, x_dbl[:, :dt_rank])
    dx_dbl = torch.cat((project(dt_proj_weight.to(u.dtype).t(), ddelta), dB, dC), dim=1)
    dx_proj_w = _weight_grad(dx_dbl, u)
    # du + x_proj^T @ dx_dbl in one pass: the GEMM adds into du instead of a separate add over (batch, d, L).
    du = torch.baddbmm(du, x_proj_weight.to(u.dtype).t().expand(du.shape[0], -1, -1), dx_dbl)
    dhalo = None
    if halo is not None:  # the halo's steps have no output here: a zero gradient
        h = halo.shape[-1]
        du = F.pad(du, (0, h) if reverse else (h, 0))
    # through the SiLU and the conv (one kernel on GPUs, which recomputes the conv's output for silu')
    dx, dconv_w, dconv_b = conv_backward(_with_halo(x, halo, reverse), conv_weight, conv_bias, du, reverse,
                                         backend_obj, silu=True, pre=pre, dx_add_to=dx_add_to)
    if halo is not None:
        length = x.shape[-1]
        dx, dhalo = (dx[..., :length], dx[..., length:]) if reverse else (dx[..., h:], dx[..., :h])
    return dx, dhalo, dconv_w, dconv_b, dx_proj_w.to(x_proj_weight.dtype), ddt_proj_w.to(dt_proj_weight.dtype)


def _direction_forward(x, z, weights, reverse, impl, add_to=None):
    """One direction of the fused branch: (out, saved); ``add_to``: out is added into it (the kernel adds in its
    store where it can, else one add after) and it is returned as out. weights: conv_weight, conv_bias,
    x_proj_weight, dt_proj_weight, A, D, delta_bias."""
    conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias = weights
    u, _, delta, B, C, _ = branch_inputs_fwd(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A.shape[1],
                                             reverse, impl)
    into = {"add_to": add_to} if add_to is not None and _adds_into(impl) else {}
    out, saved, _ = impl.fwd(u, delta, A, B, C, D, z, delta_bias, True, reverse, **into)
    if add_to is not None and not into:
        out = add_to.add_(out)
    return out.contiguous(), _absent(u) if saved is None else saved


def _direction_backward(dout, x, z, weights, saved, reverse, impl, dx_add_to=None, dz_add_to=None):
    """One direction's gradients: (dx, dz, dconv_weight, dconv_bias or None, dx_proj_weight, ddt_proj_weight, dA,
    dD, ddelta_bias); dx and dz added into ``dx_add_to``, ``dz_add_to`` when given (and returned as them): dx in the
    GPU conv's store, dz after the scan (its store is in the backward's finish, whose registers and loads the
    reverse recurrence shares: adding there cost sm_90's reverse step 3 instructions of 55.5)."""
    conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias = weights
    # Recompute the cheap intermediates (several times the size of x) rather than keep them from forward.
    u, x_dbl, delta, B, C, pre = branch_inputs_fwd(x, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                                                   A.shape[1], reverse, impl)
    du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = impl.bwd(u, delta, A, B, C, D, z, delta_bias,
                                                           dout.to(u.dtype).contiguous(), saved, True, reverse)
    if dz_add_to is not None:
        dz = dz_add_to.add_(dz)
    dx, _, dconv_w, dconv_b, dx_proj_w, ddt_proj_w = branch_inputs_bwd(
        x, u, x_dbl, du, ddelta, dB, dC, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, reverse, impl,
        pre=pre, dx_add_to=dx_add_to)
    return (dx.to(x.dtype), dz.to(z.dtype), dconv_w, dconv_b, dx_proj_w, ddt_proj_w, dA.to(A.dtype), dD.to(D.dtype),
            ddelta_bias.to(delta_bias.dtype))


@custom_op(f"{NAMESPACE}::ssm_branch_fwd", mutates_args=())
def ssm_branch_fwd(x: Tensor, z: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], x_proj_weight: Tensor,
                   dt_proj_weight: Tensor, A: Tensor, D: Tensor, delta_bias: Tensor, reverse: bool,
                   backend: str) -> tuple[Tensor, Tensor]:
    impl = resolve(backend, x.device)
    with _no_autocast(x.device):
        return _direction_forward(x, z, (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias),
                               reverse, impl)


@ssm_branch_fwd.register_fake
def _(x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, reverse, backend):
    return x.new_empty(x.shape), _saved_like(resolve(backend, x.device), x, A)


@custom_op(f"{NAMESPACE}::ssm_branch_bwd", mutates_args=())
def ssm_branch_bwd(dout: Tensor, x: Tensor, z: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                   x_proj_weight: Tensor, dt_proj_weight: Tensor, A: Tensor, D: Tensor, delta_bias: Tensor,
                   saved: Tensor, reverse: bool, backend: str
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dz, dconv_weight, dconv_bias, dx_proj_weight, ddt_proj_weight, dA, dD, ddelta_bias)."""
    impl = resolve(backend, x.device)
    with _no_autocast(x.device):
        grads = _direction_backward(dout, x, z, (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D,
                                              delta_bias), saved, reverse, impl)
    return (*grads[:3], _absent(x) if grads[3] is None else grads[3], *grads[4:])


@ssm_branch_bwd.register_fake
def _(dout, x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, saved, reverse,
      backend):
    like = (x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias)
    return tuple(_absent(x) if t is None else t.new_empty(t.shape) for t in like)


def _branch_setup_context(ctx, inputs, output):
    *tensors, reverse, backend = inputs
    ctx.options = (reverse, backend)
    ctx.mark_non_differentiable(output[1])
    # Only the inputs and the weights (and the GPU kernel's chunk states): the memory a transformer block keeps.
    ctx.save_for_backward(*tensors, output[1])


def _branch_backward(ctx, dout, _dsaved):
    *tensors, saved = ctx.saved_tensors
    grads = ssm_branch_bwd(dout.contiguous(), *tensors, saved, *ctx.options)
    conv_bias = tensors[3]
    return (*grads[:3], None if conv_bias is None else grads[3], *grads[4:], None, None)


ssm_branch_fwd.register_autograd(_branch_backward, setup_context=_branch_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# Both directions of a bidirectional (Vim) mixer
# ---------------------------------------------------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::bimamba_branch_fwd", mutates_args=())
def bimamba_branch_fwd(x: Tensor, z: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], x_proj_weight: Tensor,
                       dt_proj_weight: Tensor, A: Tensor, D: Tensor, delta_bias: Tensor, conv_weight_b: Tensor,
                       conv_bias_b: Optional[Tensor], x_proj_weight_b: Tensor, dt_proj_weight_b: Tensor, A_b: Tensor,
                       D_b: Tensor, delta_bias_b: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (the two directions' outputs summed, each direction's saved state): the backward direction (``_b``
    weights) scans the same x and z back to front and adds its output into the forward's, in the scan's store on
    GPUs (no separate pass over the sum)."""
    impl = resolve(backend, x.device)
    with _no_autocast(x.device):
        out, saved = _direction_forward(x, z, (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D,
                                               delta_bias), False, impl)
        out, saved_b = _direction_forward(x, z, (conv_weight_b, conv_bias_b, x_proj_weight_b, dt_proj_weight_b, A_b,
                                                 D_b, delta_bias_b), True, impl, add_to=out)
    return out, saved, saved_b


@bimamba_branch_fwd.register_fake
def _(x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, conv_weight_b, conv_bias_b,
      x_proj_weight_b, dt_proj_weight_b, A_b, D_b, delta_bias_b, backend):
    impl = resolve(backend, x.device)
    return x.new_empty(x.shape), _saved_like(impl, x, A), _saved_like(impl, x, A_b)


@custom_op(f"{NAMESPACE}::bimamba_branch_bwd", mutates_args=())
def bimamba_branch_bwd(dout: Tensor, x: Tensor, z: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                       x_proj_weight: Tensor, dt_proj_weight: Tensor, A: Tensor, D: Tensor, delta_bias: Tensor,
                       conv_weight_b: Tensor, conv_bias_b: Optional[Tensor], x_proj_weight_b: Tensor,
                       dt_proj_weight_b: Tensor, A_b: Tensor, D_b: Tensor, delta_bias_b: Tensor, saved: Tensor,
                       saved_b: Tensor, backend: str) -> typing.List[Tensor]:
    """(dx, dz, then the forward direction's 7 weight gradients, then the backward direction's): the second
    direction's dx and dz are added into the first's (dx in the conv's store on GPUs). (typing.List: torch 2.4's
    schema inference knows no list[Tensor].)"""
    impl = resolve(backend, x.device)
    with _no_autocast(x.device):
        grads_b = _direction_backward(dout, x, z, (conv_weight_b, conv_bias_b, x_proj_weight_b, dt_proj_weight_b, A_b,
                                                   D_b, delta_bias_b), saved_b, True, impl)
        dx, dz = grads_b[0].contiguous(), grads_b[1].contiguous()
        grads_f = _direction_backward(dout, x, z, (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D,
                                                   delta_bias), saved, False, impl, dx_add_to=dx, dz_add_to=dz)
    weights = [g if g is not None else _absent(x) for g in (*grads_f[2:], *grads_b[2:])]
    return [grads_f[0], grads_f[1], *weights]


@bimamba_branch_bwd.register_fake
def _(dout, x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, conv_weight_b,
      conv_bias_b, x_proj_weight_b, dt_proj_weight_b, A_b, D_b, delta_bias_b, saved, saved_b, backend):
    like = (x, z, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, delta_bias, conv_weight_b, conv_bias_b,
            x_proj_weight_b, dt_proj_weight_b, A_b, D_b, delta_bias_b)
    return [_absent(x) if t is None else t.new_empty(t.shape) for t in like]


def _bimamba_setup_context(ctx, inputs, output):
    *tensors, backend = inputs
    ctx.backend = backend
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(*tensors, output[1], output[2])


def _bimamba_backward(ctx, dout, _dsaved, _dsaved_b):
    *tensors, saved, saved_b = ctx.saved_tensors
    grads = bimamba_branch_bwd(dout.contiguous(), *tensors, saved, saved_b, ctx.backend)
    # a conv without bias has no gradient (index 3: the forward direction's conv bias, 10: the backward's)
    return (*[None if t is None else g for g, t in zip(grads, tensors)], None)


bimamba_branch_fwd.register_autograd(_bimamba_backward, setup_context=_bimamba_setup_context)
