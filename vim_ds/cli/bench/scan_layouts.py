"""`vim-ds bench scan --layouts`: the GPU scan under other work layouts than the launcher's own, to measure what each
design choice of the kernel costs on the GPU at hand (csrc/selective_scan_cuda.h, ScanTuning).

The launcher picks a chunk length (the longest that fits the backward's shared memory: it sets the stored states'
traffic and how many blocks an SM holds), the channel tiles a backward block walks (fewer tiles: more blocks of
channels, each re-reading B and C and each a link more in the chain that sums dB and dC), how many blocks it aims
at (below that it splits the sequence into segments: a second pass over their inputs), and whether the backward's
blocks of channels add their dB/dC sums in that chain or write partial sums that a reduction adds (more bytes, no
waiting). These choices were made from the performance model and the kernel
emulator's counts, without a GPU; each layout below changes one of them, so one GPU call shows which of them
matter there. On a GPU each layout is timed at the model's first three shapes, beside the launcher's own; without
one, the kernel emulator counts what each layout moves and computes at a small shape (the same layouts, so that
the GPU's times can be read against the counts).
"""
from __future__ import annotations

import contextlib

import torch

from vim_ds.ops import backends

from . import scan_counts, scan_model
from .scan_model import scan_inputs

# (name, (chunk cap, tile cap, target blocks, partials)); 0: the launcher's own choice (ScanTuning)
LAYOUTS = (
    ("own", (0, 0, 0, 0)),
    ("1 tile", (0, 1, 0, 0)),
    ("2 tiles", (0, 2, 0, 0)),
    ("chunk <= 16", (16, 0, 0, 0)),
    ("chunk <= 8", (8, 0, 0, 0)),
    ("no segments", (0, 0, 1, 0)),
    ("4x the blocks", (0, 0, 4096, 0)),
    ("dB/dC partials", (0, 0, 0, 1)),
)
# the model's first three shapes, timed on a GPU in both dtypes: Vim-small at 224 (stride 16 and 8), and one image
# of 4097 tokens (Vim-tiny at 1024, where the sequence is split into segments)
GPU_SHAPES = tuple(s for s, _ in scan_model.BENCH_SHAPES[:3])
# what the emulator counts without a GPU: Vim-small's channels, 4 chunks of the longest chunk
COUNT_SHAPE = (1, 768, 128, 16)
DTYPE_CODE = scan_counts.DTYPE_CODE


@contextlib.contextmanager
def tuned(module, caps):
    """The GPU extension `module`'s launcher capped by `caps` inside the block, its caps before restored after."""
    before = module.set_tuning(*caps)
    try:
        yield
    finally:
        module.set_tuning(*before)


def design_bytes(batch, dim, seqlen, d_state, layout) -> dict:
    """Bytes a layout's backward adds to the model's minimum by design, from the layout the launcher reports
    (chunk, tiles, channels per block, blocks per batch element, segments, partials): the stored states (N fp32 per
    (b, d, chunk), written by the forward and read back), the dB/dC partial sums (fp32, written and read back; only
    when the blocks of channels of a batch row write partials, not when they add their sums in a chain or one block
    holds every channel) and the chain's flags (an int per (b, chunk) and the ticket counter, zeroed before the
    launch: fetched and written back, whole 32-byte sectors)."""
    chunk, _, _, blocks, _, partials = layout
    n_chunks = -(-seqlen // chunk)
    saved = batch * dim * n_chunks * d_state * 4
    part = 2 * 2 * batch * blocks * d_state * seqlen * 4 if partials else 0
    flags = 2 * 32 * -(-4 * (batch * n_chunks + 1) // 32) if blocks > 1 and not partials else 0
    return {"saved": 2 * saved, "partials": part, "chain_flags": flags}


def run_gpu(repeat, time_backend) -> list:
    """time_backend(backend, inputs, repeat) -> (forward seconds, forward+backward seconds): `bench scan`'s."""
    kernel = backends.load("cuda")
    if kernel.backend is None:  # bad input for this command: one line (`vim-ds bench` exits 2)
        raise ValueError(f"--layouts: our GPU kernel is unavailable: {kernel.reason}")
    module = kernel.backend.module
    if not hasattr(module, "set_tuning"):
        raise ValueError(f"--layouts: the GPU extension {getattr(module, '__file__', module)} predates the launcher's "
                         "caps; rebuild it (pip install -e . with VIM_DS_BUILD_GPU=1)")
    rows = []
    for shape in GPU_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).replace("torch.", "")
            inputs = scan_inputs(*shape, dtype, torch.device("cuda"))
            own = None
            for label, caps in LAYOUTS:
                with tuned(module, caps):
                    fwd_layout = module.layout(*shape, DTYPE_CODE[name], False)
                    bwd_layout = module.layout(*shape, DTYPE_CODE[name], True)
                    f, fb = time_backend(kernel.backend, inputs, repeat)
                row = dict(device="cuda", gpu=torch.cuda.get_device_name(), shape=scan_model.shape_text(*shape),
                           dtype=name, layout=label, caps=list(caps), fwd_layout=list(fwd_layout),
                           bwd_layout=list(bwd_layout), design_bytes=design_bytes(*shape, bwd_layout),
                           kernel_fwd_ms=f * 1e3, kernel_fwd_bwd_ms=fb * 1e3)
                own = own or row
                row["vs_own_fwd_bwd"] = row["kernel_fwd_bwd_ms"] / own["kernel_fwd_bwd_ms"]
                rows.append(row)
                print(gpu_row(row), flush=True)
    return rows


def layout_text(r) -> str:
    """A row's backward layout in words."""
    chunk, tiles, cpb, blocks, n_seg, partials = r["bwd_layout"]
    sums = "dB/dC partials" if partials else "dB/dC in a chain" if blocks > 1 else "dB/dC stored"
    return (f"{r['shape']} {r['dtype']} {r['layout']:14s}: chunk {chunk}, {tiles} tile(s) = {cpb} channels a block, "
            f"{blocks} blocks of channels, {n_seg} segment(s), {sums}")


def gpu_row(r) -> str:
    extra = r["design_bytes"]
    return (f"[cuda] {layout_text(r)} (forward {r['fwd_layout'][4]}); stored states {extra['saved'] / 1e6:.0f} MB, "
            f"dB/dC partials {extra['partials'] / 1e6:.0f} MB | fwd "
            f"{r['kernel_fwd_ms']:.3f} ms, fwd+bwd {r['kernel_fwd_bwd_ms']:.3f} ms ({r['vs_own_fwd_bwd']:.2f}x the "
            f"launcher's own)")


def run_counts(shape=COUNT_SHAPE, dtype="float32", layouts=LAYOUTS, lib_path=None) -> list:
    """The emulator's counts per layout at `shape` (no GPU needed)."""
    lib_path = str(lib_path or scan_counts.library())
    lib = scan_counts.load(lib_path)
    rows = []
    for label, caps in layouts:
        counted = scan_counts.count(*shape, dtype, lib_path=lib_path, tuning=caps)
        with scan_counts.tuned(lib, caps):
            layout = scan_counts.layout(lib, *shape, dtype, backward=True)
        minimum = scan_model.backward_cost(*shape, dtype).bytes
        row = dict(device="emulator", shape=scan_model.shape_text(*shape), dtype=dtype, layout=label,
                   caps=list(caps), bwd_layout=list(layout), design_bytes=design_bytes(*shape, layout))
        for kind in ("fwd", "bwd"):
            row[kind] = {k: counted[kind][k] for k in ("unique_bytes", "bytes", "exp", "fma", "barriers", "chain",
                                                       "smem_accesses", "smem_wavefronts")}
            row[kind]["blocks"] = sum(n["blocks"] for n in counted[kind]["launches"])
        row["bwd"]["unique_bytes_vs_minimum"] = counted["bwd"]["unique_bytes"] / minimum
        rows.append(row)
        print(count_row(row), flush=True)
    return rows


def count_row(r) -> str:
    b = r["bwd"]
    return (f"[emulator] {layout_text(r)} | backward: distinct bytes "
            f"{b['unique_bytes'] / 1e3:.0f} kB ({b['unique_bytes_vs_minimum']:.2f}x the minimum), exp {b['exp']:,}, "
            f"FMA {b['fma']:,}, barriers {b['barriers']:,}, shared-memory wavefronts {b['smem_wavefronts']:,}, "
            f"chain {b['chain']} | forward: distinct bytes "
            f"{r['fwd']['unique_bytes'] / 1e3:.0f} kB, chain {r['fwd']['chain']}")


def run(args, time_backend) -> list:
    """Every layout of LAYOUTS: timed on the GPU when there is one (with `time_backend`), counted in the emulator
    otherwise."""
    print(__doc__.split("\n\n")[0].replace("\n", " "))
    if torch.cuda.is_available():
        return run_gpu(args.repeat, time_backend)
    print("no GPU: the kernel emulator's counts per layout instead of times")
    return run_counts()
