"""A Vim block's residual add and RMSNorm (vim_ds/ops/rms_norm.py): the fused Triton kernels checked in a process of
their own (tests/rms_norm_kernels.py: Triton's interpreter on CPU, the GPU where there is one), the model with them
against the model without, and how the op chooses between kernel and composition."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from vim_ds.ops import rms_norm, rms_norm_triton
from vim_ds.ops.rms_norm import add_rms_norm

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = "tests/rms_norm_kernels.py"

needs_triton = pytest.mark.skipif(not rms_norm_triton.available(), reason="triton is not installed")


def _run_checks(env_extra: dict, *select: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    env.pop("VIM_DS_NORM", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", CHECKS, *select],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # (about 40 s: the interpreter runs each program's rows in numpy)
@needs_triton
def test_the_kernels_against_the_float64_reference_in_tritons_interpreter():
    """Forward and every gradient against the formula in float64, gradcheck, opcheck, compile, the model with and
    without the kernels: all of tests/rms_norm_kernels.py, run by Triton's interpreter on CPU tensors."""
    proc = _run_checks({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.gpu
@needs_triton
def test_the_kernels_against_the_float64_reference_on_the_gpu():
    """The same checks compiled for the GPU (gpu_check.sh's tests)."""
    proc = _run_checks({"TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "skipped" not in proc.stdout.strip().splitlines()[-1]


def test_on_cpu_auto_is_the_composition_the_model_had():
    """Without a GPU, "auto" runs PyTorch's add and norm: the bits of the composition the blocks had before (add,
    fp32 stream, RMSNorm in fp32, rounded to the weight's dtype), output and every gradient, with DeepSpeed's bf16
    dtypes; negative control: the norm of the bf16-rounded stream differs."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 9, 64, generator=g).to(torch.bfloat16).requires_grad_()
    residual = (torch.randn(2, 9, 64, generator=g) * 3).requires_grad_()
    weight = (torch.randn(64, generator=g) + 1).to(torch.bfloat16).requires_grad_()
    dnormed = torch.randn(2, 9, 64, generator=g).to(torch.bfloat16)

    def before(h, r, w, stream_dtype=torch.float32):
        stream = (r + h).to(stream_dtype).float()
        y = torch.nn.functional.rms_norm(stream, w.shape, w.float(), 1e-5) if rms_norm.TORCH_FUSES_RMS_NORM else \
            stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
        return y.to(w.dtype), stream

    def run(fn):
        normed, stream = fn(hidden, residual, weight)
        grads = torch.autograd.grad((normed, stream), (hidden, residual, weight), (dnormed, torch.ones_like(stream)))
        return (normed, stream, *grads)

    got = run(lambda h, r, w: add_rms_norm(h, r, w, 1e-5))
    for a, b in zip(got, run(before)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.equal(got[0], run(lambda h, r, w: before(h, r, w, torch.bfloat16))[0])


def test_the_choice_of_kernel_and_its_refusals(monkeypatch):
    x, w = torch.ones(2, 8), torch.ones(8)
    assert rms_norm._kernel_runs(x.to("meta"), None, w.to("meta"), "auto") == rms_norm_triton.available()
    assert not rms_norm._kernel_runs(x, None, w, "auto")
    monkeypatch.setenv("VIM_DS_NORM", "ref")
    assert not rms_norm._kernel_runs(x.to("meta"), None, w.to("meta"), "auto")
    monkeypatch.setenv("VIM_DS_NORM", "fused")
    with pytest.raises(ValueError, match=r"^VIM_DS_NORM=fused: expected ref .* or triton"):
        add_rms_norm(x, None, w, 1e-5)
    monkeypatch.delenv("VIM_DS_NORM")
    with pytest.raises(ValueError, match="backend must be auto, ref or triton, got 'cuda'"):
        add_rms_norm(x, None, w, 1e-5, backend="cuda")
    if rms_norm_triton.available() and not rms_norm_triton.interpreted():
        with pytest.raises(ValueError, match="runs on CPU tensors only under TRITON_INTERPRET=1"):
            add_rms_norm(x, None, w, 1e-5, backend="triton")
    with pytest.raises(ValueError, match="needs triton, rows of at most"):
        add_rms_norm(x.long(), None, w, 1e-5, backend="triton")


def test_a_block_joins_through_timms_droppath_bit_for_bit():
    """A block adds the previous mixer's output through stochastic depth as a per-sample scale (what the fused
    kernel takes): on CPU the stream and the normalised rows are the bits of timm's DropPath(hidden) added and
    normalised, with the same draw of the mask. Negative control: another seed, another mask, other bits."""
    import timm
    from timm.layers import DropPath

    from vim_ds.models.vim import Block

    model = timm.create_model("vim_tiny", depth=3, embed_dim=32, patch_size=8, stride=8, img_size=32,
                              drop_path_rate=0.9).train()
    block = model.layers[2]  # (block i joins through the rate the published schedule gives block i-1: 0.45 here)
    assert isinstance(block, Block) and isinstance(block.drop_path, DropPath)
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(8, 17, 32, generator=g).to(torch.bfloat16)
    residual = torch.randn(8, 17, 32, generator=g)
    seen = {}
    block.mixer.register_forward_pre_hook(lambda module, args: seen.update(normed=args[0]))

    def run(seed):
        torch.manual_seed(seed)
        _, stream = block(hidden, residual)
        return stream, seen["normed"]

    torch.manual_seed(3)
    want_stream = (residual + block.drop_path(hidden)).float()
    want_normed = block.norm(want_stream)
    stream, normed = run(3)
    assert torch.equal(stream, want_stream) and torch.equal(normed, want_normed)
    assert not torch.equal(run(4)[0], want_stream)


def _triton_report():
    from test_compile_check import _load_tool

    return _load_tool("triton_report")


if rms_norm_triton.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _plus_eps_argument(X, eps, ACC: tl.constexpr):  # the negative control: eps as a run-time argument
        x = tl.load(X).to(ACC)
        tl.store(X, x + eps)


@needs_triton
def test_compiled_float64_kernels_add_eps_in_float64():
    """Compiled for a GPU (sm_90, without one: tools/triton_report.py), the float64 forward adds eps as a float64
    constant and holds no float32 value at all. Triton's interpreter cannot show it: it keeps a Python float argument
    at double precision, where a compiled kernel takes it as an fp32 scalar (eps rounded, 2.5e-8 off, beyond the
    float64 checks' 1e-13 in rows where eps dominates). Negative control: eps as an argument is caught."""
    from triton.compiler import ASTSource

    tr = _triton_report()
    launches = dict(tr.variants())
    llir = tr.compile_launch(launches["add_rms_norm_fwd<fp64,d384,residual,scale>"], "sm_90").asm["llir"]
    assert tr.float32_in_float64(llir) == []
    assert re.search(r"fadd double %\w+, 1\.000000e-05", llir), "eps not added as the float64 constant 1e-5"
    control = triton.compile(ASTSource(_plus_eps_argument, {"X": "*fp64", "eps": "fp32", "ACC": "constexpr"},
                                       {"ACC": tl.float64}), target=tr.gpu_target("sm_90"))
    assert any("fpext float" in line for line in tr.float32_in_float64(control.asm["llir"]))


@needs_triton
def test_the_resource_report_sees_a_spill():
    """tools/triton_report.py's spill count, from the cubin: the float64 backward kept under 24 registers spills
    (the negative control of compile_check's 0 spills), at its own count it does not."""
    tr = _triton_report()
    launch = dict(tr.variants())["add_rms_norm_bwd<fp64,d768,downstream,scale>"]
    assert tr.resources("sm_90", tr.compile_launch(launch, "sm_90"))["spills"] == 0
    squeezed = tr.resources("sm_90", tr.compile_launch(launch, "sm_90", maxnreg=24))
    assert squeezed["regs"] <= 24 and squeezed["spills"] > 0
