"""A stand-in for mamba_ssm's compiled kernel module ``selective_scan_cuda``, built on our pure-PyTorch reference.

It is a stand-in because mamba_ssm cannot be built without a GPU here (its setup compiles CUDA code with nvcc); the
GPU test in tests/test_mamba_backend.py runs the real module where it is installed. What it imitates is the module's
calling contract, as mamba_ssm's ``mamba_ssm/ops/selective_scan_interface.py`` uses it and its C++ entry points
check it:

    fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus) -> [out, x] + ([out_z] if z is given)
    bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z)
        -> [du, ddelta, dA, dB, dC, dD, ddelta_bias] + ([dz] if z is given)

with B and C 4-D (batch, groups, d_state, seqlen), ``out`` the result before the gate, ``out_z`` after it, ``x``
(batch, dim, ceil(seqlen / 2048), 2 * d_state) in A's dtype holding a (decay product, state) pair per state at the
end of each 2048-step chunk; bwd needs ``x`` and, with z, ``out`` (dz is computed from the ``out`` it is given, as the
real kernel reads it); dB, dC come back 4-D in B's and C's dtype; dD and ddelta_bias None when D and delta_bias are.
It checks what the real module checks (shapes, dtypes, the unit-stride last dimension) and, beyond that, that
``x``'s last states are those of these inputs, so that a caller that hands back the wrong ``x`` fails.

``swap=("B", "C")`` makes a deliberately wrong variant that reads two arguments in each other's place (the
negative control of the adapter's tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vim_ds.ops.backends import _autograd_recording
from vim_ds.ops.selective_scan_ref import selective_scan_ref

CHUNK = 2048
FWD_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


class SelectiveScanCudaStandIn:
    def __init__(self, swap=None):
        self.swap = swap
        self.calls = []

    def _args(self, values):
        d = dict(zip(FWD_ARGS, values))
        if self.swap:
            a, b = self.swap
            d[a], d[b] = d[b], d[a]
        return [d[k] for k in FWD_ARGS]

    @staticmethod
    def _check(u, delta, A, B, C, D, z, delta_bias):
        batch, dim, seqlen = u.shape
        N = A.shape[1]
        for name, t, shape in (("u", u, (batch, dim, seqlen)), ("delta", delta, (batch, dim, seqlen)),
                               ("B", B, (batch, 1, N, seqlen)), ("C", C, (batch, 1, N, seqlen)),
                               ("z", z, (batch, dim, seqlen))):
            if t is None:
                continue
            assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, expected {shape}"
            assert t.dtype == u.dtype, f"{name}: dtype {t.dtype}, expected the input type {u.dtype}"
            assert t.stride(-1) == 1, f"{name} must have a contiguous last dimension"
        assert A.dtype in (torch.float32, torch.float64) and A.shape == (dim, N)
        for name, t in (("D", D), ("delta_bias", delta_bias)):
            assert t is None or (t.dtype == A.dtype and tuple(t.shape) == (dim,)), f"{name}: {t.dtype} {t.shape}"

    def _states(self, u, delta, A, B, C, delta_bias, delta_softplus):
        """x: (decay product over the chunk, state) at the end of every chunk."""
        batch, dim, seqlen = u.shape
        N = A.shape[1]
        n_chunks = -(-seqlen // CHUNK)
        x = torch.empty(batch, dim, n_chunks, 2 * N, dtype=A.dtype)
        dl = delta.to(A.dtype) + (0 if delta_bias is None else delta_bias[:, None])
        dl = F.softplus(dl) if delta_softplus else dl
        for c in range(n_chunks):
            end = min(seqlen, (c + 1) * CHUNK)
            _, h = selective_scan_ref(u[..., :end], delta[..., :end], A, B[:, 0, :, :end], C[:, 0, :, :end], None,
                                      None, delta_bias, delta_softplus, True)
            x[:, :, c, 1::2] = h
            x[:, :, c, 0::2] = torch.exp(dl[..., c * CHUNK:end].sum(-1)[..., None] * A)
        return x

    def fwd(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        self.calls.append("fwd")
        u, delta, A, B, C, D, z, delta_bias = self._args([u, delta, A, B, C, D, z, delta_bias])
        self._check(u, delta, A, B, C, D, z, delta_bias)
        out = selective_scan_ref(u, delta, A, B[:, 0], C[:, 0], D, None, delta_bias, delta_softplus)
        x = self._states(u, delta, A, B, C, delta_bias, delta_softplus)
        if z is None:
            return [out, x]
        acc = torch.float64 if u.dtype == torch.float64 else torch.float32
        return [out, x, (out.to(acc) * F.silu(z.to(acc))).to(u.dtype)]

    def bwd(self, u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
        self.calls.append("bwd")
        u, delta, A, B, C, D, z, delta_bias = self._args([u, delta, A, B, C, D, z, delta_bias])
        self._check(u, delta, A, B, C, D, z, delta_bias)
        assert dout.shape == u.shape and dout.dtype == u.dtype and dout.stride(-1) == 1
        expected_x = self._states(u, delta, A, B, C, delta_bias, delta_softplus)
        assert x is not None and x.shape == expected_x.shape and x.dtype == A.dtype, "x: wrong shape or dtype"
        assert torch.equal(x[..., 1::2], expected_x[..., 1::2]), "x: not the states of these inputs"
        acc = torch.float64 if u.dtype == torch.float64 else torch.float32
        if z is not None:
            assert out is not None and out.shape == u.shape and out.dtype == u.dtype, "out is required with z"
            sz = torch.sigmoid(z.to(acc))
            dy = dout.to(acc) * z.to(acc) * sz
            dz_ = (dout.to(acc) * out.to(acc) * sz * (1 + z.to(acc) * (1 - sz))).to(u.dtype)
        else:
            dy = dout.to(acc)
        leaves = [None if t is None else t.detach().requires_grad_(True)
                  for t in (u, delta, A, B[:, 0], C[:, 0], D, delta_bias)]
        # Called inside a registered op, where the dispatcher has switched autograd off: switch it back on for the
        # reference's gradients (the real module computes them in CUDA code).
        with _autograd_recording(), torch.enable_grad():
            y = selective_scan_ref(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], None, leaves[6],
                                   delta_softplus)
            present = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(y.to(acc), present, dy))
        du, ddelta, dA, dB, dC, dD, ddb = [None if t is None else next(grads) for t in leaves]
        result = [du.to(u.dtype), ddelta.to(u.dtype), dA, dB.unsqueeze(1).to(B.dtype), dC.unsqueeze(1).to(C.dtype),
                  dD, ddb]
        if z is not None:
            result.append(dz_)
        if recompute_out_z:
            result.append((out.to(acc) * z.to(acc) * torch.sigmoid(z.to(acc))).to(u.dtype))
        return result
