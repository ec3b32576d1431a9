"""`vim-ds bench scan`: the selective scan at a Vim layer shape, compiled kernel vs the pure-PyTorch reference,
forward and forward+backward, on CPU and (when present) GPU."""
from __future__ import annotations

from .timing import timeit


def scan_inputs(batch, dim, seqlen, d_state, dtype, device):
    import torch

    g = dict(dtype=dtype, device=device)
    return dict(
        u=torch.randn(batch, dim, seqlen, **g), delta=0.5 * torch.randn(batch, dim, seqlen, **g),
        A=-torch.exp(0.5 * torch.randn(dim, d_state, device=device)),
        B=torch.randn(batch, d_state, seqlen, **g), C=torch.randn(batch, d_state, seqlen, **g),
        D=torch.randn(dim, device=device), z=torch.randn(batch, dim, seqlen, **g),
        delta_bias=0.5 * torch.randn(dim, device=device),
    )


def bench_scan_backend(backend, inputs, repeat):
    """(forward seconds, forward+backward seconds) of one backend on one set of inputs."""
    import torch

    from vim_ds.ops.selective_scan import scan_with_backend

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


def run_scan(args):
    import torch

    from vim_ds.ops import backends

    results = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device_name in devices:
        device = torch.device(device_name)
        dtypes = [torch.float32] if device_name == "cpu" else [torch.float32, torch.bfloat16]
        shapes = [(args.batch, args.dim, args.seqlen, args.d_state)]
        if device_name == "cuda":
            shapes.append((64, 768, 197, 16))  # Vim-small at batch 64
        kernel = backends.load(device_name)
        if kernel.backend is None:
            print(f"[{device_name}] compiled kernel unavailable: {kernel.reason}")
            continue
        # The CPU kernel once per instruction-set variant this CPU runs, widest (the default) first.
        isas = list(reversed(kernel.backend.module.available_isas())) if device_name == "cpu" else [None]
        for shape in shapes:
            for dtype in dtypes:
                inputs = scan_inputs(*shape, dtype, device)
                ref = None if args.skip_ref else bench_scan_backend(backends.RefBackend(), inputs, 1)
                for isa in isas:
                    before = kernel.backend.module.set_isa(isa) if isa else None
                    try:
                        k_f, k_fb = bench_scan_backend(kernel.backend, inputs, args.repeat)
                    finally:
                        if before:
                            kernel.backend.module.set_isa(before)
                    row = dict(device=device_name, shape="B={} D={} L={} N={}".format(*shape),
                               dtype=str(dtype).replace("torch.", ""), kernel_fwd_ms=k_f * 1e3,
                               kernel_fwd_bwd_ms=k_fb * 1e3)
                    if isa:
                        row["isa"] = isa
                    if ref:
                        row.update(ref_fwd_ms=ref[0] * 1e3, ref_fwd_bwd_ms=ref[1] * 1e3,
                                   speedup_fwd=ref[0] / k_f, speedup_fwd_bwd=ref[1] / k_fb)
                    results.append(row)
                    print(_scan_row(row), flush=True)
    return results


def _scan_row(r):
    where = f"{r['device']} {r['isa']}" if "isa" in r else r["device"]
    text = (f"[{where}] {r['shape']} {r['dtype']}: kernel fwd {r['kernel_fwd_ms']:.2f} ms, "
            f"fwd+bwd {r['kernel_fwd_bwd_ms']:.2f} ms")
    if "ref_fwd_ms" in r:
        text += (f" | ref fwd {r['ref_fwd_ms']:.1f} ms, fwd+bwd {r['ref_fwd_bwd_ms']:.1f} ms"
                 f" | speedup fwd {r['speedup_fwd']:.0f}x, fwd+bwd {r['speedup_fwd_bwd']:.0f}x")
    return text
