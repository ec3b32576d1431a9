"""What the GPU kernels do, counted in the kernel emulator's counting build (tools/kernel_emu, libscan_emu_count.so;
vim_ds/cli/bench/scan_counts.py) against the performance model's minimum (vim_ds/cli/bench/scan_model.py), at a small
shape with the bench shapes' layout: one segment along the sequence, several blocks of channels.

- The counting build computes the same bits as the checking build (its accumulation type only reports).
- Its distinct-sector bytes are exactly the model's minimum plus the traffic the kernels' design adds (the stored
  states, the backward's chain flags and per-segment parameter sums, dB/dC in fp32; with per-block dB/dC partials
  instead of the chain, those), each from the shapes and the launch's own layout: nothing missed, nothing counted
  twice.
- Against the minimum (issue 51, item 3; the goal is 1.3x for the bytes): the forward's and the backward's distinct
  bytes are within it, the backward's since its blocks of channels add their dB/dC sums in a chain (with the
  per-block partials of before: 1.38x fp32, 1.74x bf16, the negative control). The exp of the forward is the
  model's exactly; the chains are the serial walk over the sequence.

The library comes from the `kernel_emu_build` fixture (tests/conftest.py), built once per test run.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil

import pytest
import torch

from vim_ds.cli.bench import scan_counts, scan_layouts, scan_model

SHAPE = (1, 128, 64, 16)  # one segment (2 chunks), 16 blocks of 8 channels
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def build(request):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    return request.getfixturevalue("kernel_emu_build")


def counted(build, dtype, shape=SHAPE):
    return scan_counts.compare(*shape, dtype, lib_path=os.path.join(build, scan_counts.LIB_NAME))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_counting_build_computes_what_the_checking_build_does(build, dtype):
    # 40 channels: a block of channels partly empty; L = 70: a chunk partly past the end, two segments. (float64:
    # emulate once handed the kernels float32 A, D and delta_bias, which they read as float64, past their ends.)
    shape = (2, 40, 70, 16)
    runs = [scan_counts.emulate(scan_counts.load(os.path.join(build, name)), *shape, dtype)
            for name in ("libscan_emu.so", scan_counts.LIB_NAME)]
    plain, counting = runs
    assert torch.equal(plain["out"], counting["out"]) and torch.equal(plain["saved"], counting["saved"])
    for a, b in zip(plain["grads"], counting["grads"]):
        assert torch.equal(a, b)
    assert torch.isfinite(counting["out"]).all()  # outputs start as NaN: every element was written
    assert plain["fwd"] == [] and [n["pass"] for n in counting["fwd"]] == [0, 0, 1]  # pass 0, combine, pass 1
    assert [n["kernel"].split("<")[0] for n in counting["bwd"]] == [
        "void ssk::scan_bwd_kernel", "void ssk::scan_combine_kernel", "void ssk::scan_bwd_kernel",
        "void ssk::scan_reduce_kernel"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_chain_gives_the_bits_of_the_partials(build, dtype):
    """The backward's blocks of channels add their dB, dC sums in a chain, in the order in which the reduction adds
    per-block partials (ScanTuning::partials): every output and gradient bit for bit the same, here with 4 blocks
    of channels a batch row and 3 chunks in 2 segments. The comparison's resolution: one tile a block (16 blocks,
    the sums over channels grouped otherwise) changes dB's and dC's bits, and nothing else's."""
    lib = scan_counts.load(os.path.join(build, "libscan_emu.so"))
    shape = (2, 128, 70, 16)
    runs = {}
    for tuning in ((0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0)):
        with scan_counts.tuned(lib, tuning):
            layout = scan_counts.layout(lib, *shape, dtype)
        runs[tuning] = (layout, scan_counts.emulate(lib, *shape, dtype, seed=3, tuning=tuning))
    (chain_layout, chain), (part_layout, part), (_, one_tile) = runs.values()
    assert chain_layout[3:] == (4, 2, 0) and part_layout[3:] == (4, 2, 1)
    assert torch.equal(chain["out"], part["out"])
    assert all(torch.equal(a, b) for a, b in zip(chain["grads"], part["grads"]))
    # du ddelta dz dA dB dC dD ddelta_bias
    same = [torch.equal(a, b) for a, b in zip(chain["grads"], one_tile["grads"])]
    assert same == [True, True, True, True, False, False, True, True]


def design_bytes(lib, shape, dtype, bwd_launches, partials=False) -> dict:
    """The bytes the kernels move beyond the model's minimum by design: the forward writes each chunk's start state
    (N fp32 per (b, d, chunk)), the backward reads them back, writes dB and dC in fp32 (the model: the input
    dtype), and writes and reads back per (b, d, segment) its dA, dD, ddelta_bias sums (one segment). Its blocks of
    channels add their dB/dC sums in a chain, whose flags (an int per (b, chunk) and the ticket counter, zeroed
    before the launch) it fetches and writes back; tuned to `partials`, they write per-block partial sums that the
    reduction reads back instead (scan_model's account of them, whose block count must be the launch's)."""
    batch, dim, L, N = shape
    e = scan_model.ELEM_BYTES[dtype]
    chunk = lib.emu_chunk_length(N, scan_counts.DTYPE_CODE[dtype])
    n_chunks = -(-L // chunk)
    saved = batch * dim * n_chunks * N * 4
    assert bwd_launches[0]["blocks"] == batch * scan_model.kernel_backward_blocks(batch, dim, N, dtype) > batch
    if partials:
        sums = scan_model.kernel_partials_bytes(batch, dim, L, N, dtype)  # written and read back
    else:
        sums = 2 * 32 * -(-4 * (batch * n_chunks + 1) // 32)
    params = batch * dim * (N + 2) * 4
    return {"fwd": saved, "bwd": saved + 2 * batch * N * L * (4 - e) + sums + 2 * params}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partials", [False, True], ids=["chain", "partials"])
def test_distinct_bytes_are_the_minimum_plus_what_the_design_adds(build, dtype, partials):
    lib = scan_counts.load(os.path.join(build, scan_counts.LIB_NAME))
    tuning = (0, 0, 0, int(partials))
    row = scan_counts.compare(*SHAPE, dtype, lib_path=os.path.join(build, scan_counts.LIB_NAME), tuning=tuning)
    with scan_counts.tuned(lib, tuning):
        assert scan_counts.layout(lib, *SHAPE, dtype)[3:] == (4, 1, int(partials))  # 4 blocks of channels
    assert [len(row[k]["launches"]) for k in ("fwd", "bwd")] == [1, 2]  # one segment: no pass 0, no combine
    extra = design_bytes(lib, SHAPE, dtype, row["bwd"]["launches"], partials)
    for kind in ("fwd", "bwd"):
        k = row[kind]
        assert k["unique_bytes"] == k["minimum"]["bytes"] + extra[kind], kind
        # a warp access moves whole sectors, and blocks re-read what others read (B, C, the parameters)
        assert k["bytes"] > k["unique_bytes"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_against_the_models_minimum(build, dtype):
    """The issue's goal is 1.3x for the bytes. The forward meets it (distinct sectors: 1.11x fp32, 1.21x bf16 here,
    the stored states being the excess), and the backward (1.13x, 1.28x: the stored states, dB/dC in fp32 and the
    per-segment parameter sums, the last large at 64 steps). The backward met it once its blocks of channels (4
    blocks of 4 tiles of 8 channels here) summed dB, dC in a chain: with per-block partials (fp32, written and read
    back: 2 x 2 x N / 32 x 4 bytes per (b, d, t), 8 for N = 16, against a minimum of 7 x e) it moves 1.38x, 1.74x,
    the negative control (with one tile a block, before the tiles, 2.12x, 3.13x). Held at what the kernels do now,
    so that a change shows."""
    row = counted(build, dtype)
    f, b = row["fwd"]["ratio"], row["bwd"]["ratio"]
    assert f["unique_bytes"] <= 1.3 and b["unique_bytes"] <= 1.3
    assert b["unique_bytes"] == pytest.approx({"float32": 1.13, "bfloat16": 1.28}[dtype], abs=0.01)
    tuned = scan_counts.compare(*SHAPE, dtype, lib_path=os.path.join(build, scan_counts.LIB_NAME), tuning=(0, 0, 0, 1))
    assert tuned["bwd"]["ratio"]["unique_bytes"] == pytest.approx({"float32": 1.38, "bfloat16": 1.74}[dtype], abs=0.01)
    # per warp access the forward re-reads B and C in each of the 16 blocks of 8 channels, the backward in each of
    # its 4 blocks of 32 (and dB, dC where the blocks after the first add to them), and its epilogue reads D once
    # per element (each warp access one sector of its channel)
    assert f["bytes"] == pytest.approx({"float32": 2.00, "bfloat16": 2.10}[dtype], abs=0.01)
    assert b["bytes"] == pytest.approx({"float32": 1.48, "bfloat16": 1.85}[dtype], abs=0.01)
    # one exp(dl*A) per (b, d, t, n) and the model's per-row ones: the forward's exactly; the backward computes
    # exp(dl*A) twice (its state recompute and its reverse step) and softplus' apart from softplus
    assert row["fwd"]["exp"] == row["fwd"]["minimum"]["exp"]
    assert b["exp"] == pytest.approx(1.76, abs=0.01)
    # FMA: the model's plus the sums over the states (scatter sums: 8 adds a lane for 8 sums over 16 lanes, where
    # one butterfly a sum took 32: 2.14x and 2.37x then) and each lane's own per-step terms; backward, every lane of
    # a segment adds its tile's dB, dC to the sums of the tiles before (1.82x when only the first group, which
    # stores them, did: a predicated store instead of a branch, the same warp instructions). The backward's reverse
    # step factors its sums over n (ddl = sum A g + u sum dh B, du = dl sum dh B) and reads dl u staged: 1.88x before.
    # The forward's exp(dl A) as exp2(dl2 A) costs its staging dl * log2(e) and B ln 2 (1.45x before; what the scaling
    # saves, a multiply a (state, step), is inside exp here, which the count does not see: tools/sass_loops.py does)
    assert f["fma"] == pytest.approx(1.46, abs=0.01) and b["fma"] == pytest.approx(1.62, abs=0.01)
    # chains: each thread walks the sequence, one fused multiply-add per step forward, a multiply and a fused
    # multiply-add backward (the carry crosses the loop's back edge as a product); then the reduce kernel's (and
    # the scalings by log2(e) where the chunk is staged and by ln 2 where dA and du are finished: 3 more)
    L = SHAPE[2]
    assert L < row["fwd"]["chain"] <= L + 20 and 2 * L < row["bwd"]["launches"][0]["chain"] <= 2 * L + 27
    assert row["fwd"]["minimum"]["chain"] == scan_model.forward_chain(*SHAPE) < L / 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_conv_moves_its_minimum_bytes_and_computes_what_the_checking_build_does(build, dtype):
    """The branch's GPU conv (csrc/causal_conv1d_kernel.cuh; issue 51, item 5), its SiLU fused as the branch runs
    it, at 700 steps, two tiles of 352 a row: the forward's distinct bytes are its minimum exactly (x read once, u
    written once, taps and bias); the backward's the minimum plus its per-block partial sums of the K + 1 weight
    terms, written and read back by the reduction (the conv's output, recomputed for silu', is never stored). The
    SiLU's sigmoid is an exp and a reciprocal: one of each a step forward, and backward a step of each tile and its
    K - 1 steps after it. The counting build gives the checking build's bits."""
    batch, dim, L, width = 2, 16, 700, 4
    runs = [scan_counts.emulate_conv(scan_counts.load(os.path.join(build, name)), batch, dim, L, dtype, width)
            for name in ("libscan_emu.so", scan_counts.LIB_NAME)]
    assert torch.equal(runs[0]["out"], runs[1]["out"]) and torch.isfinite(runs[1]["out"]).all()
    for a, b in zip(runs[0]["grads"], runs[1]["grads"]):
        assert torch.equal(a, b) and torch.isfinite(b).all()
    fwd, bwd = (scan_counts._kernel(runs[1][k]) for k in ("fwd", "bwd"))
    assert [n["kernel"].split("<")[0] for n in runs[1]["bwd"]] == ["void ssk::conv_bwd_kernel",
                                                                   "void ssk::conv_reduce_kernel"]
    minimum = scan_counts.conv_minimum_bytes(batch, dim, L, dtype, width)
    assert fwd["unique_bytes"] == minimum["fwd"]
    partials = 2 * dim * batch * 2 * (width + 1) * 4  # 2 tiles a row, fp32, written then read
    assert minimum["bwd"] < bwd["unique_bytes"] <= minimum["bwd"] + partials
    assert fwd["exp"] == 2 * batch * dim * L
    assert bwd["exp"] == 2 * batch * dim * 2 * (352 + width - 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_memory_has_no_bank_conflicts_but_the_forwards_scatter_stores(build, dtype):
    """Shared memory at 32 banks of 4 bytes (tools/kernel_emu counts, per warp instruction, the most distinct words
    one bank holds, and the conflicts: the wavefronts beyond the distinct words / 32 that the instruction needs
    at least, so that a 16-byte row read by 32 lanes, 4 wavefronts, is no conflict). The arrays' rows have an odd
    number of words (smem_row) and the backward's three arrays of sums lie a stride apart that is not a multiple
    of 32 words (sums_stride), so no access of the backward has a conflict. The forward's one exception, from
    first principles: after each scatter sum of 8 steps (N = 16: 2 channels a warp), the lanes holding step j of
    channel c store y_s at word (tb + j) * 9 + c and read u at word 2 * ((tb + j) * 9 + c) + 1 (the pair dl2, u),
    and (j, c) = (7, 1) falls on the bank of (0, 0) in both: two wavefronts for each of those two instructions,
    2 x L / 8 a warp. With rows of 8 and 16 words, before, a
    warp's staging stores put consecutive steps on 4 and 2 banks: the forward took 2.13x the wavefronts of its
    accesses here, the backward 1.66x."""
    batch, dim, L, N = SHAPE
    row = counted(build, dtype)
    f, b = row["fwd"], row["bwd"]
    assert b["smem_conflicts"] == 0 and b["smem_wavefronts"] >= b["smem_accesses"] > 0
    # The backward's instructions, from first principles against those before its rows (each (time, channel)'s
    # dl2, dl u, u, dy in one 16-byte row; B, C and dB, dC in pairs), which were 63,872 here: 1 block of 32
    # channels (4 tiles of 8) per 32 channels, so 4 blocks; 4 warps of 2 channels; one chunk of 64 steps. A reverse
    # step of a warp read dl, u, dy, B, C and stored dB, dC (and in tiles after the first read them first): 8 (10)
    # instructions, now 4 (5) with the history's read: 1,024 warp-steps of tile 0 and 3,072 of the others save
    # 4,096 + 15,360; the recompute reads dl, u in one (4,096 warp-steps: 4,096); a tile's staging stores 5 arrays
    # (then dl, u, dy, dout * silu'(z), softplus') in 3 (the row, softplus' and dout * silu'(z): 2 x 16 instructions
    # of 32 lanes, 16 tiles: 512), its epilogue reads 3 in 2 (the row and dout * silu'(z): 1 x 16 x 16: 256); a block
    # stages B, C in one (32 x 4 blocks: 128) and sums the 4 segments' dB, dC pairs (4 x 32 x 4: 512). Total 24,960.
    # Since the blocks of channels sum dB, dC in a chain, a block takes its ticket through shared memory: one store,
    # a load per warp (4 blocks x 5: 20).
    assert b["smem_accesses"] == 63872 - 24960 + 20
    warps = batch * dim // 2  # forward: one tile of 8 channels a block, 4 warps of 2 channels
    assert f["smem_conflicts"] == warps * 2 * (L // 8)
    # beyond those, the staging's pair stores (32 lanes x 8 bytes: two wavefronts, no conflict), 256 + 512 below
    assert f["smem_wavefronts"] - f["smem_accesses"] - f["smem_conflicts"] == 256 + 512
    # The forward's, the same way (16 blocks of 8 channels, 64 warps, one chunk), against 19,200 before its dl, u
    # and B, C were pairs: a step read 4 values, now 2 (64 warps x 64 steps: 8,192), the staging stored dl, u in one
    # (512 of 8 x 64 / 32 per block: 256) and B, C in one (1,024 / 32 per block: 512).
    assert f["smem_accesses"] == 19200 - (8192 + 256 + 512)


def test_shuffles_are_those_of_the_scatter_sums(build):
    """Warp shuffles, from first principles (N = 16: a channel is a group of G = 16 lanes, two channels a warp).
    A scatter sum of 8 values over 16 lanes takes 4 + 2 + 1 shuffles to halve them to one a lane and 1 more to
    cover the 16 lanes. Forward: y of 8 steps in one. Backward, per step: dB and dC summed over the warp's two
    channels (one shuffle each); for every 2 steps, y, ddelta and du in one; after the sequence, each tile's
    ddelta_bias over its lanes (4). With one butterfly per sum and step, as before, it was 4 shuffles a step
    forward and 2 + 3 x 4 backward."""
    batch, dim, L, N = SHAPE
    row = counted(build, "float32")
    warps = batch * dim // 2  # forward: one tile of 8 channels a block, every channel once
    assert row["fwd"]["shuffles"] == warps * (L // 8) * 8
    tiles = dim // 8  # tiles of 8 channels, each walked by the 4 warps of its block
    per_tile = 4 * (L * 2 + (L // 2) * 8 + 4)
    assert row["bwd"]["shuffles"] == batch * tiles * per_tile


def test_predict_prints_the_counts_beside_the_minimum(build, monkeypatch, capsys, tmp_path):
    from vim_ds.cli import bench

    monkeypatch.setenv(scan_counts.ENV_BUILD, build)
    monkeypatch.setattr(scan_counts, "COUNT_SHAPES", ((SHAPE, "float32", "a small shape"),))
    out = tmp_path / "scan.json"
    assert bench.main(["scan", "--predict-only", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    row = counted(build, "float32")
    f = row["fwd"]
    assert (f"| B=1 D=128 L=64 N=16 | float32 | fwd | {f['bytes'] / 1e3:.1f} kB ({f['ratio']['bytes']:.2f}x) | "
            f"{f['unique_bytes'] / 1e3:.1f} kB ({f['ratio']['unique_bytes']:.2f}x) | {f['exp']} (1.00x) |") in text
    counts = json.loads(out.read_text())["counts"]
    assert counts[0]["bwd"]["unique_bytes"] == row["bwd"]["unique_bytes"]
    assert counts[0]["bwd"]["launches"][1]["kernel"].startswith("void ssk::scan_reduce_kernel")


def test_counts_that_cannot_be_made_say_why(monkeypatch, capsys, tmp_path):
    from vim_ds.cli import bench

    monkeypatch.setenv(scan_counts.ENV_BUILD, str(tmp_path))  # no library there
    out = tmp_path / "scan.json"
    assert bench.main(["scan", "--predict-only", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"counts: n/a ({scan_counts.ENV_BUILD}={tmp_path} has no {scan_counts.LIB_NAME}" in text
    assert "has no libscan_emu_count.so" in json.loads(out.read_text())["counts"]["unavailable"]
    assert "Performance model: lower bounds" in text  # the model's part is all there
    # no compiler to build the library with (nothing prebuilt named)
    monkeypatch.delenv(scan_counts.ENV_BUILD)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert bench.main(["scan", "--predict-only"]) == 0
    assert "counts: n/a (no C++ compiler (no-such-compiler) for the kernel emulator)" in capsys.readouterr().out
    # and --no-counts leaves them out
    assert bench.main(["scan", "--predict-only", "--no-counts"]) == 0
    assert "counts" not in capsys.readouterr().out.split("no GPU: measured n/a")[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sass_estimates_layout_is_the_launchers_at_vims_shapes(build, dtype):
    """tools/sass_loops.py's whole-kernel estimate (our_estimate) counts the loops' passes at VIM_LAYOUT: the
    launcher's layout at Vim-small's training shapes (batch 64, L = 197 and 785), which the emulated launcher gives
    here; a launcher that changed its chunk, tiles or channels a block would fail this before the estimate drifted."""
    from test_compile_check import _load_tool

    vim = _load_tool("sass_loops").VIM_LAYOUT
    lib = scan_counts.load(os.path.join(build, scan_counts.LIB_NAME))
    for seqlen in (197, 785):
        shape = (64, 768, seqlen, vim["d_state"])
        # (chunk, tiles, channels a block, blocks of channels a batch row, segments, partials)
        chunk, tiles, rows, _, segments, _ = scan_counts.layout(lib, *shape, dtype, backward=False)
        assert (chunk, tiles, rows, segments) == (vim["chunk"], 1, vim["fwd_rows"], 1)
        chunk, tiles, rows, _, segments, _ = scan_counts.layout(lib, *shape, dtype)
        assert (chunk, tiles, rows, segments) == (vim["chunk"], vim["bwd_tiles"], vim["bwd_tiles"] * vim["bwd_rows"], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU --layouts times the kernel instead of counting")
def test_the_layout_bench_refuses_in_one_line_what_it_cannot_do(monkeypatch, capsys, tmp_path):
    """`vim-ds bench scan --layouts` with nothing to count on (no GPU, no emulator library) or with an option it
    would ignore: one line, exit 2, nothing timed or written."""
    from vim_ds.cli import bench

    monkeypatch.setenv(scan_counts.ENV_BUILD, str(tmp_path))  # no library there
    out = tmp_path / "layouts.json"
    assert bench.main(["scan", "--layouts", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vim-ds bench scan: error: --layouts: no GPU here, and the kernel emulator cannot count "
                              f"instead: {scan_counts.ENV_BUILD}={tmp_path} has no {scan_counts.LIB_NAME}"), err
    assert not out.exists()
    for other in ("--predict", "--predict-only", "--mamba"):
        assert bench.main(["scan", "--layouts", other]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"vim-ds bench scan: error: --layouts times only our kernel's layouts; it does not combine with {other}")


def test_the_layout_bench_counts_what_each_layout_adds(build):
    """`vim-ds bench scan --layouts` without a GPU: the emulator's counts per layout, and the bytes the bench says a
    layout adds by design (scan_layouts.design_bytes, from the layout the launcher reports). Checked where one
    choice alone changes, from first principles, with the sequence in one segment: one channel tile instead of four
    (8 blocks of channels instead of 2) changes no distinct byte while the blocks sum dB, dC in a chain (its flags
    are per batch row and chunk, whatever the blocks); with per-block partials instead, the distinct bytes grow by
    exactly the partials less the chain's flags, 4 times as much with one tile as with four, and the forward is
    untouched; chunks of 16 instead of 32 steps change only the stored states (the forward writes twice as many,
    the backward reads them: each grows by half the difference design_bytes gives for both)."""
    shape = (1, 64, 64, 16)
    layouts = (("own", (0, 0, 1, 0)), ("1 tile", (0, 1, 1, 0)), ("chunk <= 16", (16, 0, 1, 0)),
               ("partials", (0, 0, 1, 1)), ("1 tile, partials", (0, 1, 1, 1)))
    rows = scan_layouts.run_counts(shape, "float32", layouts, os.path.join(build, scan_counts.LIB_NAME))
    own, one_tile, short, partials, one_tile_partials = rows
    assert [r["bwd_layout"] for r in rows] == [[32, 4, 32, 2, 1, 0], [32, 1, 8, 8, 1, 0], [16, 4, 32, 2, 1, 0],
                                               [32, 4, 32, 2, 1, 1], [32, 1, 8, 8, 1, 1]]
    extra = [r["design_bytes"] for r in rows]
    assert extra[0]["partials"] == extra[1]["partials"] == 0 and extra[0]["chain_flags"] == 2 * 32  # 3 ints
    assert extra[3]["partials"] == 2 * 2 * 2 * 16 * 64 * 4 and extra[4]["partials"] == 4 * extra[3]["partials"]
    assert extra[3]["chain_flags"] == extra[4]["chain_flags"] == 0
    assert extra[2]["saved"] == 2 * extra[0]["saved"] == 2 * 2 * 64 * 2 * 16 * 4
    assert one_tile["fwd"] == partials["fwd"] == one_tile_partials["fwd"] == own["fwd"]
    assert one_tile["bwd"]["unique_bytes"] == own["bwd"]["unique_bytes"]
    for row, e in ((partials, extra[3]), (one_tile_partials, extra[4])):
        assert row["bwd"]["unique_bytes"] - own["bwd"]["unique_bytes"] == e["partials"] - extra[0]["chain_flags"]
    half = (extra[2]["saved"] - extra[0]["saved"]) // 2
    assert short["fwd"]["unique_bytes"] - own["fwd"]["unique_bytes"] == half
    assert short["bwd"]["unique_bytes"] - own["bwd"]["unique_bytes"] == half
    # the launcher's own layout is back after the sweep (uncapped, 197 steps are 7 chunks in 4 segments)
    lib = scan_counts.load(os.path.join(build, scan_counts.LIB_NAME))
    assert scan_counts.layout(lib, 1, 64, 197, 16) == (32, 4, 32, 2, 4, 0)
    assert ("1 tile(s) = 8 channels a block, 8 blocks of channels, 1 segment(s), dB/dC in a chain"
            in scan_layouts.count_row(one_tile))
    assert "8 blocks of channels, 1 segment(s), dB/dC partials" in scan_layouts.count_row(one_tile_partials)


def test_the_layout_bench_on_a_gpu_times_each_layout_under_its_caps(build, monkeypatch, tmp_path, capsys):
    """The GPU path of `vim-ds bench scan --layouts`, run here without a GPU: a mock of the GPU only. The GPU
    module's set_tuning and layout are the emulated launcher's (the launcher's own code, built for the CPU by
    tools/kernel_emu), the timing a stand-in that records the caps each call ran under, the inputs placeholders.
    Each layout must be timed under its own caps and reported with the layout the launcher picked under them, the
    launcher's own caps must be back after the run, and --json and the GPU report must carry every row."""
    from vim_ds.cli import bench
    from vim_ds.cli.bench import gpu_report

    lib = scan_counts.load(os.path.join(build, scan_counts.LIB_NAME))
    state = {"caps": (0, 0, 0, 0)}

    class Module:
        def set_tuning(self, chunk=0, tiles=0, target_blocks=0, partials=0):
            before, state["caps"] = state["caps"], (chunk, tiles, target_blocks, partials)
            assert lib.emu_set_tuning(chunk, tiles, target_blocks, partials) is None
            return list(before)

        def layout(self, batch, dim, seqlen, d_state, dtype, backward):
            out = (ctypes.c_longlong * 6)()
            lib.emu_layout(batch, dim, seqlen, d_state, dtype, int(backward), out)
            return list(out)

    class Loaded:
        backend = type("Backend", (), {"module": Module()})()
        reason = None

    timed = []

    def time_backend(backend, inputs, repeat):
        timed.append((inputs["shape"], state["caps"]))
        return 0.001, 0.004 * (1 + 0.25 * (state["caps"][1] == 1))  # one tile "slower", to see the ratio

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(scan_layouts.backends, "load", lambda kind: Loaded())
    monkeypatch.setattr(scan_layouts, "GPU_SHAPES", ((64, 768, 785, 16), (1, 384, 4097, 16)))
    monkeypatch.setattr(scan_layouts, "scan_inputs", lambda *shape_dtype_device: {"shape": shape_dtype_device[:4]})
    monkeypatch.setattr(bench.scan, "bench_scan_backend", time_backend)
    out = tmp_path / "bench_layouts.json"
    assert bench.main(["scan", "--layouts", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(timed) == 2 * 2 * len(scan_layouts.LAYOUTS)
    assert [tuple(c) for _, c in timed] == [tuple(c) for _, c in scan_layouts.LAYOUTS] * 4  # each under its caps
    assert state["caps"] == (0, 0, 0, 0) and scan_counts.layout(lib, 64, 768, 785, 16) == (32, 4, 32, 24, 1, 0)
    by = {(r["shape"], r["dtype"], r["layout"]): r for r in rows}
    big = "B=64 D=768 L=785 N=16"
    # at Vim-small-stride-8's shape: the launcher's own layout (one segment: 64 x 24 blocks are above 1024), one
    # tile (96 blocks of 8 channels), chunks of at most 8 steps, 4x the blocks (4096 aimed at: 4 tiles give
    # 64 x 24 = 1536 blocks, 2 tiles 3072, so one tile, 6144 blocks, and no segments), and dB/dC partials
    assert by[(big, "float32", "own")]["bwd_layout"] == [32, 4, 32, 24, 1, 0]
    assert by[(big, "float32", "1 tile")]["bwd_layout"] == [32, 1, 8, 96, 1, 0]
    assert by[(big, "bfloat16", "chunk <= 8")]["bwd_layout"] == [8, 4, 32, 24, 1, 0]
    assert by[(big, "float32", "4x the blocks")]["bwd_layout"] == [32, 1, 8, 96, 1, 0]
    assert by[(big, "float32", "dB/dC partials")]["bwd_layout"] == [32, 4, 32, 24, 1, 1]
    assert by[(big, "float32", "1 tile")]["vs_own_fwd_bwd"] == pytest.approx(1.25)
    own = by[(big, "float32", "own")]
    assert own["design_bytes"] == scan_layouts.design_bytes(64, 768, 785, 16, [32, 4, 32, 24, 1, 0])
    assert by[(big, "float32", "dB/dC partials")]["design_bytes"]["partials"] == 2 * 2 * 64 * 24 * 16 * 785 * 4
    assert "[cuda] B=64 D=768 L=785 N=16 float32 1 tile" in capsys.readouterr().out
    report = "\n".join(gpu_report._layouts_section(rows, "missing"))
    assert "| B=64 D=768 L=785 N=16 | float32 | 1 tile | 32 | 1 (8) | 96 | 1 (1) | 157 | chain |" in report
    assert "| B=64 D=768 L=785 N=16 | float32 | dB/dC partials | 32 | 4 (32) | 24 | 1 (1) | 157 | partials 309 MB |" \
        in report
    # an extension built before the caps existed: one line, exit 2, nothing timed
    Loaded.backend = type("Backend", (), {"module": object()})()
    timed.clear()
    assert bench.main(["scan", "--layouts"]) == 2 and not timed
    assert "predates the launcher's caps; rebuild it" in capsys.readouterr().err.strip().splitlines()[-1]
