"""mamba_ssm's selective_scan_fn contract: every B/C form, return_last_state, any strides, every dtype.

Each backend (ref, cpu; cuda under -m gpu) against the float64 reference ``selective_scan_ref``, which implements
every form natively (the kernels run the non-Vim forms on channel slices): forward, last state and all eight
gradients, on strided (non-contiguous) inputs. Every comparison has a negative control that must fail it: B or C
read through the wrong group / channel / time step, and the state one step before the end.
"""
import pytest
import torch

from test_selective_scan import GPU_BF16_EXCESS, GRAD_NAMES, assert_close, compiled, excess_error
from vim_ds.ops import backends, selective_scan_fn, selective_scan_ref
from vim_ds.ops.selective_scan import scan_with_backend, validate

BATCH, DIM, SEQLEN, D_STATE, GROUPS = 2, 4, 13, 5, 2  # d_state 5: the CPU kernel pads the state to 16 lanes

# (B form, C form): the Vim form, each mamba_ssm form for both, and mixed forms.
FORMS = [("input", "input"), ("constant", "constant"), ("grouped", "grouped"), ("grouped1", "grouped1"),
         ("constant", "input"), ("input", "grouped"), ("grouped", "constant")]


def strided(t):
    """A non-contiguous copy of t (every other element of a buffer twice as long in the last dimension)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    out = buf[..., ::2]
    out.copy_(t)
    assert not out.is_contiguous() or t.shape[-1] == 1
    return out


def make_BC(form, dtype, device, wide):
    g = dict(device=device)
    if form == "input":
        return torch.randn(BATCH, D_STATE, SEQLEN, dtype=torch.float64, **g).to(dtype)
    if form == "constant":  # mamba_ssm keeps a constant B / C in the weights' dtype (float32)
        return torch.randn(DIM, D_STATE, dtype=torch.float64, **g).to(wide)
    groups = GROUPS if form == "grouped" else 1
    return torch.randn(BATCH, groups, D_STATE, SEQLEN, dtype=torch.float64, **g).to(dtype)


def make_inputs(forms, dtype, device="cpu"):
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    g = dict(device=device, dtype=torch.float64)
    shape = (BATCH, DIM, SEQLEN)
    inputs = {
        "u": torch.randn(*shape, **g).to(dtype),
        "delta": (0.5 * torch.randn(*shape, **g)).to(dtype),
        "A": -torch.exp(0.5 * torch.randn(DIM, D_STATE, **g)).to(wide),
        "B": make_BC(forms[0], dtype, device, wide),
        "C": make_BC(forms[1], dtype, device, wide),
        "D": torch.randn(DIM, **g).to(wide),
        "z": torch.randn(*shape, **g).to(dtype),
        "delta_bias": (0.5 * torch.randn(DIM, **g)).to(wide),
    }
    return {k: strided(v) for k, v in inputs.items()}


def run(fn, inputs, dout, reverse):
    """Forward (with the last state) + backward through out; returns (out, last_state, {name: grad})."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}
    out, last = fn(**leaves, delta_softplus=True, return_last_state=True, reverse=reverse)
    out.backward(dout)
    return out.detach(), last.detach(), {k: v.grad for k, v in leaves.items()}


def reference(inputs, dout, reverse, fn=selective_scan_ref):
    wide = {k: v.double() for k, v in inputs.items()}
    return run(fn, wide, dout.double(), reverse)


def on_backend(name):
    backend = backends.RefBackend() if name == "ref" else compiled(name)

    def fn(**kw):
        validate(*(kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")))
        return scan_with_backend(backend, **kw)
    return fn


def rolled(name, X):
    """X read through the wrong mapping: the neighbouring group (grouped), channel (constant) or step (input)."""
    if X.dim() == 4 and X.shape[1] > 1:
        return X.roll(1, dims=1)
    return X.roll(1, dims=0) if X.dim() == 2 else X.roll(1, dims=-1)


def misread(name):
    """The reference with B or C read through the wrong mapping (the negative control of the form)."""
    def fn(**kw):
        kw[name] = rolled(name, kw[name])
        return selective_scan_ref(**kw)
    return fn


def one_step_short(inputs, reverse):
    """The float64 reference's state one step before the end (the negative control of last_state)."""
    cut = slice(1, None) if reverse else slice(None, -1)
    short = {k: (v[..., cut] if k in ("u", "delta", "z") or (k in ("B", "C") and v.dim() != 2) else v).double()
             for k, v in inputs.items()}
    return selective_scan_ref(**short, delta_softplus=True, return_last_state=True, reverse=reverse)[1]


def check_against_reference(got, inputs, dout, reverse, err, bound, last_rtol):
    """got = (out, last, grads) from a backend. err(got, want) -> relative error; must be <= bound; and the
    negative controls must fail the same check by >= 10x."""
    out, last, grads = got
    ref_out, ref_last, ref_grads = reference(inputs, dout, reverse)
    assert out.dtype == inputs["u"].dtype and out.shape == inputs["u"].shape
    assert last.shape == (BATCH, DIM, D_STATE) and last.dtype == inputs["A"].dtype
    for name, g, w in [("out", out, ref_out)] + [(f"d{n}", grads[n], ref_grads[n]) for n in GRAD_NAMES]:
        assert g.dtype == inputs[name[1:] if name != "out" else "u"].dtype, name
        e = err(g, w)
        assert e <= bound, f"{name}: relative error {e:.3e} > {bound:.1e}"
    assert_close("last_state", last, ref_last, last_rtol)

    # Negative controls: B (then C) read through the wrong group / channel / step fails out and its gradient.
    for name in ("B", "C"):
        bad_out, _, bad_grads = reference(inputs, dout, reverse, misread(name))
        worst = max(err(out, bad_out), err(grads[name], bad_grads[name]))
        assert worst >= 10 * bound, f"misread {name}: the check passes a wrong mapping (error {worst:.3e})"
    short = one_step_short(inputs, reverse)
    e = (last.double() - short).abs().max().item() / short.abs().max().item()
    assert e >= 10 * last_rtol, f"the state one step early passes the last_state check (error {e:.3e})"


def rel_err(got, want):
    return (got.double() - want).abs().max().item() / (want.abs().max().item() + 1e-12)


# Bounds: float64 as tests/test_selective_scan.py (gradients 1e-9, which covers its forward's 1e-10); float32 2e-4
# as there. bf16 / fp16: the error beyond rounding the float64 result once to the output's dtype, as there (the
# kernels compute in float32 and round each result once; fp16 on the CPU runs the float32 kernel). Measured on the
# CPU kernel over 150 seeds x every form at these shapes (2026-11-25; 30 seeds had said 1.6e-6): <= 1.7e-7 on the
# bf16/fp16 results, <= 1.9e-6 (p99 7.1e-7) on the float32 gradients (dA, dD, ddelta_bias: sums over batch and time),
# so 5e-6; the last state (float32 for every low-precision input) <= 6.8e-7 relative (p99 4.5e-7), so 2e-6. Every
# negative control errs by >= 0.27 on every seed measured.
LOW_EXCESS = 5e-6
LOW_LAST = 2e-6
PRECISIONS = {torch.float64: (rel_err, 1e-9, 1e-10), torch.float32: (rel_err, 2e-4, LOW_LAST),
              torch.bfloat16: (excess_error, LOW_EXCESS, LOW_LAST), torch.float16: (excess_error, LOW_EXCESS, LOW_LAST)}


def form_id(f):
    return f"B-{f[0]}_C-{f[1]}"


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("forms", FORMS, ids=form_id)
@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_float64_every_form(backend, forms, reverse, seed):
    inputs = make_inputs(forms, torch.float64)
    dout = torch.randn(BATCH, DIM, SEQLEN, dtype=torch.float64)
    got = run(on_backend(backend), inputs, dout, reverse)
    check_against_reference(got, inputs, dout, reverse, *PRECISIONS[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("forms", FORMS, ids=form_id)
def test_cpu_low_precision_every_form(forms, dtype, seed):
    inputs = make_inputs(forms, dtype)
    dout = torch.randn(BATCH, DIM, SEQLEN, dtype=torch.float64).to(dtype)
    got = run(on_backend("cpu"), inputs, dout, False)
    check_against_reference(got, inputs, dout, False, *PRECISIONS[dtype])


def test_public_op_contract(seed):
    """selective_scan_fn itself: positional return_last_state (mamba_ssm's 10th argument), a last state that
    carries no gradient, and the plain tensor without it."""
    inputs = make_inputs(("grouped", "constant"), torch.float32)
    args = [inputs[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    leaves = [a.detach().requires_grad_(True) for a in args]
    out, last = selective_scan_fn(*leaves, True, True)
    assert not last.requires_grad and out.requires_grad
    plain = selective_scan_fn(*leaves, True)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)
    ref_out, ref_last = selective_scan_ref(*args, True, True)
    assert_close("out", out.detach(), ref_out.double(), 2e-4)
    assert_close("last_state", last, ref_last.double(), LOW_LAST)


def test_compiles_fullgraph_with_every_form(seed):
    """The mamba_ssm forms are plain tensor code around the registered op: torch.compile sees no graph break."""
    inputs = make_inputs(("grouped", "constant"), torch.float32)

    def fn(u, delta, A, B, C, D, z, delta_bias):
        out, last = selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, True, True)
        return out, last

    compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want = fn(**inputs)
    got = compiled_fn(**inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("forms", FORMS, ids=form_id)
def test_gpu_every_form(forms, dtype, seed):
    """The cuda backend, forward, gradients and the last state the GPU kernel writes itself (its last segment's
    pass; tools/kernel_emu checks the same code without a GPU), against the float64 reference."""
    inputs = make_inputs(forms, dtype, "cuda")
    dout = torch.randn(BATCH, DIM, SEQLEN, dtype=torch.float64, device="cuda").to(dtype)
    err, bound, last_rtol = PRECISIONS[dtype]
    if dtype in (torch.bfloat16, torch.float16):
        bound = max(GPU_BF16_EXCESS)  # one bound for the bf16/fp16 and the float32 results alike
    for reverse in (False, True):
        got = run(on_backend("cuda"), inputs, dout, reverse)
        check_against_reference(got, inputs, dout, reverse, err, bound, last_rtol)
