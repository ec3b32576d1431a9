"""A performance model of the selective scan on paper: the bytes each kernel must move at the least, its
exponentials and FMAs, and from them a lower bound on its time on a GPU of published peak rates (H100 SXM,
MI250X (one GCD), MI300X, and the H200 SXM, which this project's GPU sessions may get).

What is counted (Vim's call: D, z, delta_bias and softplus present; B and C input-dependent; the reasoning is in
the "Performance model" paragraph of ``csrc/selective_scan_kernel.cuh``):

* **bytes** — every input read once and every output written once, nothing else: the forward reads u, delta, z
  (batch x dim x L each, in the input dtype), B and C (batch x N x L), A (dim x N, fp32), D and delta_bias (dim,
  fp32) and writes out (batch x dim x L); the backward (which recomputes the forward's states, as mamba_ssm's and
  ours do) reads the same inputs plus dout and writes du, ddelta, dz, dB, dC in the input dtype and dA, dD,
  ddelta_bias in fp32. Stored states, workspaces and partial sums are the design's cost, not the problem's, so
  they are left out (``kernel_partials_bytes`` gives what per-block dB/dC partials would add, a tuning of our
  backward's launcher).
* **exp** — special-function-unit operations: one exp(delta'*A) per (b, d, t, n) in each kernel (the backward
  keeps the one of its state recompute), plus per (b, d, t) softplus (exp, log) and silu (exp, reciprocal) in the
  forward, and softplus (exp, log), its derivative (reciprocal) and silu (exp, reciprocal) in the backward.
* **fma** — floating-point operations on the FMA pipe (a multiply, an add or a fused multiply-add each count one):
  per (b, d, t, n) 4 in the forward (delta'*A, (delta'*u)*B, h = a*h + b, y += h*C) and 13 in the backward (the
  same 4 to recompute the states and y, which dz needs; C*dy and dh = a*dh' + C*dy; dC += h*dy;
  dB += dh*(delta'*u); s_B += dh*B (du and ddelta's B*u term); g = dh*a, g*h_prev; dA += g*h_prev*delta';
  s_A += g*h_prev*A (ddelta's A term)); per (b, d, t) the elementwise ones (bias, softplus, gate, D, their
  derivatives): ``FWD_FMA_PER_ROW`` / ``BWD_FMA_PER_ROW``. ``tests/test_scan_model.py`` counts the operations of
  implementations written that way, after checking that they compute the reference's output and gradients.

The lower bound of a kernel on a GPU is max(bytes / HBM bandwidth, fma / FMA rate, exp / SFU rate): the three
units work in parallel, and no kernel can beat the busiest one. A measured time is then reported as
measured / bound (>= 1; the closer to 1, the less is left to gain).

* **chain** — the longest chain of dependent steps (each exp/log/reciprocal or FMA-pipe operation one step) when
  every scan and every sum is evaluated as a balanced tree: a scan over L steps of the pairs (a, b) in
  ceil(log2 L) levels of one fused multiply-add each, a sum of n terms in ceil(log2 n) adds. Not a time bound by
  itself (many chains run side by side), but the latency a parallel evaluation gets down to: an implementation
  that walks the sequence serially has a chain of about L steps (or 2L) instead of log2 L. ``forward_chain`` /
  ``backward_chain`` list the steps. The kernel emulator's counting build (tools/kernel_emu) measures the
  kernels' bytes, exp, FMA and chains to set beside these minima (``vim_ds/cli/bench/scan_counts.py``,
  ``vim-ds bench scan --predict``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The shapes `vim-ds bench scan` times on a GPU, (batch, dim, seqlen, d_state), with what each stands for.
BENCH_SHAPES = (
    ((64, 768, 197, 16), "Vim-small, batch 64, 224x224"),
    # (28 x 28 patches and the class token: 232x232 at stride 8; at 224x224 the model has 27 x 27 + 1 = 730 tokens)
    ((64, 768, 785, 16), "Vim-small stride 8, batch 64, 232x232"),
    ((1, 384, 4097, 16), "Vim-tiny, batch 1, 1024x1024 inference"),
    ((8, 384, 6085, 16), "Vim-tiny, batch 8, 1248x1248"),
)
BENCH_DTYPES = ("float32", "bfloat16")

ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# A, D, delta_bias and their gradients are fp32 (fp64 only for fp64 input, not benchmarked)
PARAM_BYTES = 4

FWD_EXP_PER_ELEM, BWD_EXP_PER_ELEM = 1, 1  # per (b, d, t, n)
FWD_EXP_PER_ROW, BWD_EXP_PER_ROW = 4, 5  # per (b, d, t): see the module docstring
FWD_FMA_PER_ELEM, BWD_FMA_PER_ELEM = 4, 13  # per (b, d, t, n)
# per (b, d, t): forward: delta + bias, delta'*u, D*u + y, sigmoid's 1 + e, z*sigmoid, y*silu (6);
# backward: delta + bias, softplus' = e / (1 + e) (2), delta'*u, sigmoid's 1 + e, silu, dy = dout*silu,
# du = s_B*delta' + D*dy (2), ddelta = (s_B*u + s_A) * softplus' (2), dD += dy*u (2), ddelta_bias += ddelta,
# dz = dout*(y + D*u)*silu'(z) with silu' = s*(1 + z*(1 - s)) (7) (21)
FWD_FMA_PER_ROW, BWD_FMA_PER_ROW = 6, 21


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    fp32_flops: float  # peak FP32 (FMA = 2 flops) as the datasheet states it
    sfu_per_s: float  # exp/log/reciprocal results per second
    source: str


# Published peak rates. The exp (special-function) rate is not on the datasheets: NVIDIA's CUDA C++ Programming
# Guide (arithmetic instruction throughput, compute capability 9.0) gives 16 results per clock per SM for exp2,
# log2 and reciprocal against 128 for FP32 FMA, i.e. 1/8 of the FMA rate; AMD's CDNA transcendental instructions
# (v_exp_f32, v_log_f32, v_rcp_f32) issue at a quarter of the (unpacked) FP32 lane rate: CUs x 64 x clock / 4.
GPUS = (
    GPU("H100 SXM", 3.35e12, 67e12, 67e12 / 2 / 8,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 3.35 TB/s HBM3, FP32 67 TFLOPS); exp at 1/8 of the "
        "FMA rate (CUDA C++ Programming Guide, throughput table, cc 9.0)"),
    GPU("H200 SXM", 4.8e12, 67e12, 67e12 / 2 / 8,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 4.8 TB/s HBM3e, FP32 67 TFLOPS); exp as on the H100"),
    GPU("MI250X (one GCD)", 3.2768e12 / 2, 95.7e12 / 2, 110 * 64 * 1.7e9 / 4,
        "AMD Instinct MI250X datasheet (3.2768 TB/s HBM2e, packed FP32 95.7 TFLOPS, 220 CUs at 1.7 GHz, for two "
        "GCDs: halved here); exp at a quarter of the lane rate, 110 CUs x 64 x 1.7 GHz / 4"),
    GPU("MI300X", 5.3e12, 163.4e12, 304 * 64 * 2.1e9 / 4,
        "AMD Instinct MI300X datasheet (5.3 TB/s HBM3, FP32 vector 163.4 TFLOPS, 304 CUs at 2.1 GHz); exp at a "
        "quarter of the lane rate, 304 CUs x 64 x 2.1 GHz / 4"),
)


# Dense bf16 matrix peak of each modelled GPU (tensor cores / matrix cores), as the datasheets state it (without
# sparsity): the rate of matrix products in bf16 runs (`vim-ds bench profile`, `vim-ds bench anatomy`).
BF16_MATMUL_FLOPS = {"H100 SXM": 989.4e12, "H200 SXM": 989.4e12, "MI250X (one GCD)": 383e12 / 2,
                     "MI300X": 1307.4e12}
BF16_SOURCES = ("NVIDIA H100 / H200 datasheets: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense; AMD "
                "MI250X: 383 TFLOPS bf16 for two GCDs; AMD MI300X: 1,307.4 TFLOPS bf16 dense")


def gpu_for_device(device_name: str):
    """The modelled GPU that a torch.cuda device name denotes, or None (an H100 PCIe or NVL, an MI210, ... are
    not modelled: their bandwidth and rates differ)."""
    n = device_name.lower()
    by_name = {g.name: g for g in GPUS}
    if "pcie" in n or "nvl" in n:
        return None
    if "h100" in n:
        return by_name["H100 SXM"]
    if "h200" in n:
        return by_name["H200 SXM"]
    if "mi250x" in n:
        return by_name["MI250X (one GCD)"]
    if "mi300x" in n:
        return by_name["MI300X"]
    return None


@dataclass(frozen=True)
class KernelCost:
    bytes: int
    exp: int
    fma: int
    chain: int = 0

    def bound(self, gpu: GPU) -> dict:
        """Seconds each unit needs at its peak, the lower bound (the largest) and the unit that sets it."""
        terms = {"memory": self.bytes / gpu.hbm_bytes_per_s, "fma": self.fma / (gpu.fp32_flops / 2),
                 "exp": self.exp / gpu.sfu_per_s}
        limit = max(terms, key=terms.get)
        return {"seconds": terms[limit], "bound_by": limit, **{f"{k}_s": v for k, v in terms.items()}}


def _levels(n: int) -> int:
    """Dependent levels of a balanced tree over n terms."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def forward_chain(batch, dim, seqlen, d_state) -> int:
    """delta + bias, exp and log1p (softplus), dl*A, exp: 5 steps to a_t (b_t = dl*u*B is ready sooner); the scan
    of (a, b): ceil(log2 L); y = sum over n of h*C: ceil(log2 N) adds, the products fused into the first level
    (one step when N is 1); + D*u (fused), * silu(z) (computed beside): 2."""
    return 5 + _levels(seqlen) + max(1, _levels(d_state)) + 2


def backward_chain(batch, dim, seqlen, d_state) -> int:
    """dy = dout*silu(z) (exp, add, reciprocal, two multiplies: 5) and C*dy: 6 steps; the reverse scan of the
    adjoint dh_t = C_t dy_t + a_{t+1} dh_{t+1}: ceil(log2 L); then the longer of ddelta's and dA's paths (the
    states they need come from the forward's recomputation beside, in fewer steps): ddelta = softplus' * sum over
    n of dh*(A*a*h_prev + B*u): ceil(log2 N) + 1; dA = dh*dl*(a*h_prev): 2; and the sum of either over batch and
    time: ceil(log2(batch*L))."""
    return 6 + _levels(seqlen) + max(_levels(d_state) + 1, 2) + _levels(batch * seqlen)


def forward_cost(batch, dim, seqlen, d_state, dtype="float32") -> KernelCost:
    e = ELEM_BYTES[dtype]
    bdl, bnl, elems = batch * dim * seqlen, batch * d_state * seqlen, batch * dim * seqlen * d_state
    # u delta z, B C, A D bias
    read = 3 * bdl * e + 2 * bnl * e + (dim * d_state + 2 * dim) * PARAM_BYTES
    write = bdl * e  # out
    return KernelCost(read + write, FWD_EXP_PER_ELEM * elems + FWD_EXP_PER_ROW * bdl,
                      FWD_FMA_PER_ELEM * elems + FWD_FMA_PER_ROW * bdl, forward_chain(batch, dim, seqlen, d_state))


def backward_cost(batch, dim, seqlen, d_state, dtype="float32") -> KernelCost:
    e = ELEM_BYTES[dtype]
    bdl, bnl, elems = batch * dim * seqlen, batch * d_state * seqlen, batch * dim * seqlen * d_state
    params = (dim * d_state + 2 * dim) * PARAM_BYTES
    read = 4 * bdl * e + 2 * bnl * e + params  # u delta z dout, B C, A D bias
    write = 3 * bdl * e + 2 * bnl * e + params  # du ddelta dz, dB dC, dA dD ddelta_bias
    return KernelCost(read + write, BWD_EXP_PER_ELEM * elems + BWD_EXP_PER_ROW * bdl,
                      BWD_FMA_PER_ELEM * elems + BWD_FMA_PER_ROW * bdl, backward_chain(batch, dim, seqlen, d_state))


# The GPU launcher's choices that set the backward's partial sums (csrc/selective_scan_cuda.cu, backward_tiles;
# csrc/selective_scan_kernel.cuh, bwd_tiles): blocks wanted without segments, channel tiles a block walks at most.
KERNEL_TARGET_BLOCKS = 1024
KERNEL_MAX_TILES = 4


def kernel_backward_blocks(batch, dim, d_state, dtype="float32") -> int:
    """Blocks of channels per batch element in our GPU backward: each holds tiles x 128 / G channels, G = the next
    power of two >= d_state (at least 8, at most 32); up to 4 tiles when d_state <= 32 (not for float64 input; at
    most 256 channels a block), as many as keep 1024 blocks in all when one tile a block gives that many."""
    group = min(32, max(8, 1 << max(0, math.ceil(math.log2(d_state)))))
    cpb = 128 // group
    most = KERNEL_MAX_TILES if d_state <= 32 and dtype != "float64" else 1
    while most * cpb > 256:
        most //= 2
    blocks = lambda t: -(-dim // (cpb * t))  # noqa: E731
    tiles = most
    if batch * blocks(1) >= KERNEL_TARGET_BLOCKS:
        while tiles > 1 and batch * blocks(tiles) < KERNEL_TARGET_BLOCKS:
            tiles //= 2
    return blocks(tiles)


def kernel_partials_bytes(batch, dim, seqlen, d_state, dtype="float32") -> int:
    """The traffic per-block-of-channels partial sums of dB and dC would add to our GPU backward: in the
    accumulation type (fp32 but for float64 input), written by the scan and read back by the ordered reduction
    (none when one block holds every channel). Only under tuning (ScanTuning::partials): the launcher's own
    backward adds the blocks' sums into dB, dC in a chain, which moves dB, dC alone."""
    blocks = kernel_backward_blocks(batch, dim, d_state, dtype)
    acc = 8 if dtype == "float64" else 4
    return 0 if blocks == 1 else 2 * 2 * batch * blocks * d_state * seqlen * acc


def predict(batch, dim, seqlen, d_state, dtype) -> dict:
    """Costs and bounds of the forward, the backward and the two together (what `bench scan` times as
    fwd+bwd), on every modelled GPU."""
    fwd, bwd = forward_cost(batch, dim, seqlen, d_state, dtype), backward_cost(batch, dim, seqlen, d_state, dtype)
    row = {"shape": shape_text(batch, dim, seqlen, d_state), "dtype": dtype,
           "fwd": {"bytes": fwd.bytes, "exp": fwd.exp, "fma": fwd.fma, "chain": fwd.chain},
           "bwd": {"bytes": bwd.bytes, "exp": bwd.exp, "fma": bwd.fma, "chain": bwd.chain},
           "bounds": {}}
    for gpu in GPUS:
        f, b = fwd.bound(gpu), bwd.bound(gpu)
        row["bounds"][gpu.name] = {"fwd_ms": f["seconds"] * 1e3, "fwd_bound_by": f["bound_by"],
                                   "bwd_ms": b["seconds"] * 1e3, "bwd_bound_by": b["bound_by"],
                                   "fwd_bwd_ms": (f["seconds"] + b["seconds"]) * 1e3}
    return row


def scan_inputs(batch, dim, seqlen, d_state, dtype, device):
    """Random inputs of Vim's call (D, z, delta_bias present), what `bench scan` times and the emulator counts."""
    g = dict(dtype=dtype, device=device)
    return dict(
        u=torch.randn(batch, dim, seqlen, **g), delta=0.5 * torch.randn(batch, dim, seqlen, **g),
        A=-torch.exp(0.5 * torch.randn(dim, d_state, device=device)),
        B=torch.randn(batch, d_state, seqlen, **g), C=torch.randn(batch, d_state, seqlen, **g),
        D=torch.randn(dim, device=device), z=torch.randn(batch, dim, seqlen, **g),
        delta_bias=0.5 * torch.randn(dim, device=device),
    )


def shape_text(batch, dim, seqlen, d_state) -> str:
    return f"B={batch} D={dim} L={seqlen} N={d_state}"


def predictions(shapes=None, dtypes=BENCH_DTYPES) -> list:
    return [predict(*shape, dtype) for shape in (shapes or [s for s, _ in BENCH_SHAPES]) for dtype in dtypes]


def gpus_used() -> list:
    return [{"name": g.name, "hbm_TB_per_s": g.hbm_bytes_per_s / 1e12, "fp32_TFLOPS": g.fp32_flops / 1e12,
             "fma_T_per_s": g.fp32_flops / 2e12, "exp_T_per_s": g.sfu_per_s / 1e12, "source": g.source}
            for g in GPUS]


def table(rows) -> str:
    """The predictions as a markdown table: one line per shape and dtype, fwd / fwd+bwd bound per GPU."""
    head = ("| shape | dtype | fwd MB | fwd Gexp | fwd GFMA | bwd MB | bwd Gexp | bwd GFMA | "
            + " | ".join(f"{g.name}: fwd (bound by) / fwd+bwd, ms" for g in GPUS) + " |")
    lines = [head, "|" + "---|" * (8 + len(GPUS))]
    for r in rows:
        cells = [f"{r['bounds'][g.name]['fwd_ms']:.3f} ({r['bounds'][g.name]['fwd_bound_by']}) / "
                 f"{r['bounds'][g.name]['fwd_bwd_ms']:.3f}" for g in GPUS]
        costs = [f"{r[k]['bytes'] / 1e6:.1f} | {r[k]['exp'] / 1e9:.3f} | {r[k]['fma'] / 1e9:.2f}"
                 for k in ("fwd", "bwd")]
        lines.append(f"| {r['shape']} | {r['dtype']} | {costs[0]} | {costs[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sources_text() -> str:
    return "\n".join(f"- {g['name']}: HBM {g['hbm_TB_per_s']:.3f} TB/s, FP32 {g['fp32_TFLOPS']:.2f} TFLOPS "
                     f"({g['fma_T_per_s']:.2f} T FMA/s), exp {g['exp_T_per_s']:.2f} T/s. {g['source']}"
                     for g in gpus_used())


def compare(measured_ms: float, predicted_ms: float):
    """measured / predicted (the lower bound), or None when either is missing."""
    if measured_ms is None or not predicted_ms:
        return None
    return measured_ms / predicted_ms
