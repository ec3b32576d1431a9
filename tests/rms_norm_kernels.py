"""The fused residual add + RMSNorm kernels (vim_ds/ops/rms_norm_triton.py) against a float64 reference written here
from the formula, forward and every gradient, on fresh random inputs.

Run by tests/test_rms_norm.py in a process of its own: on CPU tensors under TRITON_INTERPRET=1 (Triton's
interpreter, which must be chosen before triton is imported, and `import torch` imports it), and on a GPU as is.
The cases take each branch of the kernels both ways: with and without a residual, with and without the stream's
gradient from downstream, rows shorter than the kernel's block (masked) and exactly as long, one program's run of
rows and several (an uneven split), rows where eps dominates (a zero row, tiny values) and where it does not."""
from __future__ import annotations

import pytest
import torch

from vim_ds.ops import rms_norm_triton
from vim_ds.ops.rms_norm import add_rms_norm, add_rms_norm_fwd

if rms_norm_triton.interpreted():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("neither TRITON_INTERPRET=1 nor a GPU", allow_module_level=True)

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
EPS = 1e-5
# (leading shape, dim, hidden dtype, residual dtype or None, weight dtype, stochastic depth's per-sample scale):
# DeepSpeed's bf16 (bf16 hidden and weight, fp32 stream), fp32, fp64, the first block (no residual), fp16 autocast
# with fp32 weights, a row exactly a block, and the blocks' stochastic depth (a sample dropped, the others kept and
# scaled by 1 / keep) in bf16 and fp64
CASES = [((2, 7), 48, BF16, F32, BF16, False), ((3, 5), 40, F32, F32, F32, False), ((2, 9), 24, F64, F64, F64, False),
         ((1, 13), 32, BF16, None, BF16, False), ((4, 3), 100, F16, F32, F32, False), ((6,), 64, F32, F32, F32, False),
         ((3, 5), 48, BF16, F32, BF16, True), ((3, 4), 24, F64, F64, F64, True)]
# the relative error a result in each dtype may have beside the float64 reference (its rounding, plus fp32 sums)
REL = {BF16: 2 ** -7, F16: 2 ** -10, F32: 2e-6, F64: 1e-13}


def sample_scale(shape, dtype, scaled):
    """None, or stochastic depth's per-sample scale (mask / keep, keep 0.8) with the last sample dropped (in hidden's
    dtype, as timm's DropPath makes it; sample 0 holds the rows where eps matters)."""
    if not scaled:
        return None
    scale = torch.full((shape[0],), 1 / 0.8, dtype=F64)
    scale[-1] = 0
    return scale.to(dtype).to(DEVICE)


def inputs(shape, dim, hidden_dtype, residual_dtype, weight_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, dim, generator=g, dtype=F64) * 2
    residual = None if residual_dtype is None else torch.randn(*shape, dim, generator=g, dtype=F64) * 3
    weight = torch.randn(dim, generator=g, dtype=F64) + 1
    # rows where eps matters: the first all zeros, the second tiny (mean square 1e-8 beside eps 1e-5)
    flat = hidden.view(-1, dim)
    flat[0] = 0
    if flat.shape[0] > 1:
        flat[1] *= 1e-4
    if residual is not None:
        residual.view(-1, dim)[:2] = 0
    return (hidden.to(hidden_dtype).to(DEVICE), None if residual is None else residual.to(residual_dtype).to(DEVICE),
            weight.to(weight_dtype).to(DEVICE))


def reference(hidden, residual, weight, eps=EPS, *, eps_outside=False, scale=None):
    """float64, from the formula: stream = residual + hidden * scale (each sample's); normed = stream /
    sqrt(mean(stream^2) + eps) * weight. ``eps_outside``: the bug of adding eps after the root (the negative
    control)."""
    if scale is not None:
        hidden = hidden.double() * scale.double().cpu().view((-1,) + (1,) * (hidden.dim() - 1)).to(hidden.device)
    stream = hidden.double() + (0 if residual is None else residual.double())
    ms = stream.pow(2).mean(-1, keepdim=True)
    y = stream / (ms.sqrt() + eps) if eps_outside else stream / torch.sqrt(ms + eps)
    return y * weight.double(), stream


def close(got, want, dtype, scale=None) -> bool:
    """Every element within REL[dtype] of the reference, relative to the element (or to `scale`: sums)."""
    want = want.double().cpu()
    bound = REL[dtype] * (want.abs() if scale is None else scale) + 1e-30
    return bool(((got.double().cpu() - want).abs() <= bound).all())


def stream_dtype(hidden, residual):
    t = hidden.dtype if residual is None else torch.promote_types(hidden.dtype, residual.dtype)
    return torch.promote_types(t, F32)


@pytest.mark.parametrize("shape, dim, hd, rd, wd, scaled", CASES)
def test_forward(shape, dim, hd, rd, wd, scaled):
    hidden, residual, weight = inputs(shape, dim, hd, rd, wd, seed=dim)
    scale = sample_scale(shape, hd, scaled)
    normed, stream, rstd = add_rms_norm_fwd(hidden, residual, weight, EPS, scale)
    want_normed, want_stream = reference(hidden, residual, weight, scale=scale)
    assert normed.dtype == wd and stream.dtype == stream_dtype(hidden, residual) and normed.shape == hidden.shape
    if scaled:  # the product in the stream's precision, then the add: at most the sum's one rounding off
        assert close(stream, want_stream, stream.dtype)
        assert not close(stream, reference(hidden, residual, weight)[1], stream.dtype)  # control: no scale
    else:  # the stream is the same one rounding as torch's own add
        torch_stream = hidden.to(stream.dtype) if residual is None else (residual + hidden).to(stream.dtype)
        assert torch.equal(stream, torch_stream)
    assert close(normed, want_normed, wd)
    ms = want_stream.pow(2).mean(-1).flatten()
    assert close(rstd, torch.rsqrt(ms + EPS), stream.dtype)
    assert rstd[0].item() == pytest.approx(EPS ** -0.5, rel=1e-6)  # the zero row: eps alone
    # negative control: eps after the root changes the rows where eps matters beyond the tolerance
    assert not close(normed, reference(hidden, residual, weight, eps_outside=True, scale=scale)[0], wd)


@pytest.mark.parametrize("shape, dim, hd, rd, wd, scaled", CASES)
@pytest.mark.parametrize("downstream", [True, False])
def test_backward(shape, dim, hd, rd, wd, scaled, downstream):
    """Every gradient through the registered autograd, against float64 autograd of the reference at the same
    (rounded) inputs and output gradients; the stream's gradient from downstream added in, or absent (None)."""
    hidden, residual, weight = inputs(shape, dim, hd, rd, wd, seed=dim + 1)
    scale = sample_scale(shape, hd, scaled)
    g = torch.Generator().manual_seed(dim + 2)
    dnormed = torch.randn(*shape, dim, generator=g, dtype=F64).to(wd).to(DEVICE)
    dstream = torch.randn(*shape, dim, generator=g, dtype=F64).to(stream_dtype(hidden, residual)).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((residual,) if rd else ())]
    normed, stream = add_rms_norm(leaves[0], leaves[2] if rd else None, leaves[1], EPS, backend="triton",
                                  scale=scale)
    outs, grads = ((normed, stream), (dnormed, dstream)) if downstream else ((normed,), (dnormed,))
    got = torch.autograd.grad(outs, leaves, grads)

    leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    normed64, stream64 = reference(leaves64[0], leaves64[2] if rd else None, leaves64[1], scale=scale)
    loss = (normed64 * dnormed.double().cpu()).sum() + ((stream64 * dstream.double().cpu()).sum() if downstream else 0)
    want = torch.autograd.grad(loss, leaves64)
    assert [t.dtype for t in got] == [t.dtype for t in leaves]
    # d hidden and d residual: each row's entries come from sums over the row, so their errors are relative to the
    # row's largest; d weight: a sum over the rows, relative to the sum of its terms' magnitudes
    dnormed64, dstream64 = dnormed.double().cpu(), dstream.double().cpu()
    stream64 = stream64.detach()
    rstd64 = 1 / stream64.pow(2).mean(-1, keepdim=True).add(EPS).sqrt()
    # (d hidden is the stream's gradient times the sample's scale: judged on the stream gradient's rows)
    dstream_want = want[2] if rd else want[0]
    row_scale = dstream_want.abs().amax(-1, keepdim=True).expand_as(want[0])
    dw_scale = (dnormed64 * stream64 * rstd64).abs().reshape(-1, dim).sum(0)
    assert close(got[0], want[0], hd, row_scale)
    if rd:
        assert close(got[2], want[2], stream_dtype(hidden, residual), row_scale)
    assert close(got[1], want[1], wd, dw_scale)
    # negative control: without the norm's projection term (- xhat * mean(xhat * w * dy)) the input gradients
    # leave the tolerance
    wrong = dnormed64 * leaves64[1].detach() * rstd64 + (dstream64 if downstream else 0)
    if scale is not None:
        wrong = wrong * scale.double().cpu().view((-1,) + (1,) * (wrong.dim() - 1))
    assert not close(got[0], wrong, hd, row_scale)


def test_gradcheck_float64():
    """First principles: finite differences of the kernel itself (float64), every input."""
    hidden, residual, weight = inputs((2, 3), 8, F64, F64, F64, seed=3)
    hidden[0, 0] += 0.5  # no zero row: the finite differences need a smooth neighbourhood
    args = [t.detach().clone().requires_grad_() for t in (hidden, residual, weight)]

    def f(h, r, w):
        return add_rms_norm(h, r, w, EPS, backend="triton")

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


def test_many_rows_a_program_and_an_uneven_split():
    """More rows than programs, not a multiple of them: every row's gradient and the weight's whole sum."""
    rows = 4 * 3 + 1 if DEVICE == "cpu" else rms_norm_triton._programs(10 ** 6, torch.device(DEVICE)) * 3 + 1
    hidden, residual, weight = inputs((rows,), 16, F64, F64, F64, seed=5)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, residual, weight)]
    normed, _ = add_rms_norm(leaves[0], leaves[1], leaves[2], EPS, backend="triton")
    got = torch.autograd.grad(normed.sum(), leaves)
    leaves64 = [t.detach().cpu().requires_grad_() for t in leaves]
    want = torch.autograd.grad(reference(leaves64[0], leaves64[1], leaves64[2])[0].sum(), leaves64)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)


def test_empty_and_too_wide():
    hidden = torch.empty(0, 5, 32, device=DEVICE)
    normed, stream, rstd = add_rms_norm_fwd(hidden, hidden, torch.ones(32, device=DEVICE), EPS)
    assert normed.shape == stream.shape == (0, 5, 32) and rstd.shape == (0,)
    wide = rms_norm_triton.MAX_DIM + 1
    with pytest.raises(ValueError, match="rows of 16385 elements"):
        add_rms_norm_fwd(torch.ones(1, wide, device=DEVICE), None, torch.ones(wide, device=DEVICE), EPS)


def test_opcheck_and_compile():
    """The registered ops' schemas, fake implementations and autograd (torch.library.opcheck), and the fused op
    under torch.compile(fullgraph=True) (one opaque node), equal to eager."""
    hidden, residual, weight = inputs((2, 3), 24, F32, F32, F32, seed=7)
    args = [t.detach().clone().requires_grad_() for t in (hidden, residual, weight)]
    torch.library.opcheck(add_rms_norm_fwd, (*args, EPS))

    def f(h, r, w):
        normed, stream = add_rms_norm(h, r, w, EPS, backend="triton")
        return normed.sum() + 2 * stream.sum()

    eager = torch.autograd.grad(f(*args), args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*args), args)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def test_the_model_with_the_kernels_is_the_model_without(monkeypatch):
    """A small Vim in float64, training mode with stochastic depth (the same seed: the same masks): logits, the
    intermediates (the stream after each block) and every parameter's gradient with the kernels (VIM_DS_NORM=triton)
    against PyTorch's composition (ref); the kernels ran for every block's add and norm and the final one."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", depth=3, embed_dim=32, patch_size=8, stride=8, img_size=32, num_classes=5,
                              drop_path_rate=0.4).double().to(DEVICE).train()
    x = torch.randn(2, 3, 32, 32, dtype=F64, device=DEVICE)
    calls = []
    forward = rms_norm_triton.forward
    monkeypatch.setattr(rms_norm_triton, "forward", lambda *a: calls.append(1) or forward(*a))

    def run(backend):
        monkeypatch.setenv("VIM_DS_NORM", backend)
        model.zero_grad()
        torch.manual_seed(1)
        logits = model(x)
        logits.logsumexp(-1).sum().backward()
        torch.manual_seed(1)
        with torch.no_grad():
            _, streams = model.forward_intermediates(x, output_fmt="NLC")
        return [logits.detach(), *streams] + [p.grad.clone() for p in model.parameters()]

    with_kernels = run("triton")
    assert len(calls) == 2 * (3 + 1)
    calls.clear()
    without = run("ref")
    assert not calls
    for a, b in zip(with_kernels, without):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the comparison can tell: other stochastic-depth masks give other gradients
    torch.manual_seed(2)
    other = model(x).logsumexp(-1).sum()
    assert abs(other.item() - with_kernels[0].logsumexp(-1).sum().item()) > 1e-6


def test_the_bench_times_the_kernel_beside_pytorchs_composition():
    """`vim-ds bench scan`'s row for the blocks' add and norm (on a GPU; here through the interpreter, a tiny shape):
    both backends timed forward and forward+backward, and their normalised rows agree to bf16's rounding."""
    from vim_ds.cli.bench import scan

    (row,) = scan.run_norm((2, 9, 32), 1, DEVICE)
    assert row["op"] == "add_rms_norm" and row["shape"] == "B=2 L=9 D=32" and row["dtype"] == "bfloat16"
    assert all(row[k] > 0 for k in ("kernel_fwd_ms", "kernel_fwd_bwd_ms", "ref_fwd_ms", "ref_fwd_bwd_ms"))
    assert row["speedup_fwd"] == pytest.approx(row["ref_fwd_ms"] / row["kernel_fwd_ms"])
    assert 0 <= row["max_abs_diff"] <= 2 ** -7 * 8  # (normed rows of magnitude up to ~4 in bf16)
