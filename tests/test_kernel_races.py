"""Races in the GPU kernels, found without a GPU: the kernel emulator's counting build logs every access each block
makes to shared memory and to the launch's buffers, by thread and by round of its scheduler, and reports each pair
of accesses to the same bytes by two threads that nothing orders on a GPU, one of them a write
(tools/kernel_emu/emu_race.cpp, `run_emu.py --races`).

The emulator's results cannot show these: it runs a block's threads one after another between switch points, it
makes a shuffle a switch point of the whole block, where a GPU's shuffle waits for one warp's lanes only, and it
runs blocks one after another. So a write another warp reads without a barrier between them, one lane's write
another lane of its warp reads before a barrier, or a block's store the next block reads before the flag says it is
there, gives the right numbers there in a given order, and on a GPU whatever the race gives.

- The kernels as they are: no such pair over every instance Vim's shapes reach, as 32-lane warps and as 64-lane
  wavefronts, but the one pair marked in the kernel source as a benign race within a warp (the backward's dB, dC
  sums, which the lanes of the other groups of a warp read and discard while the first group stores them).
- Between blocks: the backward's blocks of channels add their dB, dC sums in a chain, ordered by a flag each block
  sets (a release) and the next reads (an acquire); a read of another block's write that no such pair orders is a
  race.
- The negative control: the same kernels with three barriers taken out (the backward's block ticket, which thread 0
  writes to shared memory and every thread reads; the chain's, before thread 0 sets the flag; the last level of the
  conv backward's tree sum, which threads 1..K read from thread 0) and the mark taken off. Their results are still
  right (threads in ascending order, blocks one after another), and the check reports each pair at its lines:
  between warps, between blocks (the next block's reads of the sums) and within a warp twice.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EMU = REPO / "tools" / "kernel_emu"
BENIGN = "benign race within a warp"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def build(request):
    if shutil.which(os.environ.get("CXX", "g++")) is None or shutil.which("addr2line") is None:
        pytest.skip("no C++ compiler or addr2line for the kernel emulator")
    return request.getfixturevalue("kernel_emu_build")


def line_of(path: Path, text: str, after: str | None = None) -> int:
    """The number of the one line of `path` holding `text` (after the line holding `after`, when given)."""
    lines = path.read_text().splitlines()
    start = 0 if after is None else next(i for i, line in enumerate(lines) if after in line) + 1
    hits = [i + 1 for i, line in enumerate(lines) if i >= start and text in line]
    assert hits, f"{text!r} not in {path.name}"
    return hits[0]


def run_races(lib_dir: str, args=(), program: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SCAN_EMU_LIB": os.path.join(lib_dir, "libscan_emu.so")}
    cmd = [sys.executable, str(EMU / "run_emu.py"), "--races", *args] if program is None else \
        [sys.executable, "-c", program]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)


@pytest.mark.parametrize("warp", [32, 64])
def test_no_two_threads_race_in_any_instance_vims_shapes_reach(build, warp):
    """32-lane warps (CUDA) and 64-lane wavefronts (the HIP branch of the same source, which takes other paths)."""
    res = run_races(build, ("--warp", str(warp)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert out.strip().splitlines()[-1] == f"warp {warp} races: none"
    # every instance family ran: one state a lane with groups of 8, 16 and 32, two states a lane, each dtype, the
    # combine and reduce passes, the conv both ways with its reduction
    instances = re.search(r"instances: (.*)", out).group(1)
    bf16 = "__nv_bfloat16" if warp == 32 else "hip_bfloat16"
    for name in ("scan_fwd_kernel<float, 1, 8>", "scan_bwd_kernel<float, 1, 16>", f"scan_bwd_kernel<{bf16}, 1, 32>",
                 "scan_bwd_kernel<float, 2, 0>", "scan_bwd_kernel<double, 1, 16>", "scan_fwd_kernel<__half, 1, 16>",
                 "scan_combine_kernel", "scan_reduce_kernel", f"conv_fwd_kernel<{bf16}>", "conv_bwd_kernel<double>",
                 "conv_reduce_kernel"):
        assert name in instances, name
    # the one pair allowed is the marked one: the first group's store of the dB, dC sums, the others' read
    kernel = REPO / "csrc" / "selective_scan_kernel.cuh"
    read = line_of(kernel, BENIGN)
    store = line_of(kernel, "if (k < lead) smem_store(e, dbc);", after=BENIGN)
    allowed = re.search(r'allowed as marked "[^"]*": (.*)', out).group(1)
    assert re.fullmatch(rf"selective_scan_kernel\.cuh:{store}; selective_scan_kernel\.cuh:{read} \(\d+ pairs of "
                        r"accesses\)", allowed), allowed


# Runs cases of run_emu.py in ascending thread order, the races noted (check_races) and the numbers asserted as
# always; prints the pairs found.
PROGRAM = """
import sys
sys.argv = ["run_emu.py", "--races"]
sys.path.insert(0, "tools/kernel_emu")
import torch
import run_emu
run_emu.case(torch.float32, 2, 40, 197, 16, True, True, True, True, seed=5, order=0, state=True)
run_emu.conv_case(torch.float32, 2, 3, 197, 4, True, False, seed=8, order=0, silu=True)
for (kind, where), (first, n) in run_emu.RACE_LOG["found"].items():
    print(f"FOUND {kind} [{where}]")
print("numbers right")
"""


def test_barriers_taken_out_are_races_though_the_numbers_stay_right(build, tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(REPO / "csrc", csrc)
    scan, conv = csrc / "selective_scan_kernel.cuh", csrc / "causal_conv1d_kernel.cuh"
    text = scan.read_text()
    ticket = "  if (threadIdx.x == 0) *slot = atomicAdd(counter, 1u);\n  __syncthreads();\n"
    release = "  __syncthreads();\n  if (threadIdx.x == 0) atomicExch(flag, next);\n"
    assert text.count(ticket) == 1 and text.count(release) == 1 and text.count(BENIGN) == 1
    scan.write_text(text.replace(ticket, ticket.replace("__syncthreads();", "(void)0;"))
                    .replace(release, release.replace("__syncthreads();", "(void)0;"))
                    .replace(BENIGN, "read while the first group stores"))
    text = conv.read_text()
    tree = "    if (int(threadIdx.x) < half)\n"
    last = text.index("  __syncthreads();\n", text.index(tree))
    conv.write_text(text[:last] + "  (void)0;\n" + text[last + len("  __syncthreads();\n"):])
    lib = tmp_path / "lib"
    subprocess.run(["bash", str(EMU / "build.sh"), "--count", str(lib), str(csrc)], check=True, capture_output=True)
    res = run_races(str(lib), program=PROGRAM)
    assert res.returncode == 0 and "numbers right" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    found = set(re.findall(r"FOUND (.*)", res.stdout))
    s, c = "selective_scan_kernel.cuh", "causal_conv1d_kernel.cuh"
    want = {
        # thread 0 stores the ticket, the others (all warps) read it
        f"between warps (shared) [{s}:{line_of(scan, '*slot = atomicAdd')}; {s}:{line_of(scan, 'return *slot;')}]",
        # thread 0 adds the tree's last level, threads 1..K of its warp read the sums
        f"within a warp, unordered (shared) [{c}:{line_of(conv, '+= sums[k * kThreads + threadIdx.x + half]')}; "
        f"{c}:{line_of(conv, '= sums[threadIdx.x * kThreads];')}]",
        # the pair the mark allowed
        f"within a warp, unordered (shared) [{s}:{line_of(scan, 'if (k < lead) smem_store(e, dbc);')}; "
        f"{s}:{line_of(scan, 'read while the first group stores')}]",
    }
    assert want <= found, f"missing: {want - found}; found: {found}"
    # the chain's release before the block's sums are all stored: the next block reads them, and stores its own over
    # them, unordered
    lines = scan.read_text().splitlines()
    chain = [pair for pair in found if pair.startswith("between blocks (global)")]
    pairs = [[lines[int(n) - 1] for n in re.findall(rf"{s}:(\d+)", pair)] for pair in chain]
    stores = re.compile(r"d[BC]\[off\] = before_")
    assert any("load_fresh(d" in later for _, later in pairs), chain
    assert all(stores.search(earlier) and ("load_fresh(d" in later or stores.search(later))
               for earlier, later in pairs), chain
