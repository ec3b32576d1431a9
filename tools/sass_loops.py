#!/usr/bin/env python3
"""The instructions an NVIDIA GPU issues in the scan kernels' inner loops, read from the compiled code (SASS).

The kernel emulator counts what the kernels do (bytes, FMA, exp, shared-memory wavefronts); the SASS says what the
GPU must issue for it, addressing, predicates, branches and conversions included. A scheduler issues one warp
instruction a cycle, so a loop whose body is mostly integer work is slower than its FMA count says. This reads a
cubin (tools/compile_check.sh builds one per NVIDIA target, with the extension's own nvcc flags: --use_fast_math,
-lineinfo), disassembles it with nvdisasm (CUDA's, or the copy in triton's wheel that torch's CUDA build brings),
and for each scan kernel instance asked for lists its loops (a backward branch: body = target .. branch), named
after the section of selective_scan_kernel.cuh their source lines lie in ("// ---- 3. reverse recurrence ..."),
with the instructions of one pass through the body by class. A loop of the recurrence computes one exp per state
slot and step (MUFU.EX2 under --use_fast_math), so for the kNPL = 1 instances its instructions per step are its
instructions / its MUFU.EX2 count. For the whole kernel, each loop's body times the passes it makes over a chunk at
the layout Vim trains with gives what a warp issues a (state, step) (our_estimate); mamba_ssm's kernels, compiled
the same way, are read the same way for comparison (--mamba, mamba_estimate).

usage: sass_loops.py CUBIN [--kernel NAME ...] [--json PATH]   (exit 1: a step over its budget; 3: no nvdisasm)
  NAME: a demangled instance such as 'scan_bwd_kernel<__nv_bfloat16, 1, 16>' (default: the forward and backward
  for float and bfloat16 with one state a lane in groups of 16, the instances Vim's d_state 16 trains with).
       sass_loops.py CUBIN --mamba SEQLEN [--mamba SEQLEN ...]
  mamba_ssm's kernels instead (a cubin of `tools/build_mamba_ssm.sh cubin`): for each sequence length, the instances
  its launcher runs for Vim's call (B and C per step, z, softplus), their loop over the states and what a warp
  issues for the whole kernel per (state, step) (mamba_estimate).
"""
import argparse
import collections
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_SOURCE = "selective_scan_kernel.cuh"
DEFAULT_KERNELS = ["scan_fwd_kernel<float, 1, 16>", "scan_bwd_kernel<float, 1, 16>",
                   "scan_fwd_kernel<__nv_bfloat16, 1, 16>", "scan_bwd_kernel<__nv_bfloat16, 1, 16>"]
# Opcode (before the first dot) -> class. Anything else is "other".
CLASSES = {
    "fp32": {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSET", "FSETP", "FCHK", "HFMA2", "HADD2", "HMUL2", "F2FP",
             "DFMA", "DMUL", "DADD", "DSETP"},
    "sfu": {"MUFU"},
    "shared": {"LDS", "STS", "LDSM", "ATOMS"},
    "global": {"LDG", "STG", "LD", "ST"},
    "constant": {"LDC", "ULDC"},
    "shuffle": {"SHFL"},
    "integer": {"IMAD", "IADD3", "IADD", "VIADD", "LEA", "LOP3", "SHF", "ISETP", "IABS", "SEL", "IMNMX", "VIMNMX",
                "MOV", "IMAD.MOV", "CS2R", "S2R", "S2UR", "PRMT", "I2F", "F2I", "I2FP", "F2IP", "FLO", "POPC", "P2R",
                "R2P", "PLOP3", "UIADD3", "UMOV", "USHF", "ULOP3", "UIMAD", "ULEA", "UISETP", "USEL", "BMSK"},
    "control": {"BRA", "BSSY", "BSYNC", "BAR", "EXIT", "CALL", "RET", "WARPSYNC", "NOP", "YIELD", "BREAK", "BMOV"},
}
# The sections (of the "// ---- N. title" markers) that run a recurrence, one exp a state slot and step.
RECURRENCES = r"recurrence|recompute"
# Loops holding more loops than this are the kernels' chunk and tile loops, not listed (their bodies are).
MAX_NESTED = 3
CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}


# What the loops of the recurrences may issue per step at most, on sm_90, for the instances listed by default (the
# counts of 2026-12-01, nvcc 13.0, once the decays are exp2 of a staged dl * log2(e) (ss_exp2), the reverse step's
# sums over n share their factors and it walks its rows a batch at a time, and the backward stages dl * u: the
# backward's reverse step 50.0, its recompute 7.6, its pass 0 10.0, the forward's step 15.2 and its pass 0 13.0;
# 2026-11-30, once the scatter sums' swaps are selects (pick), the backward's lanes that finish them take their
# addresses from lane constants made once a chunk (scatter_slot) and its dB, dC store is predicated instead of
# branched around: 55.5, 9.6, 11.0, 16.2 and 14.0; before that, with the rows of shared memory a constant width
# (bc_cols, dbc_cols) and the backward's steps read through pointers to the thread's columns, 62.5, 9.6, 11.0,
# 17.5-18.8 and 14.0; with the staging rounds, 67.0, 10.6-12.2, 11.8, 19.2-19.6 and 15.0; once the group was a
# template constant and the batches of steps that share a scatter sum ran unguarded, 66.5, 10.6-12.2, 11.8,
# 19.6-19.9 and 15.0; with the group a runtime value and every step guarded, that morning, 92.0, 11.4-12.5, 11.8,
# 29.1-29.2 and 16.0; before every lane ran the step without the `k < ok` branch 96.5 / 97.0, 18.2, 17.8, 32.9 and
# 20.8; before the rows of shared memory 112.0 / 113.0, 18.7-19.2, 21.5, 35.0 / 38.4 and 18.2-21.8): a change that
# makes them issue more instructions fails tools/compile_check.sh, as a spill does. (kernel kind, section pattern)
# -> instructions a step.
BUDGETS = {("scan_bwd_kernel", r"^reverse recurrence"): 50.0, ("scan_bwd_kernel", r"^recompute"): 8.0,
           ("scan_bwd_kernel", r"^pass 0"): 10.0, ("scan_fwd_kernel", r"^the recurrence"): 15.5,
           ("scan_fwd_kernel", r"^pass 0"): 13.0}

# The global loads the staging loops keep in flight together, at least (load_waits: the fewest a wait finds), for
# the instances listed by default on sm_90: a round's loads come before its uses (StageRound in the kernel). The
# forward's round: u, delta and delta_bias of one (channel, step) and B, C of two (state, step)s, 7; the backward's
# B, C of two (state, step)s, 4; its tile's u, delta, dout, z and delta_bias of two (channel, step)s, 10; its finish
# D of two channels, 2. An item at a time, before (2026-11-30 morning), each wait found 2-3, 2, 1 and 1: a round
# trip to memory per item. (kernel kind, section pattern) -> loads.
LOADS_IN_FLIGHT = {("scan_fwd_kernel", r"^stage the chunk"): 7, ("scan_bwd_kernel", r"^stage the chunk's B and C"): 4,
                   ("scan_bwd_kernel", r"^stage the tile's channels"): 10, ("scan_bwd_kernel", r"^finish"): 2}


def check(result: dict, budgets=None, in_flight=None) -> list[str]:
    """One line per problem: a recurrence loop over its budget, a staging loop whose loads wait with fewer in
    flight than its floor, or a budget or floor whose loop is missing."""
    budgets = BUDGETS if budgets is None else budgets
    in_flight = LOADS_IN_FLIGHT if in_flight is None else in_flight
    problems = []
    for kernel, found in result.items():
        for (kind, pattern), least in in_flight.items():
            if not kernel.startswith(kind + "<"):
                continue
            matched = [loop for loop in found if loop["load_waits"] and re.search(pattern, loop["section"])
                       and loop["nested"] <= MAX_NESTED]
            if not matched:
                problems.append(f"{kernel}: no loop of section /{pattern}/ with global loads")
            problems += [f"{kernel}: {loop['section']} (lines {loop['lines'][0]}-{loop['lines'][1]}) waits with "
                         f"{min(loop['load_waits'])} global load(s) in flight, fewer than {least}"
                         for loop in matched if min(loop["load_waits"]) < least]
    for kernel, found in result.items():
        for (kind, pattern), most in budgets.items():
            if not kernel.startswith(kind + "<"):
                continue
            matched = [loop for loop in found if loop["per_step"] and re.search(pattern, loop["section"])]
            if not matched:
                problems.append(f"{kernel}: no loop of section /{pattern}/ with one exp a step")
            problems += [f"{kernel}: {loop['section']} (lines {loop['lines'][0]}-{loop['lines'][1]}) issues "
                         f"{loop['per_step']} instructions a step, over its budget of {most}"
                         for loop in matched if loop["per_step"] > most]
    return problems


# The exit status when no nvdisasm is found (tools/compile_check.sh then reports the step skipped).
NO_NVDISASM = 3


def find_nvdisasm() -> str | None:
    """CUDA's nvdisasm, else the one triton's wheel carries (torch's CUDA build depends on triton)."""
    for candidate in (os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        found = glob.glob(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "nvdisasm"))
        if found:
            return found[0]
    return None


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return {name: pretty.strip().removeprefix("void ").removeprefix("ssk::").split("(")[0]
            for name, pretty in zip(names, out.splitlines())}


def sections(source_lines: list[str]) -> list[tuple[int, str]]:
    """(line, title) of each '// ---- N. ...' marker and of each kernel's start, in order."""
    marks = []
    for number, line in enumerate(source_lines, 1):
        m = re.match(r"\s*// ---- (\d+\..*)", line)
        if m:
            marks.append((number, re.split(r"\. |\(", m.group(1).split(". ", 1)[1])[0].strip().rstrip(",:")))
        m = re.match(r"__global__ .*? (scan_\w+_kernel)\(", line)
        if m:
            marks.append((number, m.group(1) + " (set-up)"))
    return marks


def section_of(line: int, marks: list[tuple[int, str]]) -> str:
    title = "?"
    for start, name in marks:
        if start > line:
            break
        title = name
    return title


def parse(listing: str, source: str = re.escape(KERNEL_SOURCE)
          ) -> tuple[dict[str, list[tuple[int, str, list[int]]]], dict[str, int]]:
    """Per function (mangled name): (offset, instruction, the kernel source's lines it comes from); and the offset
    of each label (branch targets are labels). `source`: a pattern of the kernel source's file name."""
    functions: dict[str, list] = {}
    labels: dict[str, int] = {}
    current = None
    pending: list[int] = []
    waiting: list[str] = []  # labels before the next instruction
    for line in listing.splitlines():
        m = re.match(r"\s*\.text\.(\S+):$", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            pending = []
            continue
        m = re.match(r"(\.L_x_\d+):$", line.strip())
        if m:
            waiting.append(m.group(1))
            continue
        m = re.match(r'\s*//## File ".*?' + source + r'", line (\d+)', line)
        if m:
            # innermost first: "line A inlined at ..., line B": keep every line of the kernel source it names
            pending = [int(x) for x in re.findall(source + r'", line (\d+)', line)]
            continue
        if line.lstrip().startswith("//## File"):
            pending = []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2), pending))
            labels.update((name, int(m.group(1), 16)) for name in waiting)
            waiting = []
    return functions, labels


def unpredicated(instruction: str) -> str:
    """The instruction without its guard predicate (@P0, @!UP1, ...)."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction.strip())


def opcode(instruction: str) -> str:
    text = unpredicated(instruction)
    return text.split()[0] if text else ""


def registers(operands: str) -> list[str]:
    """The general registers an operand list names (R4.64 and [R4.64] name R4 and R5; RZ is none)."""
    regs = []
    for name, wide in re.findall(r"\bR(\d+)(\.64|\.128)?\b", operands):
        count = {".64": 2, ".128": 4}.get(wide, 1)
        regs += [f"R{int(name) + k}" for k in range(count)]
    return regs


def load_waits(body) -> list[int]:
    """The global loads of a loop body grouped by the first instruction that waits for one of them: how many loads
    were in flight when the first result was needed (one pass through the body, in program order). A load's
    destination registers are written when it completes; an instruction that reads one (or writes it again) waits
    for it, and then (conservatively) for every load before it."""
    groups, pending, issued = [], set(), 0
    for _, ins, _ in body:
        op = opcode(ins)
        operands = unpredicated(ins).split(None, 1)
        operands = operands[1] if len(operands) > 1 else ""
        regs = registers(operands)
        if pending and set(regs) & pending:
            groups.append(issued)
            pending, issued = set(), 0
        if op.startswith("LDG"):
            first = operands.split(",")[0]
            pending |= set(registers(first))
            issued += 1
    if issued:
        groups.append(issued)
    return groups


def loops(instructions, labels, marks) -> list[dict]:
    out = []
    for offset, ins, _ in instructions:
        m = re.search(r"(\.L_x_\d+)", ins) if opcode(ins) == "BRA" else None
        target = labels.get(m.group(1)) if m else None
        if target is None or target > offset:
            continue
        body = [(o, i, src) for o, i, src in instructions if target <= o <= offset]
        classes = collections.Counter()
        exps = 0
        for _, i, _ in body:
            op = opcode(i)
            base = op.split(".")[0]
            classes[CLASS_OF.get(base, CLASS_OF.get(op, "other"))] += 1
            exps += op.startswith("MUFU.EX2")
        lines = [line for _, _, src in body for line in src[-1:]]  # the kernel's own line (outermost)
        out.append({"first": target, "last": offset, "instructions": len(body), "classes": dict(classes),
                    "exp": exps, "load_waits": load_waits(body), "lines": [min(lines), max(lines)] if lines else None,
                    "section": collections.Counter(section_of(line, marks) for line in lines).most_common(1)[0][0]
                    if lines else "?"})
    out.sort(key=lambda loop: (loop["first"], -loop["last"]))
    for loop in out:
        inside = [o for o in out if o is not loop and loop["first"] <= o["first"] and o["last"] <= loop["last"]]
        loop["nested"] = len(inside)
        loop["depth"] = sum(1 for o in out
                            if o is not loop and o["first"] <= loop["first"] and loop["last"] <= o["last"])
        # a step of a recurrence computes one exp per state slot (kNPL = 1: one); a loop around other loops that
        # compute exps (the chunk and tile loops) is not a step
        recurrence = (loop["exp"] and re.search(RECURRENCES, loop["section"])
                      and not any(o["exp"] for o in inside))
        loop["per_step"] = round(loop["instructions"] / loop["exp"], 2) if recurrence else None
    return out


def disassemble(cubin: str, nvdisasm: str) -> str:
    return subprocess.run([nvdisasm, "-c", "-gi", cubin], capture_output=True, text=True, check=True).stdout


def report(cubin: str, kernels: list[str], nvdisasm: str) -> dict:
    functions, labels = parse(disassemble(cubin, nvdisasm))
    names = demangle(list(functions))
    with open(os.path.join(ROOT, "csrc", KERNEL_SOURCE)) as f:
        marks = sections(f.read().splitlines())
    result = {}
    for mangled, pretty in names.items():
        if pretty in kernels:
            result[pretty] = loops(functions[mangled], labels, marks)
    missing = [k for k in kernels if k not in result]
    if missing:
        raise SystemExit(f"sass_loops.py: {', '.join(missing)} not in {cubin}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# What a whole kernel issues, not only its recurrences: each loop's body times the passes it makes over a chunk, for
# the instances Vim trains with (one state a lane in groups of 16) in the layout the launcher takes at batch 64 (one
# segment: pass 0 and the combine do not run), over the (state, step)s of a block's chunk. csrc's kThreads, and
# the launcher's layout at B=64 D=768 L=197 and 785, N=16 (tests/test_kernel_counts.py holds these to the
# emulator's launcher): chunks of 32 steps; the forward's blocks 8 channels, the backward's 4 tiles of 8.
KTHREADS = 128
VIM_LAYOUT = {"chunk": 32, "fwd_rows": 8, "bwd_tiles": 4, "bwd_rows": 8, "d_state": 16, "group": 16}
# The loops that walk a chunk's items, by (kernel kind, section): the (channel, step) and (state, step) items a
# thread takes a round (the staging loops and the finish: the kernel's StageItems for these instances) and the global
# accesses a round makes. nvcc unrolls some of these loops over several rounds a pass (the backward's B, C staging
# and its dB, dC store: two), which their global accesses a pass show.
ROUNDS = {("scan_fwd_kernel", "stage the chunk"): ((1, 2), 7),  # u, delta, delta_bias; B and C of two states
          ("scan_fwd_kernel", "epilogue"): ((1, 0), 3),  # z, out (and out read where the second direction adds)
          ("scan_bwd_kernel", "stage the chunk's B and C"): ((0, 2), 4),
          ("scan_bwd_kernel", "stage the tile"): ((2, 0), 10),  # u, delta, dout, z, delta_bias
          ("scan_bwd_kernel", "finish"): ((2, 0), 8),  # D; du, ddelta, dz
          ("scan_bwd_kernel", "the chunk's dB, dC"): ((0, 1), 4)}  # the chain's dB, dC read; dB, dC stored


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def our_passes(kind: str, loop: dict, layout: dict = VIM_LAYOUT) -> int:
    """The passes `loop` (of kernel kind scan_fwd_kernel / scan_bwd_kernel) makes a chunk (the backward's tile loops:
    a tile): a recurrence a step a lane per exp; a loop over the chunk's items (ROUNDS) its channels' and states'
    items over the rounds a pass takes, kThreads threads a round; the chain's wait (fewer accesses than a round)
    once; pass 0 none (one segment)."""
    T, N = layout["chunk"], max(layout["d_state"], layout["group"])
    rows = layout["fwd_rows"] if kind == "scan_fwd_kernel" else layout["bwd_rows"]
    section = loop["section"]
    if section.startswith("pass 0"):
        return 0
    if loop["per_step"]:
        return T // loop["exp"]
    for (k, start), ((channels, states), accesses) in ROUNDS.items():
        if k != kind or not section.startswith(start):
            continue
        rounds = loop["classes"].get("global", 0) // accesses
        if rounds == 0:
            return 1  # the chain's wait: one look at its flag when the turn has come
        # (the dB, dC store walks the d_state rows; the staging the rows of B and C, N of them)
        state_rows = layout["d_state"] if start.startswith("the chunk's dB") else N
        return max(_ceil(rows * T, channels * KTHREADS * rounds) if channels else 0,
                   _ceil(state_rows * T, states * KTHREADS * rounds) if states else 0)
    raise ValueError(f"our_passes: no pass count for the {kind} loop '{section}'")


def our_estimate(kernel: str, found: list[dict], layout: dict = VIM_LAYOUT) -> dict:
    """Warp instructions a (state, step) of one of our instances (`found`: its loops()), from the loops inside its
    chunk loop at their passes (our_passes; the backward's tile loop once a tile): `lower` the loops alone, `upper`
    with the straight code of the chunk and tile loops once a pass (both sides of its branches, the partial chunk's
    code included); the code before and after the chunks (once a segment) is left out. `recurrences` the
    recurrence loops alone."""
    kind = kernel.split("<")[0]
    inner = [loop for loop in found if loop["nested"] == 0 and loop["depth"] >= 1]
    recurrence = next(loop for loop in inner if loop["per_step"])
    around = sorted((loop for loop in found if loop is not recurrence and loop["first"] <= recurrence["first"]
                     and recurrence["last"] <= loop["last"]), key=lambda loop: loop["last"] - loop["first"])
    tiles = layout["bwd_tiles"] if kind == "scan_bwd_kernel" else 1
    chunk_loop, tile_loop = around[-1], (around[0] if len(around) > 1 else None)

    def within(loop, outer):
        return outer is not None and outer["first"] <= loop["first"] and loop["last"] <= outer["last"]

    lower = recurrences = 0.0
    straight_chunk, straight_tile = chunk_loop["instructions"], tile_loop["instructions"] if tile_loop else 0
    for loop in inner:
        if not within(loop, chunk_loop):
            continue
        times = our_passes(kind, loop, layout) * (tiles if within(loop, tile_loop) else 1)
        lower += loop["instructions"] * times
        recurrences += loop["instructions"] * times if loop["per_step"] else 0
        if within(loop, tile_loop):
            straight_tile -= loop["instructions"]
        else:
            straight_chunk -= loop["instructions"]
    if tile_loop is not None:
        straight_chunk -= tile_loop["instructions"]
    upper = lower + straight_chunk + tiles * straight_tile
    rows = layout["fwd_rows"] if kind == "scan_fwd_kernel" else layout["bwd_rows"] * tiles
    elements = rows * layout["d_state"] * layout["chunk"] / (KTHREADS // 32)  # a warp's share of a block's chunk
    return {"lower": round(lower / elements, 3), "upper": round(upper / elements, 3),
            "recurrences": round(recurrences / elements, 3)}


# What the whole kernels may issue at most (our_estimate's upper bound, warp instructions a (state, step)), on sm_90
# for the instances listed by default: the counts of 2026-12-01, 1.21-1.23 forward and 2.75-2.76 backward (of
# 2026-11-30, session 28: 1.25-1.26 and 2.99-3.00), with room for rounding; tools/compile_check.sh fails above them,
# as above a loop's budget.
KERNEL_BUDGETS = {"scan_fwd_kernel": 1.25, "scan_bwd_kernel": 2.80}


def check_kernels(result: dict, budgets=None) -> list[str]:
    """One line per instance whose whole kernel (our_estimate's upper bound) issues more than its budget."""
    budgets = KERNEL_BUDGETS if budgets is None else budgets
    problems = []
    for kernel, found in result.items():
        most = budgets.get(kernel.split("<")[0])
        upper = our_estimate(kernel, found)["upper"]
        if most is not None and upper > most:
            problems.append(f"{kernel}: the whole kernel issues {upper} warp instructions a (state, step), over its "
                            f"budget of {most}")
    return problems


def estimate_text(result: dict) -> str:
    return "\n".join(f"{kernel}: the whole kernel {e['lower']:.2f}-{e['upper']:.2f} warp instructions a (state, step) "
                     f"(recurrences {e['recurrences']:.2f}), at Vim's layout (VIM_LAYOUT)"
                     for kernel, e in ((k, our_estimate(k, found)) for k, found in result.items()))


# ---------------------------------------------------------------------------------------------------------------
# mamba_ssm's kernels (mamba-ssm's csrc/selective_scan), read for comparison: a block per (batch, channel), its
# threads each holding `items` consecutive steps of a chunk of threads x items steps; per chunk a loop over the states
# runs, for each state, the items' exps, a block-wide scan of (decay, input) pairs and their sums over the state
# (the backward both scans, and dB, dC per step added to global memory with atomics).
MAMBA_SOURCES = r"selective_scan_(?:fwd|bwd)_kernel\.cuh"
MAMBA_DTYPES = {"bf16": "c10::BFloat16", "fp32": "float"}


def mamba_launch(seqlen: int) -> tuple[int, int]:
    """(threads, items a thread) mamba_ssm's launcher takes for a sequence on NVIDIA, forward and backward alike
    (its selective_scan_fwd_cuda / selective_scan_bwd_cuda)."""
    for longest, threads, items in ((128, 32, 4), (256, 32, 8), (512, 32, 16), (1024, 64, 16)):
        if seqlen <= longest:
            return threads, items
    return 128, 16


def mamba_instance(kind: str, seqlen: int, dtype: str) -> str:
    """The demangled instance of Vim's call (B and C per step, z, softplus; real A) at a sequence length."""
    threads, items = mamba_launch(seqlen)
    even = str(seqlen % (threads * items) == 0).lower()
    t = MAMBA_DTYPES[dtype]
    if kind == "fwd":  # <threads, items, rows, even, variable B, variable C, z, input, weight>
        return (f"selective_scan_fwd_kernel<Selective_Scan_fwd_kernel_traits<{threads}, {items}, 1, {even}, "
                f"true, true, true, {t}, float> >")
    # <threads, items, even, variable B, variable C, softplus, z, input, weight>
    return (f"selective_scan_bwd_kernel<Selective_Scan_bwd_kernel_traits<{threads}, {items}, {even}, true, true, "
            f"true, true, {t}, float> >")


def mamba_estimate(found: list[dict], total: int, seqlen: int, d_state: int) -> dict:
    """What one of mamba_ssm's instances issues, from its loops (loops()) and its instruction count `total`: the
    state loop (the innermost loop with exps, one a thread's item; the loops nvcc makes of the shuffles' out-of-line
    slow paths start inside it and are not it), the chunk loop around it, and per warp a pass of the chunk loop for
    each chunk, with the state loop's body d_state times, and the code outside once; per (state, step) of the
    sequence: the block's warps' instructions over seqlen x d_state (`per_element`; `lower`: the state loop's alone,
    as our_estimate's lower bound). Static counts: both sides of a branch count, as in the loops' listings above."""
    candidates = [loop for loop in found if loop["exp"] and loop["nested"] == 0 and loop["depth"] >= 1]
    if not candidates:
        raise ValueError("no loop over the states (an innermost loop with exps inside another loop)")
    state = max(candidates, key=lambda loop: (loop["exp"], loop["instructions"]))
    chunk = min((loop for loop in found if loop is not state and loop["first"] <= state["first"]
                 and state["last"] <= loop["last"]), key=lambda loop: loop["last"] - loop["first"])
    threads, items = mamba_launch(seqlen)
    chunks = _ceil(seqlen, threads * items)
    per_warp = (chunks * (chunk["instructions"] - state["instructions"] + d_state * state["instructions"])
                + total - chunk["instructions"])
    lower = threads // 32 * chunks * d_state * state["instructions"] / (seqlen * d_state)
    return {"threads": threads, "items": items, "chunks": chunks, "state_loop": state["instructions"],
            "state_loop_exp": state["exp"], "per_state_step": round(state["instructions"] / state["exp"], 2),
            "chunk_loop": chunk["instructions"], "total": total, "per_warp": per_warp,
            "lower": round(lower, 3), "per_element": round(threads // 32 * per_warp / (seqlen * d_state), 3)}


def mamba_report(cubin: str, seqlens: list[int], nvdisasm: str, d_state: int = 16) -> dict:
    """mamba_estimate for each instance of Vim's call that the cubin holds ({"fwd bf16 L=785": estimate, ..})."""
    functions, labels = parse(disassemble(cubin, nvdisasm), MAMBA_SOURCES)
    names = {pretty: mangled for mangled, pretty in demangle(list(functions)).items()}
    result = {}
    for seqlen in seqlens:
        for kind in ("fwd", "bwd"):
            for dtype in MAMBA_DTYPES:
                name = mamba_instance(kind, seqlen, dtype)
                if name not in names:
                    continue
                instructions = functions[names[name]]
                estimate = mamba_estimate(loops(instructions, labels, []), len(instructions), seqlen, d_state)
                # (keyed by the length: L = 4097 and 6085 run the same instance)
                result[f"{kind} {dtype} L={seqlen}"] = {"kind": kind, "dtype": dtype, "seqlen": seqlen,
                                                        "instance": name, **estimate}
    if not result:
        raise SystemExit(f"sass_loops.py: {cubin} holds none of mamba_ssm's instances for Vim's call at "
                         f"L = {', '.join(map(str, seqlens))} (a cubin of tools/build_mamba_ssm.sh cubin?)")
    return result


def mamba_text(result: dict) -> str:
    return "\n".join(
        f"mamba_ssm {e['kind']} {e['dtype']} L={e['seqlen']} ({e['threads']} threads x {e['items']} items, "
        f"{e['chunks']} chunk(s)): state loop {e['state_loop']} instructions, {e['per_state_step']:.1f} a (state, "
        f"step); the kernel {e['lower']:.2f}-{e['per_element']:.2f} warp instructions a (state, step) of the sequence"
        for e in result.values())


def text(result: dict) -> str:
    lines = []
    order = ["fp32", "sfu", "shared", "shuffle", "global", "constant", "integer", "control", "other"]
    for kernel, found in result.items():
        lines.append(kernel)
        for loop in found:
            if loop["nested"] > MAX_NESTED:
                continue  # the chunk and tile loops: their bodies are the loops below
            per = f", {loop['per_step']:.1f} a step" if loop["per_step"] else ""
            if loop["load_waits"]:
                per += f", global loads in flight {'+'.join(map(str, loop['load_waits']))}"
            mix = " ".join(f"{c} {loop['classes'][c]}" for c in order if loop["classes"].get(c))
            indent = "  " * min(loop["depth"], 3)
            lines.append(f"  {indent}{loop['section'][:44]:44s} lines {loop['lines'][0]}-{loop['lines'][1]}: "
                         f"{loop['instructions']} instructions, {loop['exp']} exp{per} ({mix})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cubin")
    ap.add_argument("--kernel", action="append", help="a demangled instance (repeatable)")
    ap.add_argument("--json", help="write the loops as JSON here")
    ap.add_argument("--mamba", type=int, action="append", metavar="SEQLEN",
                    help="read mamba_ssm's kernels at this sequence length instead (repeatable)")
    args = ap.parse_args(argv)
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        print("sass_loops.py: no nvdisasm (CUDA's bin/, or triton's wheel); set NVDISASM", file=sys.stderr)
        return NO_NVDISASM
    if args.mamba:
        result = mamba_report(args.cubin, args.mamba, nvdisasm)
        print(mamba_text(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    result = report(args.cubin, args.kernel or DEFAULT_KERNELS, nvdisasm)
    print(text(result))
    if not args.kernel:
        print(estimate_text(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    problems = check(result) + (check_kernels(result) if not args.kernel else [])
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"sass: {len(result)} instance(s), {len(problems)} problem(s) against the budgets a step and the loads "
          f"in flight")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
