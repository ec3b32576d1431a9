"""Every selective-scan backend against the float64 pure-PyTorch reference: forward and all eight gradients."""
import pytest
import torch

from vim_ds.ops import backends, selective_scan_fn, selective_scan_ref
from vim_ds.ops.selective_scan import scan_with_backend

GRAD_NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]


def make_inputs(batch, dim, seqlen, d_state, dtype=torch.float64, device="cpu", with_D=True, with_z=True,
                with_bias=True):
    """Random inputs in Mamba's regime: A < 0, delta around softplus' linear region."""
    g = dict(device=device, dtype=dtype)
    inputs = {
        "u": torch.randn(batch, dim, seqlen, **g),
        "delta": 0.5 * torch.randn(batch, dim, seqlen, **g),
        "A": -torch.exp(0.5 * torch.randn(dim, d_state, device=device, dtype=torch.float64)).to(
            torch.float64 if dtype == torch.float64 else torch.float32),
        "B": torch.randn(batch, d_state, seqlen, **g),
        "C": torch.randn(batch, d_state, seqlen, **g),
        "D": torch.randn(dim, device=device, dtype=torch.float64) if with_D else None,
        "z": torch.randn(batch, dim, seqlen, **g) if with_z else None,
        "delta_bias": (0.5 * torch.randn(dim, device=device, dtype=torch.float64)) if with_bias else None,
    }
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for k in ("D", "delta_bias"):
        if inputs[k] is not None:
            inputs[k] = inputs[k].to(wide)
    return inputs


def run(fn, inputs, softplus, dout):
    """Forward + backward of `fn`; returns (out, {name: grad})."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    out = fn(**leaves, delta_softplus=softplus)
    out.backward(dout)
    return out.detach(), {k: v.grad for k, v in leaves.items() if v is not None}


def reference(inputs, softplus, dout):
    """The float64 reference on float64 copies of the inputs."""
    wide = {k: (v.double() if v is not None else None) for k, v in inputs.items()}
    return run(selective_scan_ref, wide, softplus, dout.double())


def assert_close(name, got, want, rtol):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-12
    assert err <= rtol * scale, f"{name}: max abs error {err:.3e} > {rtol:.1e} x max |ref| {scale:.3e}"


def compiled(kind):
    loaded = backends.load(kind)
    assert loaded.backend is not None, f"the {kind} kernel must be available here: {loaded.reason}"
    return loaded.backend


def on_backend(backend):
    return lambda **kw: scan_with_backend(backend, **kw)


CASES = [  # (batch, dim, seqlen, d_state, with_D, with_z, with_bias, softplus)
    (2, 4, 1, 16, True, True, True, True),
    (2, 3, 7, 16, True, True, True, True),
    (2, 5, 197, 16, True, True, True, True),
    (1, 3, 1025, 16, True, True, True, True),
    (2, 3, 33, 1, False, False, False, False),
    (1, 2, 65, 64, True, False, True, False),
    (1, 2, 19, 256, False, True, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}D{c[1]}L{c[2]}N{c[3]}")
@pytest.mark.parametrize("kind", ["ref", "cpu"])
def test_float64_matches_reference(kind, case, seed):
    batch, dim, seqlen, d_state, with_D, with_z, with_bias, softplus = case
    inputs = make_inputs(batch, dim, seqlen, d_state, torch.float64, "cpu", with_D, with_z, with_bias)
    dout = torch.randn(batch, dim, seqlen, dtype=torch.float64)
    backend = backends.RefBackend() if kind == "ref" else compiled("cpu")
    out, grads = run(on_backend(backend), inputs, softplus, dout)
    ref_out, ref_grads = reference(inputs, softplus, dout)
    assert out.dtype == torch.float64
    assert_close("out", out, ref_out, 1e-10)
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], 1e-9)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)])
def test_cpu_low_precision_against_float64(dtype, rtol, seed):
    inputs = make_inputs(2, 8, 197, 16, dtype)
    dout = torch.randn(2, 8, 197, dtype=torch.float64)
    out, grads = run(on_backend(compiled("cpu")), inputs, True, dout.to(dtype))
    ref_out, ref_grads = reference(inputs, True, dout.to(dtype))
    assert out.dtype == dtype
    assert_close("out", out, ref_out, rtol)
    for name in GRAD_NAMES:
        assert grads[name].dtype == inputs[name].dtype
        assert_close(f"d{name}", grads[name], ref_grads[name], rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}D{c[1]}L{c[2]}N{c[3]}")
def test_gpu_float64_matches_reference(case, seed):
    batch, dim, seqlen, d_state, with_D, with_z, with_bias, softplus = case
    inputs = make_inputs(batch, dim, seqlen, d_state, torch.float64, "cuda", with_D, with_z, with_bias)
    dout = torch.randn(batch, dim, seqlen, dtype=torch.float64, device="cuda")
    out, grads = run(on_backend(compiled("cuda")), inputs, softplus, dout)
    ref_out, ref_grads = reference(inputs, softplus, dout)
    assert_close("out", out, ref_out, 1e-10)
    for name in grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], 1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("seqlen", [1, 7, 197, 729, 1025, 4100])
def test_gpu_low_precision_against_float64(dtype, rtol, seqlen, seed):
    inputs = make_inputs(2, 64, seqlen, 16, dtype, "cuda")
    dout = torch.randn(2, 64, seqlen, dtype=dtype, device="cuda")
    out, grads = run(on_backend(compiled("cuda")), inputs, True, dout)
    ref_out, ref_grads = reference(inputs, True, dout)
    assert out.dtype == dtype
    assert_close("out", out, ref_out, rtol)
    for name in GRAD_NAMES:
        assert_close(f"d{name}", grads[name], ref_grads[name], rtol)


def test_public_op_picks_the_cpu_kernel_and_matches(seed):
    inputs = make_inputs(2, 4, 23, 16, torch.float64)
    assert backends.get_backend(torch.device("cpu")).name == "cpu"
    dout = torch.randn(2, 4, 23, dtype=torch.float64)
    out, grads = run(selective_scan_fn, inputs, True, dout)
    ref_out, ref_grads = reference(inputs, True, dout)
    assert_close("out", out, ref_out, 1e-10)
    for name in GRAD_NAMES:
        assert_close(f"d{name}", grads[name], ref_grads[name], 1e-9)


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv("VIM_DS_SCAN", "ref")
    assert backends.get_backend(torch.device("cpu")).name == "ref"
    monkeypatch.setenv("VIM_DS_SCAN", "cuda")
    with pytest.raises(ValueError, match="cannot run on cpu tensors"):
        backends.get_backend(torch.device("cpu"))
    monkeypatch.setenv("VIM_DS_SCAN", "fast")
    with pytest.raises(ValueError, match="not a scan backend"):
        backends.get_backend(torch.device("cpu"))


class TestBadInputs:
    """Wrong shape, dtype, device or layout -> ValueError naming the argument and the expected shape."""

    def good(self):
        return make_inputs(2, 4, 9, 16, torch.float32)

    def call(self, **override):
        kwargs = self.good()
        kwargs.update(override)
        return selective_scan_fn(**kwargs, delta_softplus=True)

    def test_wrong_shape_names_argument_and_expected_shape(self):
        with pytest.raises(ValueError, match=r"B must be of shape \(batch, d_state, seqlen\) = \(2, 16, 9\)"):
            self.call(B=torch.randn(2, 9, 16))
        with pytest.raises(ValueError, match=r"D must be of shape \(dim,\) = \(4,\)"):
            self.call(D=torch.randn(5))
        with pytest.raises(ValueError, match=r"u must be a 3-D tensor"):
            self.call(u=torch.randn(2, 4))
        with pytest.raises(ValueError, match=r"A must be of shape \(dim, d_state\) with 1 <= d_state <= 256"):
            self.call(A=-torch.rand(4, 300))

    def test_wrong_dtype(self):
        with pytest.raises(ValueError, match="delta must be of dtype torch.float32 like u"):
            self.call(delta=torch.randn(2, 4, 9, dtype=torch.float64))
        with pytest.raises(ValueError, match="u must be float32, float16, bfloat16 or float64"):
            good = self.good()
            self.call(u=good["u"].to(torch.int32))

    def test_wrong_device(self):
        with pytest.raises(ValueError, match="z must be on cpu like u"):
            self.call(z=torch.randn(2, 4, 9, device="meta"))

    def test_non_contiguous(self):
        with pytest.raises(ValueError, match=r"C must be contiguous"):
            self.call(C=torch.randn(2, 9, 16).transpose(1, 2))
