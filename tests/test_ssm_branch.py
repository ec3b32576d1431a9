"""The fused mixer branch (conv1d + projections + scan + gate, recomputed in backward) against plain autograd."""
import pytest
import torch
import torch.nn.functional as F

from vim_ds.ops import selective_scan_ref, ssm_branch_fn
from vim_ds.ops.ssm_branch import branch_inputs


def unfused(x, z, conv_w, conv_b, xproj_w, dtproj_w, A, D, delta_bias):
    """The same computation with every intermediate kept by autograd, on the pure-PyTorch reference scan."""
    u, delta, B, C = branch_inputs(x, conv_w, conv_b, xproj_w, dtproj_w, A.shape[1])
    return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)


def weights(d_inner=8, dt_rank=3, d_state=16, d_conv=4, dtype=torch.float64):
    g = dict(dtype=dtype)
    return [
        0.5 * torch.randn(d_inner, 1, d_conv, **g), 0.1 * torch.randn(d_inner, **g),
        0.3 * torch.randn(dt_rank + 2 * d_state, d_inner, **g), 0.5 * torch.randn(d_inner, dt_rank, **g),
        -torch.exp(0.3 * torch.randn(d_inner, d_state, **g)), torch.randn(d_inner, **g),
        0.3 * torch.randn(d_inner, **g),
    ]


def _check_fused_branch(seqlen, device="cpu"):
    x, z = torch.randn(2, 8, seqlen, dtype=torch.float64), torch.randn(2, 8, seqlen, dtype=torch.float64)
    args = [t.to(device) for t in [x, z] + weights()]
    leaves_a = [a.clone().requires_grad_(True) for a in args]
    leaves_b = [a.clone().requires_grad_(True) for a in args]
    dout = torch.randn(2, 8, seqlen, dtype=torch.float64).to(device)
    out_a = ssm_branch_fn(*leaves_a)
    out_a.backward(dout)
    out_b = unfused(*leaves_b)
    out_b.backward(dout)
    torch.testing.assert_close(out_a, out_b, rtol=1e-10, atol=1e-12)
    names = ["x", "z", "conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight", "A", "D", "delta_bias"]
    for name, a, b in zip(names, leaves_a, leaves_b):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("seqlen", [1, 5, 65])
def test_fused_branch_matches_unfused_float64(backend, seqlen, monkeypatch, seed):
    monkeypatch.setenv("VIM_DS_SCAN", backend)
    _check_fused_branch(seqlen)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1, 5, 65, 785])
def test_fused_branch_on_the_gpu_matches_unfused_float64(seqlen, monkeypatch, seed):
    """The branch on the GPU kernels, its conv's SiLU fused in the kernel (forward: silu(conv); backward: silu'
    from the conv's output recomputed in the kernel), against autograd through the unfused composition."""
    monkeypatch.delenv("VIM_DS_SCAN", raising=False)
    _check_fused_branch(seqlen, device="cuda")


def test_fused_branch_keeps_only_its_inputs_for_backward(monkeypatch):
    """Memory: the autograd graph holds x, z and the weights, not the conv/projection intermediates."""
    monkeypatch.setenv("VIM_DS_SCAN", "cpu")
    x, z = torch.randn(2, 8, 50, requires_grad=True), torch.randn(2, 8, 50, requires_grad=True)
    out = ssm_branch_fn(x, z, *[w.float().requires_grad_(True) for w in weights()])
    saved = out.grad_fn.saved_tensors
    big = sorted(t.data_ptr() for t in saved if t.numel() >= x.numel())
    assert big == sorted([x.data_ptr(), z.data_ptr()])


@pytest.mark.parametrize("backend", ["cpu", "ref"])
def test_unfused_branch_backward_runs_the_conv_once(backend, monkeypatch, seed):
    """Where the conv kernel does not fuse the SiLU (the CPU kernel, PyTorch's conv of the `ref` and `mamba`
    backends), the branch's backward recomputes the conv once, for u and for the SiLU's gradient alike (the
    pre-activation from branch_inputs_fwd): it ran it twice, the second time inside conv_backward. Same bits as
    that second run: the gradients equal those with the pre-activation dropped (conv_backward recomputes it)."""
    from vim_ds.ops import library

    monkeypatch.setenv("VIM_DS_SCAN", backend)
    calls = []
    conv_forward = library.conv_forward
    monkeypatch.setattr(library, "conv_forward", lambda *a, **kw: calls.append(kw) or conv_forward(*a, **kw))
    x, z = torch.randn(2, 8, 50, requires_grad=True), torch.randn(2, 8, 50, requires_grad=True)
    w = [t.float().requires_grad_(True) for t in weights()]
    out = ssm_branch_fn(x, z, *w)
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2 and not any(kw.get("silu") for kw in calls)  # the CPU kernel and ref: no fused SiLU
    grads = [t.grad.clone() for t in (x, z, *w) if t.grad is not None]
    # the gradients when conv_backward recomputes the conv itself (the pre-activation not passed on)
    branch_bwd = library.branch_inputs_bwd
    monkeypatch.setattr(library, "branch_inputs_bwd", lambda *a, **kw: branch_bwd(*a, **{**kw, "pre": None}))
    for t in (x, z, *w):
        t.grad = None
    ssm_branch_fn(x, z, *w).sum().backward()
    assert len(calls) == 5  # forward 1, backward 2: the recompute and conv_backward's
    for before, t in zip(grads, [t for t in (x, z, *w) if t.grad is not None]):
        assert torch.equal(before, t.grad)
    # the SiLU in the conv only where its kernel fuses it: elsewhere the branch applies it (and keeps the conv's
    # output), and asking the conv for it is a mistake said in one line
    with pytest.raises(ValueError, match="silu=True needs a conv kernel that fuses the SiLU"):
        conv_forward(x.detach(), w[0].detach(), w[1].detach(), False, library.resolve(backend, x.device), silu=True)


def test_bad_branch_input_shapes():
    with pytest.raises(ValueError, match=r"x and z must both be \(batch, d_inner, seqlen\)"):
        ssm_branch_fn(torch.randn(2, 8, 5), torch.randn(2, 8, 4), *weights(dtype=torch.float32))


@pytest.mark.parametrize("seqlen", [1, 3, 4, 50])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_conv_silu_kernel_matches_torch_conv1d(seqlen, with_bias, seed):
    from vim_ds.ops import backends
    from vim_ds.ops.ssm_branch import conv1d_silu

    cpu = backends.load("cpu").backend
    assert cpu is not None
    # x as a channel slice of a wider tensor (rows contiguous, batch strided): the kernel reads it without a copy
    xz = torch.randn(2, 12, seqlen, dtype=torch.float64)
    x = xz[:, :6].detach().requires_grad_(True)
    w = torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if with_bias else None
    args = (x, w, b) if with_bias else (x, w)
    kernel = (lambda x, w, b: conv1d_silu(x, w, b, cpu)) if with_bias else (lambda x, w: conv1d_silu(x, w, None, cpu))
    torch.autograd.gradcheck(kernel, args)
    want = F.silu(F.conv1d(x, w, b, padding=3, groups=6)[..., :seqlen])
    torch.testing.assert_close(kernel(*args), want, rtol=1e-12, atol=1e-12)


def test_training_under_autocast_recomputes_with_the_same_casts():
    """backward runs outside the caller's autocast region; the recompute must still cast like forward did
    (found on an H100: `Input type (BFloat16) and bias type (float)` under torch.autocast)."""
    import timm

    import vim_ds  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4,
                              stride=4, drop_path_rate=0.0)
    x = torch.randn(4, 3, 32, 32)

    def grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    low, full = grads(True), grads(False)
    for name, g in full.items():
        assert torch.isfinite(low[name]).all(), name
        assert (low[name] - g).norm() <= 0.05 * g.norm() + 1e-6, name


def _projections_by_autograd(hidden, w_x, w_z, y, w_out):
    """From first principles: the matrix products spelled out, differentiated by autograd."""
    x = torch.einsum("dc,blc->bdl", w_x, hidden)
    z = torch.einsum("dc,blc->bdl", w_z, hidden)
    return x, z, torch.einsum("bdl,md->blm", y, w_out)


def test_the_mixers_projections_give_autograds_gradients_in_the_layouts_the_ops_read():
    """in_projection and out_projection (their own backward: one GEMM adding into another, outputs in the layouts
    the next op reads) against autograd of einsum in float64, every gradient, with z's gradient absent too;
    gradcheck (finite differences); the layouts. Negative control: the input's gradient from x alone fails."""
    from vim_ds.ops.ssm_branch import in_projection, out_projection

    g = torch.Generator().manual_seed(31)
    hidden, w_x, w_z = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 7, 8), (12, 8), (12, 8)))
    y, w_out = torch.randn(2, 12, 7, generator=g, dtype=torch.float64), torch.randn(8, 12, generator=g,
                                                                                   dtype=torch.float64)
    dx, dz, dout = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 12, 7), (2, 12, 7), (2, 7, 8)))
    leaves = [t.clone().requires_grad_() for t in (hidden, w_x, w_z, y, w_out)]
    x, z = in_projection(*leaves[:3])
    out = out_projection(*leaves[3:])
    assert x.is_contiguous() and z.is_contiguous() and out.is_contiguous() and out.shape == (2, 7, 8)
    got = torch.autograd.grad((x, z, out), leaves, (dx, dz, dout))
    assert got[0].is_contiguous() and got[3].is_contiguous()  # (batch, L, d_model) and (batch, d_inner, L)
    ref = [t.clone().requires_grad_() for t in (hidden, w_x, w_z, y, w_out)]
    want_out = _projections_by_autograd(*ref)
    want = torch.autograd.grad(want_out, ref, (dx, dz, dout))
    for a, b, w in zip((x, z, out), want_out, ("x", "z", "out")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # only x used: z's gradient is None inside, its weight's gradient zero
    x_only = torch.autograd.grad(in_projection(*leaves[:3])[0], leaves[:3], dx)
    want_x_only = torch.autograd.grad(_projections_by_autograd(*ref)[0], ref[:3], dx, allow_unused=True)
    for a, b in zip(x_only, want_x_only[:2] + (torch.zeros_like(w_z),)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(x_only[0], got[0], rtol=1e-6, atol=1e-6)
    small = [t.detach().contiguous().requires_grad_() for t in (hidden[:, :3], w_x, w_z, y[..., :3], w_out)]
    assert torch.autograd.gradcheck(lambda h, a, b: in_projection(h, a, b), small[:3])
    assert torch.autograd.gradcheck(lambda t, w: out_projection(t, w), small[3:])


def test_the_mixers_projections_under_autocast():
    """Under CPU autocast (bf16) the products run in bf16 forward and backward, gradients come back in the
    inputs' fp32: as autograd through autocast's casts gives them, to bf16's rounding."""
    from vim_ds.ops.ssm_branch import in_projection, out_projection

    g = torch.Generator().manual_seed(32)
    hidden, w_x, w_z = (torch.randn(*s, generator=g) for s in ((2, 9, 16), (24, 16), (24, 16)))
    y, w_out = torch.randn(2, 24, 9, generator=g), torch.randn(16, 24, generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, w_x, w_z, y, w_out)]
    ref = [t.clone().requires_grad_() for t in (hidden, w_x, w_z, y, w_out)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x, z = in_projection(*leaves[:3])
        out = out_projection(*leaves[3:])
        want_out = _projections_by_autograd(*ref)
    assert x.dtype == z.dtype == out.dtype == torch.bfloat16
    grads = [torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in (x, z, out)]
    got = torch.autograd.grad((x, z, out), leaves, grads)
    want = torch.autograd.grad(want_out, ref, grads)
    for a, b, t in zip(got, want, leaves):
        assert a.dtype == t.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
