"""What the GPU kernels of the selective scan do, counted on the CPU: the kernel emulator's counting build
(tools/kernel_emu, libscan_emu_count.so) runs the real device code and launchers and reports per launch the
global-memory bytes (32 bytes per distinct 32-byte sector of each warp instruction, and 32 bytes per sector the
launch touches at all), its exp/log/reciprocal and FMA-pipe operations, barriers, shuffles and the longest chain of
dependent steps. Summed per kernel (forward: [pass 0, combine,] pass 1; backward: [pass 0, combine,] pass 1,
reduce) they stand beside the performance model's minimum (scan_model) in `vim-ds bench scan --predict`.

The counts are exact for what the emulated code does; how they map to a GPU's work is in the README of
tools/kernel_emu (e.g. a multiply feeding an add counts as one fused multiply-add, as nvcc contracts it)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import scan_model

REPO = Path(__file__).resolve().parents[3]  # vim_ds/cli/bench/ -> the checkout
EMU_DIR = REPO / "tools" / "kernel_emu"
LIB_NAME = "libscan_emu_count.so"
ENV_BUILD = "SCAN_EMU_BUILD"  # a folder where tools/kernel_emu/build.sh already wrote the libraries

# Small shapes the emulator counts in seconds, each standing for a layout of the big ones, d_state 16 as in Vim.
COUNT_SHAPES = (
    ((2, 128, 64, 16), "float32", "one segment along the sequence, 16 blocks of channels (the bench shapes' layout)"),
    ((2, 128, 64, 16), "bfloat16", "the same in bf16"),
    ((1, 64, 197, 16), "float32", "L = 197 split into segments along the sequence (a small batch's layout)"),
)

FIELDS = ("blocks", "threads", "pass", "barriers", "shuffles", "read_bytes", "write_bytes", "read_unique",
          "write_unique", "exp", "fma", "chain", "smem_accesses", "smem_wavefronts", "smem_conflicts")
DTYPE_CODE = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}


class CountsUnavailable(RuntimeError):
    """Why nothing could be counted here (no compiler, no checkout of the emulator's sources, a failed build)."""


def _sources():
    files = [REPO / "csrc" / name for name in ("selective_scan_kernel.cuh", "selective_scan_cuda.cu",
                                               "selective_scan_cuda.h", "causal_conv1d_kernel.cuh",
                                               "causal_conv1d_cuda.h")]
    return files + sorted(p for p in EMU_DIR.rglob("*") if p.is_file() and p.suffix in (".h", ".cpp", ".sh")
                          and "build" not in p.relative_to(EMU_DIR).parts)


def library() -> Path:
    """The counting library: from $SCAN_EMU_BUILD when set, else built once per version of its sources into
    $VIM_DS_CACHE/kernel_emu (default ~/.cache/vim_ds)."""
    if os.environ.get(ENV_BUILD):
        lib = Path(os.environ[ENV_BUILD]) / LIB_NAME
        if not lib.is_file():
            raise CountsUnavailable(f"{ENV_BUILD}={os.environ[ENV_BUILD]} has no {LIB_NAME} (tools/kernel_emu/build.sh "
                                    f"writes it there)")
        return lib
    if not (EMU_DIR / "build.sh").is_file():
        raise CountsUnavailable("the kernel emulator's sources (tools/kernel_emu) are not here: counting needs a "
                                "checkout of the repository")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise CountsUnavailable(f"no C++ compiler ({cxx}) for the kernel emulator")
    digest = hashlib.sha256(cxx.encode())
    for path in _sources():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    root = Path(os.environ.get("VIM_DS_CACHE", Path.home() / ".cache" / "vim_ds")) / "kernel_emu"
    folder = root / digest.hexdigest()[:16]
    if not (folder / LIB_NAME).is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:  # built aside, then moved: a parallel run sees all or none
            res = subprocess.run(["bash", str(EMU_DIR / "build.sh"), "--count", tmp], capture_output=True, text=True)
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
                raise CountsUnavailable(f"building the kernel emulator failed: {tail[0]}")
            folder.mkdir(exist_ok=True)
            os.replace(Path(tmp) / LIB_NAME, folder / LIB_NAME)
    return folder / LIB_NAME


@functools.lru_cache(maxsize=None)
def load(path: str):
    """An emulator library (build.sh's libscan_emu.so, libscan_emu64.so or libscan_emu_count.so) for emulate()."""
    lib = ctypes.CDLL(path)
    lib.emu_run.restype = ctypes.c_char_p
    lib.emu_run.argtypes = ([ctypes.c_int, ctypes.c_int] + [ctypes.c_longlong] * 4 + [ctypes.c_int]
                            + [ctypes.c_void_p] * 23)
    lib.emu_num_checkpoints.restype = ctypes.c_longlong
    lib.emu_num_checkpoints.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
    lib.emu_chunk_length.restype = ctypes.c_longlong
    lib.emu_chunk_length.argtypes = [ctypes.c_longlong, ctypes.c_int]
    lib.emu_config.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_int]
    lib.emu_set_reverse.argtypes = [ctypes.c_int]
    lib.emu_conv.restype = ctypes.c_char_p
    lib.emu_conv.argtypes = ([ctypes.c_int, ctypes.c_int] + [ctypes.c_longlong] * 4
                             + [ctypes.c_int, ctypes.c_int, ctypes.c_longlong] + [ctypes.c_void_p] * 8)
    lib.emu_set_tuning.restype = ctypes.c_char_p
    lib.emu_set_tuning.argtypes = [ctypes.c_longlong] * 4
    lib.emu_layout.argtypes = [ctypes.c_longlong] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong)]
    if hasattr(lib, "emu_count_launch"):
        lib.emu_count_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_char_p,
                                         ctypes.c_int]
    return lib


@contextlib.contextmanager
def tuned(lib, caps=(0, 0, 0, 0)):
    """The emulated launcher capped by `caps` (chunk, tiles, target blocks, partials: ScanTuning, 0 its own choice)
    inside the block, uncapped after."""
    err = lib.emu_set_tuning(*caps)
    if err is not None:
        raise ValueError(err.decode())
    try:
        yield
    finally:
        lib.emu_set_tuning(0, 0, 0, 0)


def layout(lib, batch, dim, seqlen, d_state, dtype="float32", backward=True) -> tuple:
    """(chunk, tiles, channels per block, blocks of channels per batch element, segments, partials) the emulated
    launcher picks now (partials: 1 when the backward's blocks write per-block partial sums of dB, dC)."""
    out = (ctypes.c_longlong * 6)()
    lib.emu_layout(batch, dim, seqlen, d_state, DTYPE_CODE[dtype], int(backward), out)
    return tuple(out)


def _launches(lib) -> list:
    if not hasattr(lib, "emu_count_launches"):
        return []
    out = []
    for i in range(lib.emu_count_launches()):
        values, name = (ctypes.c_longlong * len(FIELDS))(), ctypes.create_string_buffer(256)
        lib.emu_count_launch(i, values, name, 256)
        out.append({"kernel": name.value.decode(), **dict(zip(FIELDS, values))})
    return out


def emulate(lib, batch, dim, seqlen, d_state, dtype="float32", seed=0, tuning=(0, 0, 0, 0)) -> dict:
    """The forward (no last state, as Vim calls it) and the backward on the emulated GPU kernels, once, on random
    inputs (`bench scan`'s, seeded) with D, z, delta_bias and softplus. -> {"out", "saved", "grads": (du, ddelta,
    dz, dA, dB, dC, dD, ddelta_bias), "fwd": launches, "bwd": launches} (launches: [] but from the counting
    library). `tuning`: the launcher's caps (tuned()) for both."""
    with tuned(lib, tuning):
        return _emulate(lib, batch, dim, seqlen, d_state, dtype, seed)


def _emulate(lib, batch, dim, seqlen, d_state, dtype, seed) -> dict:
    lib.emu_config(0, seed, 0)
    lib.emu_set_reverse(0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        x = scan_model.scan_inputs(batch, dim, seqlen, d_state, getattr(torch, dtype), torch.device("cpu"))
        dout = torch.randn_like(x["u"])
    if dtype == "float64":  # A, D and delta_bias in the kernel's accumulation type (float32 for the others)
        x.update({k: x[k].double() for k in ("A", "D", "delta_bias")})
    code = DTYPE_CODE[dtype]
    inputs = [x[k].data_ptr() for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    acc = x["A"].dtype
    out = torch.empty_like(x["u"])
    saved = torch.empty(batch, dim, lib.emu_num_checkpoints(seqlen, d_state, code), d_state, dtype=acc)
    if hasattr(lib, "emu_count_reset"):
        lib.emu_count_reset()
    err = lib.emu_run(0, code, batch, dim, seqlen, d_state, 1, *inputs, out.data_ptr(), saved.data_ptr(),
                      *([None] * 13))
    if err is not None:
        raise RuntimeError(f"emulated forward: {err.decode()}")
    fwd = _launches(lib)
    grads = [torch.empty_like(x["u"]) for _ in range(3)] + [torch.empty_like(x["A"])]
    grads += [torch.empty(batch, d_state, seqlen, dtype=acc) for _ in range(2)]
    grads += [torch.empty_like(x["D"]), torch.empty_like(x["delta_bias"])]
    if hasattr(lib, "emu_count_reset"):
        lib.emu_count_reset()
    # argument order: ..., out, saved, dout, du, ddelta, dz, dA, dB, dC, dD, ddelta_bias, last_state, h0, dlast, dh0
    du, ddelta, dz, dA, dB, dC, dD, dbias = grads
    err = lib.emu_run(1, code, batch, dim, seqlen, d_state, 1, *inputs, None, saved.data_ptr(), dout.data_ptr(),
                      *(g.data_ptr() for g in (du, ddelta, dz, dA, dB, dC, dD, dbias)), None, None, None, None)
    if err is not None:
        raise RuntimeError(f"emulated backward: {err.decode()}")
    return {"out": out, "saved": saved, "grads": tuple(grads), "fwd": fwd, "bwd": _launches(lib)}


def emulate_conv(lib, batch, dim, seqlen, dtype="float32", width=4, seed=0, silu=True) -> dict:
    """The branch's depthwise causal conv on the emulated GPU kernels (with its SiLU fused, as the branch runs it,
    unless silu=False), forward and backward with a bias, once, on random inputs. -> {"out", "grads": (dx, dw,
    dbias), "fwd": launches, "bwd": launches}."""
    lib.emu_config(0, seed, 0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        x = torch.randn(batch, dim, seqlen).to(getattr(torch, dtype))
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        w, bias = 0.5 * torch.randn(dim, width, dtype=acc), torch.randn(dim, dtype=acc)
        dout = torch.randn_like(x)
    out, dx, dw, dbias = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w), torch.empty_like(bias)
    common = (DTYPE_CODE[dtype], batch, dim, seqlen, width, 0, int(silu), dim * seqlen, x.data_ptr(), w.data_ptr(),
              bias.data_ptr())
    runs = []
    for backward, outputs in ((0, (None, out.data_ptr(), None, None, None)),
                              (1, (dout.data_ptr(), None, dx.data_ptr(), dw.data_ptr(), dbias.data_ptr()))):
        if hasattr(lib, "emu_count_reset"):
            lib.emu_count_reset()
        err = lib.emu_conv(backward, *common, *outputs)
        if err is not None:
            raise RuntimeError(f"emulated conv: {err.decode()}")
        runs.append(_launches(lib))
    return {"out": out, "grads": (dx, dw, dbias), "fwd": runs[0], "bwd": runs[1]}


def conv_minimum_bytes(batch, dim, seqlen, dtype="float32", width=4) -> dict:
    """The conv's minimum bytes per kernel: forward reads x and writes out, backward reads x and dout and writes dx
    (e bytes per element each); the taps and bias (read, and their gradients written backward) in fp32."""
    e, acc = scan_model.ELEM_BYTES[dtype], 8 if dtype == "float64" else 4
    elems, weights = batch * dim * seqlen, dim * (width + 1) * acc
    return {"fwd": 2 * elems * e + weights, "bwd": 3 * elems * e + 2 * weights}


def _kernel(launches: list) -> dict:
    """A kernel's totals: the sums over its launches (the chains too: the launches run one after another)."""
    total = {"bytes": sum(n["read_bytes"] + n["write_bytes"] for n in launches),
             "unique_bytes": sum(n["read_unique"] + n["write_unique"] for n in launches)}
    for key in ("exp", "fma", "chain", "barriers", "shuffles", "smem_accesses", "smem_wavefronts", "smem_conflicts"):
        total[key] = sum(n[key] for n in launches)
    return {**total, "launches": launches}


@functools.lru_cache(maxsize=None)
def count(batch, dim, seqlen, d_state, dtype="float32", lib_path=None, seed=0, tuning=(0, 0, 0, 0)) -> dict:
    """What emulate() counted, per kernel: {"fwd": counts, "bwd": counts}, each the totals (bytes, unique_bytes,
    exp, fma, chain, barriers, shuffles) and its "launches" (the same inputs and launcher caps give the same
    counts: cached)."""
    run = emulate(load(str(lib_path or library())), batch, dim, seqlen, d_state, dtype, seed, tuple(tuning))
    return {"fwd": _kernel(run["fwd"]), "bwd": _kernel(run["bwd"])}


def compare(batch, dim, seqlen, d_state, dtype="float32", lib_path=None, tuning=(0, 0, 0, 0)) -> dict:
    """count() beside the model's minimum at the same shape: per kernel each counted total, the minimum (bytes
    for both byte counts) and counted / minimum. `tuning`: the launcher's caps (tuned())."""
    counted = count(batch, dim, seqlen, d_state, dtype, str(lib_path) if lib_path else None, tuning=tuning)
    row = {"shape": scan_model.shape_text(batch, dim, seqlen, d_state), "shape_tuple": [batch, dim, seqlen, d_state],
           "dtype": dtype}
    for kind, cost in (("fwd", scan_model.forward_cost), ("bwd", scan_model.backward_cost)):
        c, m = counted[kind], cost(batch, dim, seqlen, d_state, dtype)
        minimum = {"bytes": m.bytes, "unique_bytes": m.bytes, "exp": m.exp, "fma": m.fma, "chain": m.chain}
        row[kind] = {**c, "minimum": minimum, "ratio": {k: c[k] / v for k, v in minimum.items()}}
    return row


def count_rows(shapes=None) -> list:
    """compare() at each of `shapes` [COUNT_SHAPES]: (shape, dtype, what it stands for)."""
    lib = library()
    return [{**compare(*shape, dtype, lib_path=lib), "stands_for": what}
            for shape, dtype, what in (shapes or COUNT_SHAPES)]


def table(rows) -> str:
    """counted (counted / minimum) per kernel and measure, one line per shape, dtype and kernel."""
    head = ("| shape | dtype | kernel | bytes, per warp access | bytes, distinct sectors | exp | FMA | chain | "
            "barriers | shuffles | shared-memory accesses (wavefronts, of them bank conflicts) | launches |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        for kind in ("fwd", "bwd"):
            k = r[kind]
            cells = [f"{k[m] / 1e3:.1f} kB ({k['ratio'][m]:.2f}x)" for m in ("bytes", "unique_bytes")]
            cells += [f"{k[m]} ({k['ratio'][m]:.2f}x)" for m in ("exp", "fma", "chain")]
            cells += [str(k["barriers"]), str(k["shuffles"]),
                      f"{k['smem_accesses']} ({k['smem_wavefronts']}, {k['smem_conflicts']})", str(len(k["launches"]))]
            lines.append(f"| {r['shape']} | {r['dtype']} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
