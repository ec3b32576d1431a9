"""mamba_ssm's kernel as an optional backend (``VIM_DS_SCAN=mamba``, ``backend="mamba"``): the adapter's argument
mapping checked on CPU against a stand-in that follows mamba_ssm's fwd/bwd contract (tests/mamba_standin.py: our
reference behind that contract, since mamba_ssm cannot be built here), forward, last state and every gradient against
the float64 reference, with a stand-in that reads two arguments swapped as the negative control; the absent module
as a one-line error; the real module under ``-m gpu``."""
from __future__ import annotations

import sys

import pytest
import torch

from mamba_standin import SelectiveScanCudaStandIn
from vim_ds.cli.bench.scan import scan_inputs
from vim_ds.ops import backends, library
from vim_ds.ops.selective_scan import scan_with_backend
from vim_ds.ops.selective_scan_ref import selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


@pytest.fixture
def mamba_module(monkeypatch):
    """Install a module as ``selective_scan_cuda`` (None: mamba_ssm absent) with no cached load before or after."""
    def install(module):
        backends._registry.loaded.pop("mamba", None)
        monkeypatch.setitem(sys.modules, backends.MAMBA_MODULE, module)
        return module

    yield install
    backends._registry.loaded.pop("mamba", None)


def _inputs(batch, dim, seqlen, d_state, seed, drop=()):
    torch.manual_seed(seed)
    x = scan_inputs(batch, dim, seqlen, d_state, torch.float64, torch.device("cpu"))
    x = {k: v.double() for k, v in x.items()}
    for k in drop:
        x[k] = None
    return x


def _run(backend, x, reverse):
    leaves = {k: None if v is None else v.clone().requires_grad_(True) for k, v in x.items()}
    out, last = scan_with_backend(backend, **leaves, delta_softplus=True, return_last_state=True, reverse=reverse)
    torch.manual_seed(123)
    dout = torch.randn_like(out)
    out.backward(dout)
    return out.detach(), last, {k: None if v is None else v.grad for k, v in leaves.items()}


def _reference(x, reverse):
    leaves = {k: None if v is None else v.clone().requires_grad_(True) for k, v in x.items()}
    out, last = selective_scan_ref(**leaves, delta_softplus=True, return_last_state=True, reverse=reverse)
    torch.manual_seed(123)
    out.backward(torch.randn_like(out))
    return out.detach(), last, {k: None if v is None else v.grad for k, v in leaves.items()}


def _max_errors(got, want):
    errs = {"out": (got[0] - want[0]).abs().max().item(), "last_state": (got[1] - want[1]).abs().max().item()}
    for k in NAMES:
        if want[2][k] is None:
            assert got[2][k] is None, k
        else:
            errs["d" + k] = ((got[2][k] - want[2][k]).abs().max() / want[2][k].abs().max()).item()
    return errs


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("drop", [(), ("z",), ("D", "delta_bias")], ids=["all", "no-z", "no-D-bias"])
def test_adapter_maps_arguments_and_results_as_mamba_ssm_does(mamba_module, reverse, drop):
    standin = mamba_module(SelectiveScanCudaStandIn())
    x = _inputs(2, 6, 11, 4, seed=1, drop=drop)
    errs = _max_errors(_run("mamba", x, reverse), _reference(x, reverse))
    assert standin.calls == ["fwd", "bwd"]
    assert max(errs.values()) < 1e-12, errs


def test_negative_control_a_standin_with_two_arguments_swapped_fails(mamba_module):
    x = _inputs(2, 6, 11, 4, seed=2)
    want = _reference(x, False)
    for swap in (("B", "C"), ("u", "delta")):
        mamba_module(SelectiveScanCudaStandIn(swap=swap))
        errs = _max_errors(_run("mamba", x, False), want)
        assert errs["out"] > 1e-3 and errs["dB" if swap[0] == "B" else "du"] > 1e-3, (swap, errs)


def test_several_of_mamba_ssms_2048_step_chunks(mamba_module):
    """seqlen > 2048: x holds two chunks' states; the saved tensor packs them behind the pre-gate output."""
    mamba_module(SelectiveScanCudaStandIn())
    x = _inputs(1, 2, 2050, 2, seed=3)
    errs = _max_errors(_run("mamba", x, False), _reference(x, False))
    assert max(errs.values()) < 1e-11, errs


def test_the_fake_saved_tensor_matches_the_real_one(mamba_module):
    """torch.compile and export see the op through its fake implementation: same shapes and dtypes as the real
    call, with and without z (opcheck also checks the registered autograd)."""
    mamba_module(SelectiveScanCudaStandIn())
    for drop in ((), ("z",)):
        x = _inputs(2, 3, 5, 2, seed=4, drop=drop)
        args = [x[k] for k in NAMES]
        torch.library.opcheck(library.selective_scan_fwd, (*args, True, False, "mamba", True),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_absent_mamba_ssm_is_a_one_line_error(mamba_module, monkeypatch):
    mamba_module(None)  # `import selective_scan_cuda` raises ImportError
    x = _inputs(1, 2, 3, 2, seed=5)
    unavailable = "^vim_ds ops: backend 'mamba' is unavailable: mamba_ssm is not installed"
    with pytest.raises(RuntimeError, match=unavailable) as e:
        scan_with_backend("mamba", **x, delta_softplus=True)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("VIM_DS_SCAN", "mamba")  # undone after the test (os.environ set directly leaked to others)
    with pytest.raises(RuntimeError, match="^VIM_DS_SCAN=mamba but mamba_ssm is not installed") as e:
        backends.get_backend(torch.device("cuda"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot run on cpu tensors"):
        backends.get_backend(torch.device("cpu"))
    assert backends.report()["mamba"]["available"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
def test_real_mamba_ssm_against_the_reference(dtype, reverse):
    loaded = backends.load("mamba")
    if loaded.backend is None:
        pytest.skip(loaded.reason)
    torch.manual_seed(6)
    x = scan_inputs(2, 64, 300, 16, dtype, torch.device("cuda"))
    want = _reference({k: v.double() for k, v in x.items()}, reverse)
    got = _run("mamba", x, reverse)
    errs = _max_errors((got[0].double(), got[1].double(), {k: v.double() for k, v in got[2].items()}),
                       (want[0], want[1], want[2]))
    scale = want[0].abs().max().item()
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    assert errs.pop("out") < bound * scale and max(errs.values()) < bound * 10, errs


@pytest.mark.parametrize("reverse", [False, True])
def test_the_models_fused_branch_runs_on_the_adapter(mamba_module, reverse):
    """The model calls the scan through the fused branch op (VIM_DS_SCAN=mamba picks this backend for it on a GPU):
    on the stand-in it gives the reference backend's output and every gradient (float64)."""
    from test_ssm_branch import weights

    mamba_module(SelectiveScanCudaStandIn())
    torch.manual_seed(7)
    x, z = torch.randn(2, 8, 9, dtype=torch.float64), torch.randn(2, 8, 9, dtype=torch.float64)
    args = [x, z] + weights()
    results = {}
    for backend in ("ref", "mamba"):
        leaves = [a.clone().requires_grad_(True) for a in args]
        out, _ = library.ssm_branch_fwd(*leaves, reverse, backend)
        out.backward(torch.ones_like(out))
        results[backend] = [out.detach()] + [a.grad for a in leaves]
    for name, got, want in zip(["out", "x", "z", "conv_w", "conv_b", "x_proj", "dt_proj", "A", "D", "bias"],
                               results["mamba"], results["ref"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("drop", [(), ("z",)], ids=["z", "no-z"])
def test_bf16_with_an_odd_number_of_outputs(mamba_module, drop):
    """bf16 input with fp32 chunk states: the packed saved tensor keeps x aligned to its dtype even when
    batch x dim x seqlen is odd, and the results are the reference backend's (to bf16 rounding)."""
    mamba_module(SelectiveScanCudaStandIn())
    torch.manual_seed(8)
    x = scan_inputs(1, 3, 5, 2, torch.bfloat16, torch.device("cpu"))
    for k in drop:
        x[k] = None
    got, want = _run("mamba", x, False), _run("ref", x, False)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for k in NAMES:
        if want[2][k] is not None:
            assert got[2][k].dtype == want[2][k].dtype, k
            torch.testing.assert_close(got[2][k].float(), want[2][k].float(), rtol=3e-2, atol=3e-2, msg=k)
