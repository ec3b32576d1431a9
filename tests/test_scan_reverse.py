"""Reverse mode of the selective scan, the causal conv and the fused SSM branch (Vim's backward direction).

``reverse=True`` must equal flipping every time-indexed input and the output: bitwise where the kernel runs the
same operations in the same order (the CPU kernel, the CPU conv, the reference), and within tolerance of the
float64 reference everywhere.
"""
import pytest
import torch

from vim_ds.ops import selective_scan_fn
from vim_ds.ops.backends import RefBackend, load
from vim_ds.ops.selective_scan import scan_with_backend
from vim_ds.ops.selective_scan_ref import selective_scan_ref
from vim_ds.ops.ssm_branch import ssm_branch_fn

NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
TIME_INDEXED = {"u", "delta", "B", "C", "z"}


def cpu_backend():
    loaded = load("cpu")
    if loaded.backend is None:
        pytest.skip(f"cpu kernel unavailable: {loaded.reason}")
    return loaded.backend


def inputs(dtype, batch=2, dim=5, L=37, N=16, seed=0, flags=(True, True, True)):
    g = torch.Generator().manual_seed(seed)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u, z = r(batch, dim, L).to(dtype), r(batch, dim, L).to(dtype)
    delta = (0.5 * r(batch, dim, L)).to(dtype)
    B, C = r(batch, N, L).to(dtype), r(batch, N, L).to(dtype)
    A = -(torch.rand(dim, N, generator=g, dtype=torch.float64) * 2 + 0.1).to(wide)
    D, bias = r(dim).to(wide), (0.3 * r(dim)).to(wide)
    has_D, has_z, has_bias = flags
    return [u, delta, A, B, C, D if has_D else None, z if has_z else None, bias if has_bias else None]


def flipped(args):
    return [a.flip(-1) if (a is not None and n in TIME_INDEXED) else a for n, a in zip(NAMES, args)]


def run(backend, args, dout, reverse):
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    out = scan_with_backend(backend, *leaves, delta_softplus=True, reverse=reverse)
    out.backward(dout)
    return out.detach(), [None if a is None else a.grad for a in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("flags", [(True, True, True), (False, False, False)])
def test_cpu_reverse_is_bitwise_flip(dtype, flags, cpu_isa):
    backend = cpu_backend()
    args = inputs(dtype, flags=flags)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    out_r, grads_r = run(backend, args, dout, reverse=True)
    out_f, grads_f = run(backend, flipped(args), dout.flip(-1), reverse=False)
    assert torch.equal(out_r, out_f.flip(-1))
    for name, a, b in zip(NAMES, grads_r, grads_f):
        if a is None:
            assert b is None, name
            continue
        assert torch.equal(a, b.flip(-1) if name in TIME_INDEXED else b), name


def test_ref_reverse_is_bitwise_flip():
    args = inputs(torch.float64, L=13)
    out_r = selective_scan_ref(*args, delta_softplus=True, reverse=True)
    out_f = selective_scan_ref(*flipped(args), delta_softplus=True)
    assert torch.equal(out_r, out_f.flip(-1))


@pytest.mark.parametrize("L", [1, 2, 7, 64, 197])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_reverse_vs_float64_reference(L, dtype, cpu_isa):
    backend = cpu_backend()
    args = inputs(dtype, batch=2, dim=3, L=L, N=17, seed=L)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, grads = run(backend, args, dout, reverse=True)
    ref_args = [None if a is None else a.double() for a in args]
    ref_out, ref_grads = run(RefBackend(), ref_args, dout.double(), reverse=True)
    tol = 1e-11 if dtype == torch.float64 else 5e-5
    for name, a, b in [("out", out, ref_out)] + list(zip(NAMES, grads, ref_grads)):
        err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: rel err {err:.3g}"


def test_reference_reverse_recurrence():
    """reverse really runs h[t] = exp(dl[t] A) h[t+1] + dl[t] B[t] u[t], independently of the flip identity."""
    u, delta, A, B, C, *_ = inputs(torch.float64, batch=1, dim=1, L=5, N=2, seed=3)
    out = selective_scan_ref(u, delta, A, B, C, reverse=True)
    h = torch.zeros(2, dtype=torch.float64)
    want = torch.empty(5, dtype=torch.float64)
    for t in range(4, -1, -1):
        h = torch.exp(delta[0, 0, t] * A[0]) * h + delta[0, 0, t] * B[0, :, t] * u[0, 0, t]
        want[t] = (h * C[0, :, t]).sum()
    torch.testing.assert_close(out[0, 0], want, rtol=1e-14, atol=1e-14)


def test_selective_scan_fn_reverse_keyword():
    args = inputs(torch.float32, L=9)
    out = selective_scan_fn(*args, delta_softplus=True, reverse=True)
    want = selective_scan_fn(*flipped(args), delta_softplus=True).flip(-1)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def branch_args(dtype, L=23, d_inner=6, d_state=4, dt_rank=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [r(2, d_inner, L).to(dtype), r(2, d_inner, L).to(dtype), (0.5 * r(d_inner, 1, 4)).to(dtype),
            (0.1 * r(d_inner)).to(dtype), (0.3 * r(dt_rank + 2 * d_state, d_inner)).to(dtype),
            (0.3 * r(d_inner, dt_rank)).to(dtype), -(torch.rand(d_inner, d_state, generator=g) + 0.5).to(wide),
            r(d_inner).to(wide), (0.1 * r(d_inner)).to(wide)]


def run_branch(args, dout, reverse):
    leaves = [a.clone().requires_grad_(True) for a in args]
    out = ssm_branch_fn(*leaves, reverse=reverse)
    out.backward(dout)
    return out.detach(), [a.grad for a in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ssm_branch_reverse_matches_flip(dtype, monkeypatch):
    """The fused branch on the cpu backend: conv and scan are bitwise; the projections are matmuls on flipped
    (differently laid out) data, so the whole branch is compared within rounding."""
    cpu_backend()
    monkeypatch.setenv("VIM_DS_SCAN", "cpu")
    args = branch_args(dtype)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out_r, grads_r = run_branch(args, dout, True)
    fl = [args[0].flip(-1), args[1].flip(-1)] + args[2:]
    out_f, grads_f = run_branch(fl, dout.flip(-1), False)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out_r, out_f.flip(-1), **tol)
    for i, (a, b) in enumerate(zip(grads_r, grads_f)):
        torch.testing.assert_close(a, b.flip(-1) if i < 2 else b, **tol)


def test_ssm_branch_reverse_ref_backend(monkeypatch):
    """The generic path (F.conv1d with flipped taps, as on GPUs) against flipping, on the reference backend."""
    monkeypatch.setenv("VIM_DS_SCAN", "ref")
    args = branch_args(torch.float64, L=11)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out_r, grads_r = run_branch(args, dout, True)
    out_f, grads_f = run_branch([args[0].flip(-1), args[1].flip(-1)] + args[2:], dout.flip(-1), False)
    torch.testing.assert_close(out_r, out_f.flip(-1), rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(grads_r, grads_f)):
        torch.testing.assert_close(a, b.flip(-1) if i < 2 else b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_conv_reverse_is_bitwise_flip(dtype):
    module = cpu_backend().module
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 19, generator=g).to(dtype)
    w, b = torch.randn(7, 4, generator=g), torch.randn(7, generator=g)
    dout = torch.randn(2, 7, 19, generator=g).to(dtype)
    assert torch.equal(module.conv_fwd(x, w, b, True), module.conv_fwd(x.flip(-1).contiguous(), w, b).flip(-1))
    dx_r, dw_r, db_r = module.conv_bwd(x, w, b, dout, True)
    dx_f, dw_f, db_f = module.conv_bwd(x.flip(-1).contiguous(), w, b, dout.flip(-1).contiguous())
    assert torch.equal(dx_r, dx_f.flip(-1)) and torch.equal(dw_r, dw_f) and torch.equal(db_r, db_f)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 7, 197, 1025, 4097])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpu_reverse_matches_flip_and_reference(L, dtype):
    """The GPU kernel's reverse mode: bitwise equal to flipping (same operations), and close to the reference."""
    loaded = load("cuda")
    if loaded.backend is None:
        pytest.skip(f"cuda kernel unavailable: {loaded.reason}")
    backend = loaded.backend
    args = [None if a is None else a.cuda() for a in inputs(dtype, batch=2, dim=40, L=L, N=16, seed=L)]
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1)).to(dtype).cuda()
    out_r, grads_r = run(backend, args, dout, reverse=True)
    out_f, grads_f = run(backend, flipped(args), dout.flip(-1), reverse=False)
    assert torch.equal(out_r, out_f.flip(-1))
    for name, a, b in zip(NAMES, grads_r, grads_f):
        if name in ("u", "delta", "z"):  # written once per element, no atomics: bitwise
            assert torch.equal(a, b.flip(-1)), name
    ref_args = [None if a is None else a.double() for a in args]
    ref_out, ref_grads = run(RefBackend(), ref_args, dout.double(), reverse=True)
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    for name, a, b in [("out", out_r, ref_out)] + list(zip(NAMES, grads_r, ref_grads)):
        err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: rel err {err:.3g}"
