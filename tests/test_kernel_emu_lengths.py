"""The GPU kernels' device code in the CPU emulator (tools/kernel_emu): forward, the last state the kernel writes
(with the state one step before the end as a negative control that must fail) and all gradients against the
float64 reference, reverse mode off and on, from zero and from an initial state h0 with a gradient on the last
state (dh0 checked too; controls: the scan from zero, dh0 without the last state's gradient), as 32-lane warps
(CUDA branch) and 64-lane wavefronts (HIP branch).

Here only the short Vim lengths (up to 197, past a chunk boundary); `tools/kernel_emu/run.sh --lengths` runs
them all, up to 6085. Then, in the same run, the layouts `vim-ds bench scan --layouts` times on a GPU.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "tools", "kernel_emu")


@pytest.fixture(scope="module")
def emu_lib(request):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    # built once per test run (tests/conftest.py), shared with test_compile_check.py's emulator run
    return os.path.join(request.getfixturevalue("kernel_emu_build"), "libscan_emu.so")


@pytest.mark.parametrize("warp", [32, 64])
def test_emulated_kernels_short_lengths_both_directions(emu_lib, warp):
    env = {**os.environ, "SCAN_EMU_LIB": emu_lib, "EMU_MAX_LENGTH": "197", "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, os.path.join(EMU, "run_emu.py"), "--lengths", "--layouts", "--warp",
                          str(warp)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the launcher's layout capped as `vim-ds bench scan --layouts` caps it on a GPU (shorter chunks, fewer channel
    # tiles, no segments or more): each cap gives the layout worked out by hand in run_emu.py, the kernels compute
    # the scan under it (float64 and float32, against the reference), with the same bits in another thread/block
    # order, and the launcher's own layout is back after it
    # (the backward's blocks of channels summing dB, dC in a chain, or as partials the reduction adds)
    assert res.stdout.count(f"warp {warp} caps") == 5 and "worst over layouts:" in res.stdout, res.stdout
    assert "1 tile(s) of 8 channels, 5 blocks of channels, 7 segments, chain" in res.stdout, res.stdout
    assert "1 tile(s) of 8 channels, 5 blocks of channels, 7 segments, partials" in res.stdout, res.stdout
    assert "2 tile(s) of 8 channels, 3 blocks of channels, 1 segments, chain" in res.stdout, res.stdout
    # under each layout a bidirectional mixer's second direction adds its scan's out and its conv's dx into the
    # first's (ScanArgs/ConvArgs::accumulate): the bits of the sum, each element added once, the rest unchanged
    assert res.stdout.count("out and the conv's dx added into") == 5, res.stdout
    assert res.stdout.count("reverse=True") == 5 and res.stdout.count(f"warp {warp} L=") == 10, res.stdout
    assert f"warp {warp} deterministic" in res.stdout, res.stdout
    # every length checked the kernel's last state, L = 65 and 197 with several segments along the sequence (how
    # many depends on the chunk length, which the HIP branch keeps shorter: 32 KiB of shared memory, not 48)
    assert "last_state" in res.stdout.split("worst over lengths:")[1], res.stdout
    segments = {int(L): int(n) for L, n in re.findall(r"L= *(\d+) dim= *\d+ segments= *(\d+)", res.stdout)}
    assert segments[65] > 1 and segments[197] > 1, res.stdout
    assert f"warp {warp} last_state control: the state one step early is off by" in res.stdout, res.stdout
    # the initial state in both directions, over several segments (L = 65, 197), and without it
    for reverse in ("False", "True"):
        line = rf"L= *(65|197) dim= *\d+ segments= *\d+ reverse={reverse} *state=True"
        assert re.search(line, res.stdout), res.stdout
    assert res.stdout.count("state=False") >= 4, res.stdout
    assert f"warp {warp} initial-state controls: the scan from zero is off by" in res.stdout, res.stdout


@pytest.mark.slow
def test_a_block_waiting_for_one_that_has_not_run_stops_the_emulator(emu_lib, tmp_path):
    """The backward's blocks of channels add their dB, dC sums in a chain, each waiting for the one before
    (csrc/selective_scan_kernel.cuh, chain_wait), and take their work by ticket in the order they start
    (block_ticket), because a GPU may start a grid's blocks in any order: a block waiting for one that has not
    started could wait forever. The emulator runs blocks one after another, in any order, so there a wait that
    does not end at once is that hang, and it stops with a message. The kernel with its work mapped by block index
    instead of ticket, built here, must hit it when the blocks run in descending order; the real one (emu_lib) must
    not, in the same order (blocks 0 and 1 of a batch row: 64 channels, 4 tiles of 8 a block)."""
    src = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc"), src)
    kernel = src / "selective_scan_kernel.cuh"
    text = kernel.read_text()
    ticket = "chained ? block_ticket(p.flags + int64_t(p.batch) * p.n_chunks) : blockIdx.x"
    assert text.count(ticket) == 1
    kernel.write_text(text.replace(ticket, "blockIdx.x"))
    subprocess.run(["bash", os.path.join(EMU, "build.sh"), "--check", str(tmp_path / "build"), str(src)], check=True,
                   capture_output=True, env={**os.environ, "PYTHON": sys.executable})
    case = ("import torch, run_emu; run_emu.case(torch.float32, 1, 64, 70, 16, True, True, True, True, seed=1, "
            "order=1); print('ran')")
    runs = {}
    for name, lib in (("ticket", emu_lib), ("block index", str(tmp_path / "build" / "libscan_emu.so"))):
        runs[name] = subprocess.run([sys.executable, "-c", case], capture_output=True, text=True, timeout=300,
                                    cwd=EMU, env={**os.environ, "SCAN_EMU_LIB": lib, "PYTHONPATH": ROOT})
    assert runs["ticket"].returncode == 0 and "ran" in runs["ticket"].stdout, runs["ticket"].stderr[-3000:]
    hung = runs["block index"]
    assert hung.returncode != 0 and "ran" not in hung.stdout, hung.stdout[-2000:]
    assert "EMU FATAL: a block waits for a block that has not run (the kernel would hang)" in hung.stderr, \
        hung.stderr[-2000:]
