"""`vim-ds bench scan`: the selective scan at a Vim layer shape, compiled kernel vs the pure-PyTorch reference,
forward and forward+backward, on CPU and (when present) GPU (also the mixer's causal conv beside PyTorch's depthwise
F.conv1d, on the CPU each instruction-set variant, and on a GPU the blocks' fused residual add and RMSNorm beside
PyTorch's); on a GPU also at the performance model's shapes
(``scan_model.BENCH_SHAPES``), beside mamba_ssm's kernel when it is installed, and with ``--predict`` against the
model's lower bound (measured / bound), and the GPU kernels counted in the CPU emulator (``scan_counts``) beside
the model's minimum."""
from __future__ import annotations

import os

import torch

from vim_ds.ops import backends, rms_norm_triton
from vim_ds.ops.rms_norm import add_rms_norm
from vim_ds.ops.selective_scan import scan_with_backend

from . import scan_counts, scan_layouts, scan_model
from .scan_model import scan_inputs
from .timing import timeit

# the pure-PyTorch loop is timed only up to this length (longer ones take minutes)
REF_MAX_SEQLEN = 1024


class ScanBenchError(ValueError):
    """A request the bench cannot serve: bad input (one line; `vim-ds bench` exits 2)."""


def bench_scan_backend(backend, inputs, repeat):
    """(forward seconds, forward+backward seconds) of one backend on one set of inputs."""
    device = inputs["u"].device
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    dout = torch.randn_like(inputs["u"])

    def fwd():
        with torch.no_grad():
            scan_with_backend(backend, **inputs, delta_softplus=True)

    def fwd_bwd():
        out = scan_with_backend(backend, **leaves, delta_softplus=True)
        out.backward(dout)

    return timeit(fwd, device, repeat=repeat), timeit(fwd_bwd, device, repeat=repeat)


def bench_conv(backend, x, weight, bias, repeat):
    """(forward seconds, forward+backward seconds) of the mixer's depthwise causal conv through its op, on one
    backend: "cpu" or "cuda" (our kernels) or "ref" (PyTorch's depthwise F.conv1d, what a user would otherwise run;
    cuDNN / MIOpen on a GPU)."""
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    dout = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            torch.ops.vim_ds.causal_conv1d(x, weight, bias, False, backend)

    def fwd_bwd():
        torch.ops.vim_ds.causal_conv1d(*leaves, False, backend).backward(dout)

    return timeit(fwd, x.device, repeat=repeat), timeit(fwd_bwd, x.device, repeat=repeat)


def _op_row(op, device_name, shape, dtype, kernel, ref, **extra) -> dict:
    """A row of one of the branch's or block's ops, our kernel beside PyTorch's way: ``kernel`` and ``ref`` each
    (forward seconds, forward+backward seconds)."""
    (k_f, k_fb), (ref_f, ref_fb) = kernel, ref
    return dict(op=op, device=device_name, shape=shape, dtype=dtype, kernel_fwd_ms=k_f * 1e3,
                kernel_fwd_bwd_ms=k_fb * 1e3, ref_fwd_ms=ref_f * 1e3, ref_fwd_bwd_ms=ref_fb * 1e3,
                speedup_fwd=ref_f / k_f, speedup_fwd_bwd=ref_fb / k_fb, **extra)


def _print_op_row(label, ref_name, row, tail=""):
    print(f"{label} {row['shape']} {row['dtype']}: kernel fwd {row['kernel_fwd_ms']:.3f} ms, fwd+bwd "
          f"{row['kernel_fwd_bwd_ms']:.3f} ms | {ref_name} fwd {row['ref_fwd_ms']:.3f} ms, fwd+bwd "
          f"{row['ref_fwd_bwd_ms']:.3f} ms | speedup fwd {row['speedup_fwd']:.1f}x, fwd+bwd "
          f"{row['speedup_fwd_bwd']:.1f}x{tail}", flush=True)


def run_conv(shape, repeat, module, isas, dtype, device_name="cpu"):
    """Rows for the compiled conv kernel (on the CPU each instruction-set variant) beside F.conv1d, at a scan shape's
    (batch, dim, seqlen) with Vim's 4 taps."""
    batch, dim, seqlen = shape[:3]
    device = torch.device(device_name)
    x = torch.randn(batch, dim, seqlen, device=device).to(dtype)
    weight = 0.5 * torch.randn(dim, 1, 4, device=device)
    bias = 0.1 * torch.randn(dim, device=device)
    ref_f, ref_fb = bench_conv("ref", x, weight, bias, repeat)
    rows = []
    for isa in isas:
        before = module.set_isa(isa) if isa else None
        try:
            k_f, k_fb = bench_conv(device_name, x, weight, bias, repeat)
        finally:
            if before:
                module.set_isa(before)
        row = _op_row("causal_conv1d", device_name, f"B={batch} D={dim} L={seqlen} K=4",
                      str(dtype).replace("torch.", ""), (k_f, k_fb), (ref_f, ref_fb))
        if isa:
            row["isa"] = isa
        _print_op_row(f"[{device_name}{' ' + isa if isa else ''}] conv", "F.conv1d", row)
        rows.append(row)
    return rows


def bench_norm(backend, hidden, residual, weight, scale, repeat):
    """(forward seconds, forward+backward seconds) of a block's residual add, stochastic depth and RMSNorm on one
    backend: "triton" (our kernel each way) or "ref" (PyTorch's mask multiply, add, fused RMSNorm and cast: what
    the model runs without it)."""
    leaves = [t.clone().requires_grad_(True) for t in (hidden, residual, weight)]
    grads = (torch.randn_like(hidden, dtype=weight.dtype), torch.randn_like(residual))

    def fwd():
        with torch.no_grad():
            add_rms_norm(hidden, residual, weight, 1e-5, backend, scale)

    def fwd_bwd():
        torch.autograd.backward(add_rms_norm(leaves[0], leaves[1], leaves[2], 1e-5, backend, scale), grads)

    return timeit(fwd, hidden.device, repeat=repeat), timeit(fwd_bwd, hidden.device, repeat=repeat)


def run_norm(shape, repeat, device_name):
    """A row for the blocks' fused residual add, stochastic depth and RMSNorm (Triton) beside PyTorch's
    composition at (batch, tokens, d_model), as DeepSpeed's bf16 runs it (bf16 hidden states and weight, fp32
    stream, a sample dropped), with the largest difference of the normalised rows between the two."""
    batch, tokens, d_model = shape
    device = torch.device(device_name)
    hidden = torch.randn(batch, tokens, d_model, device=device).to(torch.bfloat16)
    residual = 3 * torch.randn(batch, tokens, d_model, device=device)
    weight = (1 + 0.1 * torch.randn(d_model, device=device)).to(torch.bfloat16)
    scale = torch.full((batch,), 1 / 0.9, device=device).to(torch.bfloat16)
    scale[0] = 0
    normed = {b: add_rms_norm(hidden, residual, weight, 1e-5, b, scale)[0].float() for b in ("triton", "ref")}
    k_f, k_fb = bench_norm("triton", hidden, residual, weight, scale, repeat)
    ref_f, ref_fb = bench_norm("ref", hidden, residual, weight, scale, repeat)
    row = _op_row("add_rms_norm", device_name, f"B={batch} L={tokens} D={d_model}", "bfloat16", (k_f, k_fb),
                  (ref_f, ref_fb), max_abs_diff=float((normed["triton"] - normed["ref"]).abs().max()))
    _print_op_row(f"[{device_name}] add + RMSNorm", "PyTorch", row,
                  f" | largest difference {row['max_abs_diff']:.2g}")
    return [row]


def _mamba(args, have_gpu):
    """mamba_ssm's backend when asked for (--mamba or VIM_DS_SCAN=mamba: an error if it cannot run) or, on a GPU,
    when installed; else None."""
    asked = getattr(args, "mamba", False) or os.environ.get(backends.ENV_BACKEND, "").strip().lower() == "mamba"
    loaded = backends.load("mamba")
    if asked and loaded.backend is None:
        raise ScanBenchError(f"--mamba: {loaded.reason}")
    if asked and not have_gpu:
        raise ScanBenchError("--mamba: mamba_ssm's kernel runs on CUDA GPUs only, and there is none here")
    return loaded.backend if have_gpu else None


def annotate(row, gpu):
    """Add the model's lower bounds for the row's shape and dtype on `gpu` (a scan_model.GPU or None) and the
    measured / bound ratios of our kernel (and mamba_ssm's when timed)."""
    batch, dim, seqlen, d_state = row["shape_tuple"]
    pred = scan_model.predict(batch, dim, seqlen, d_state, row["dtype"])
    row["predicted_gpu"] = gpu.name if gpu else None
    if gpu is None:
        return row
    b = pred["bounds"][gpu.name]
    row.update(bound_fwd_ms=b["fwd_ms"], bound_fwd_bwd_ms=b["fwd_bwd_ms"], bound_fwd_by=b["fwd_bound_by"],
               ratio_fwd=scan_model.compare(row["kernel_fwd_ms"], b["fwd_ms"]),
               ratio_fwd_bwd=scan_model.compare(row["kernel_fwd_bwd_ms"], b["fwd_bwd_ms"]))
    if "mamba_fwd_ms" in row:
        row.update(mamba_ratio_fwd=scan_model.compare(row["mamba_fwd_ms"], b["fwd_ms"]),
                   mamba_ratio_fwd_bwd=scan_model.compare(row["mamba_fwd_bwd_ms"], b["fwd_bwd_ms"]))
    return row


def run_scan(args):
    """Time the kernels; returns the rows, or with --predict / --predict-only a dict with the rows, the model's
    predictions and the peak rates it used."""
    if getattr(args, "layouts", False):
        other = [f"--{k.replace('_', '-')}" for k in ("predict", "predict_only", "mamba") if getattr(args, k, False)]
        if other:
            raise ScanBenchError(f"--layouts times only our kernel's layouts; it does not combine with {other[0]}")
        try:
            return scan_layouts.run(args, bench_scan_backend)
        except scan_counts.CountsUnavailable as exc:
            raise ScanBenchError(f"--layouts: no GPU here, and the kernel emulator cannot count instead: {exc}")
    predict = getattr(args, "predict", False) or getattr(args, "predict_only", False)
    have_gpu = torch.cuda.is_available()
    mamba = _mamba(args, have_gpu)
    gpu_name = torch.cuda.get_device_name() if have_gpu else None
    gpu = scan_model.gpu_for_device(gpu_name) if have_gpu else None
    results = []
    devices = [] if getattr(args, "predict_only", False) else ["cpu"] + (["cuda"] if have_gpu else [])
    for device_name in devices:
        device = torch.device(device_name)
        dtypes = [torch.float32] if device_name == "cpu" else [torch.float32, torch.bfloat16]
        shapes = [(args.batch, args.dim, args.seqlen, args.d_state)]
        if device_name == "cuda":  # and the model's shapes (Vim-small at batch 64 first)
            shapes += [s for s, _ in scan_model.BENCH_SHAPES if s != shapes[0]]
        kernel = backends.load(device_name)
        if kernel.backend is None:
            print(f"[{device_name}] compiled kernel unavailable: {kernel.reason}")
            continue
        # The CPU kernel once per instruction-set variant this CPU runs, widest (the default) first.
        isas = list(reversed(kernel.backend.module.available_isas())) if device_name == "cpu" else [None]
        for shape in shapes:
            for dtype in dtypes:
                inputs = scan_inputs(*shape, dtype, device)
                ref = (None if args.skip_ref or shape[2] > REF_MAX_SEQLEN
                       else bench_scan_backend(backends.RefBackend(), inputs, 1))
                theirs = bench_scan_backend(mamba, inputs, args.repeat) if mamba and device_name == "cuda" else None
                for isa in isas:
                    before = kernel.backend.module.set_isa(isa) if isa else None
                    try:
                        k_f, k_fb = bench_scan_backend(kernel.backend, inputs, args.repeat)
                    finally:
                        if before:
                            kernel.backend.module.set_isa(before)
                    row = dict(device=device_name, shape=scan_model.shape_text(*shape), shape_tuple=list(shape),
                               dtype=str(dtype).replace("torch.", ""), kernel_fwd_ms=k_f * 1e3,
                               kernel_fwd_bwd_ms=k_fb * 1e3)
                    if isa:
                        row["isa"] = isa
                    if ref:
                        row.update(ref_fwd_ms=ref[0] * 1e3, ref_fwd_bwd_ms=ref[1] * 1e3,
                                   speedup_fwd=ref[0] / k_f, speedup_fwd_bwd=ref[1] / k_fb)
                    if theirs:
                        row.update(mamba_fwd_ms=theirs[0] * 1e3, mamba_fwd_bwd_ms=theirs[1] * 1e3)
                    if device_name == "cuda":
                        row["gpu"] = gpu_name
                        if predict:
                            annotate(row, gpu)
                    results.append(row)
                    print(_scan_row(row), flush=True)
        # the branch's other kernel, the conv before the scan: at the bench's shape on the CPU, at the model's first
        # two shapes (Vim-small at 224x224, stride 16 and 8) on a GPU
        conv_shapes = shapes[:1] if device_name == "cpu" else [s for s, _ in scan_model.BENCH_SHAPES[:2]]
        for conv_shape in conv_shapes:
            for dtype in (torch.float32, torch.bfloat16):
                results += run_conv(conv_shape, args.repeat, kernel.backend.module, isas, dtype, device_name)
        # the blocks' residual add and norm (a Triton kernel on GPUs only) at the same shapes' (batch, tokens,
        # d_model): d_inner is twice d_model
        if device_name == "cuda" and rms_norm_triton.available():
            for batch, dim, seqlen, _ in conv_shapes:
                results += run_norm((batch, seqlen, dim // 2), args.repeat, device_name)
    if not predict:
        return results
    preds = scan_model.predictions()
    print("\nPerformance model: lower bounds (scan_model; bytes moved at least, exp and FMA counts, peak rates)")
    print(scan_model.table(preds))
    print(scan_model.sources_text())
    if not have_gpu:
        print("no GPU: measured n/a")
    elif gpu is None:
        print(f"{gpu_name}: not a modelled GPU, so no measured / bound ratio (the bounds above are for the "
              f"modelled ones)")
    result = {"device": gpu_name or "cpu", "modelled_gpu": gpu.name if gpu else None, "rows": results,
              "predictions": preds, "gpus": scan_model.gpus_used()}
    if not getattr(args, "no_counts", False):
        result["counts"] = print_counts()
    return result


def print_counts():
    """The GPU kernels counted in the CPU emulator beside the model's minimum (scan_counts): the rows, or
    {"unavailable": why} when they cannot be counted here."""
    print("\nThe GPU kernels counted in the CPU kernel emulator (scan_counts; counted (counted / the model's minimum) "
          "per kernel at small shapes; bytes per warp access are what the SMs request, distinct sectors what an "
          "ideal cache would fetch from memory):")
    try:
        rows = scan_counts.count_rows()
    except scan_counts.CountsUnavailable as exc:
        print(f"counts: n/a ({exc})")
        return {"unavailable": str(exc)}
    print(scan_counts.table(rows))
    for shape, dtype, what in scan_counts.COUNT_SHAPES:
        print(f"- {scan_model.shape_text(*shape)} {dtype}: {what}")
    return rows


def _scan_row(r):
    where = f"{r['device']} {r['isa']}" if "isa" in r else r["device"]
    text = (f"[{where}] {r['shape']} {r['dtype']}: kernel fwd {r['kernel_fwd_ms']:.2f} ms, "
            f"fwd+bwd {r['kernel_fwd_bwd_ms']:.2f} ms")
    if "ref_fwd_ms" in r:
        text += (f" | ref fwd {r['ref_fwd_ms']:.1f} ms, fwd+bwd {r['ref_fwd_bwd_ms']:.1f} ms"
                 f" | speedup fwd {r['speedup_fwd']:.0f}x, fwd+bwd {r['speedup_fwd_bwd']:.0f}x")
    if "mamba_fwd_ms" in r:
        text += (f" | mamba_ssm fwd {r['mamba_fwd_ms']:.3f} ms, fwd+bwd {r['mamba_fwd_bwd_ms']:.3f} ms"
                 f" (ours / mamba_ssm {r['kernel_fwd_bwd_ms'] / r['mamba_fwd_bwd_ms']:.2f}x)")
    if "bound_fwd_ms" in r:
        text += (f" | bound ({r['predicted_gpu']}) fwd {r['bound_fwd_ms']:.3f} ms, fwd+bwd {r['bound_fwd_bwd_ms']:.3f}"
                 f" ms; measured/bound fwd {r['ratio_fwd']:.1f}x, fwd+bwd {r['ratio_fwd_bwd']:.1f}x")
        if "mamba_ratio_fwd" in r:
            text += f" (mamba_ssm {r['mamba_ratio_fwd']:.1f}x, {r['mamba_ratio_fwd_bwd']:.1f}x)"
    elif "predicted_gpu" in r:
        text += f" | bound: n/a ({r.get('gpu')} is not a modelled GPU)"
    return text
