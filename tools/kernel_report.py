"""Resource report of the GPU selective-scan kernels: registers, spills, shared memory (LDS) and occupancy for every
(target, kernel instance), read from the compilers' own output, so no GPU is needed. tools/compile_check.sh calls
it with each target's compiler log; tests/test_compile_check.py imports it (parsers and the occupancy model).

usage: kernel_report.py --csrc DIR --json OUT [--compiled TARGET COMPILER LOG]... [--not-compiled TARGET REASON]...

Prints, per compiled target, "TARGET: compiled by COMPILER" and one line per kernel instance:
    TARGET KERNEL regs=N spills=N smem=N occupancy=N% [sgpr_spills=N] [(exempt from the floor)]
and one "TARGET: not compiled: REASON" line per target no available compiler supports; writes the same as JSON;
exits 1 when an instance spills registers (to memory, or on AMD scalar registers into vector lanes), uses scratch,
is missing from a compiled target, or its occupancy is below the floor stated in csrc/selective_scan_kernel.cuh's
opening comment ("Occupancy floor ...: N%").

Fields:
  regs      NVIDIA: registers per thread (ptxas). AMD: VGPRs per lane, arch VGPRs + AGPRs (what limits waves).
  spills    registers spilled to memory. NVIDIA: ptxas's spill-store bytes / 4 (a 32-bit register is 4 bytes).
            AMD: VGPRs spilled (to scratch). Any value > 0 fails the check, as does any scratch (private
            segment) use on AMD, which is where SGPR spills would go once no VGPR lane is left for them.
  sgpr_spills (AMD only) scalar registers spilled into VGPR lanes (v_writelane / v_readlane): no memory traffic,
            but a VALU instruction at every spill and reload and a VGPR held for them; any value > 0 fails the
            check too (the kernel's opening comment, "Registers on AMD", says how the kernels avoid them).
  smem      bytes of shared memory (LDS) per block: static (from the compiler) plus the largest dynamic amount the
            launcher (csrc/selective_scan_cuda.cu, make_layout / launch_scan) requests for that instance over
            the d_state values it serves (mirrored below from csrc/selective_scan_kernel.cuh).
  occupancy resident warps (wavefronts) per SM (CU) over the hardware maximum, for kThreads-thread blocks:
            see nvidia_occupancy / amd_occupancy for the formulas and the sources of their limits.
"""
import argparse
import json
import re
import sys
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------
# Kernel instances the launcher can pick (csrc/selective_scan_cuda.cu: run -> dispatch_npl -> launch ->
# launch_scan / launch_aux). Reverse mode, softplus, D, z and delta_bias are run-time flags, not instances.
# One state a lane: an instance per group size (npl1,g8 / g16 / g32); more: an instance per states a lane, whose
# group (kSeg lanes) is no template constant (g0, left out of the name).
DTYPES = ("fp32", "fp64", "fp16", "bf16")
LAYOUTS = ((1, 8), (1, 16), (1, 32), (2, 0), (4, 0), (8, 0))
ACC_BYTES = {"fp32": 4, "fp64": 8, "fp16": 4, "bf16": 4}


def scan_name(kind, dt, npl, group):
    return f"scan_{kind}<{dt},npl{npl},g{group}>" if group else f"scan_{kind}<{dt},npl{npl}>"


def expected_instances():
    names = [scan_name(kind, dt, npl, g) for dt in DTYPES for npl, g in LAYOUTS for kind in ("fwd", "bwd")]
    names += [f"scan_{kind}<{acc}>" for acc in ("fp32", "fp64") for kind in ("combine", "reduce")]
    # the depthwise causal conv (csrc/causal_conv1d_kernel.cuh, launched by launch_conv)
    names += [f"conv_{kind}<{dt}>" for dt in DTYPES for kind in ("fwd", "bwd")]
    names += [f"conv_reduce<{acc}>" for acc in ("fp32", "fp64")]
    return names


_TYPE_NAMES = {"float": "fp32", "double": "fp64", "__half": "fp16", "__nv_bfloat16": "bf16", "hip_bfloat16": "bf16"}


def instance_name(mangled):
    """Itanium-mangled kernel name -> report name, e.g. _ZN3ssk15scan_fwd_kernelIfLi4ELi0EEEvNS_12KernelParamsE ->
    scan_fwd<fp32,npl4>, _ZN3ssk15scan_bwd_kernelIfLi1ELi16EEEvNS_12KernelParamsE -> scan_bwd<fp32,npl1,g16>. Only
    the kernels of namespace ssk; anything else -> None."""
    m = (re.match(r"_ZN3ssk\d+(scan)_(fwd|bwd|combine|reduce)_kernelI(.*)EEvNS_12KernelParamsE$", mangled)
         or re.match(r"_ZN3ssk\d+(conv)_(fwd|bwd|reduce)_kernelI(.*)EEvNS_10ConvParamsE$", mangled))
    if not m:
        return None
    op, kind, args = m.groups()
    m_type = re.match(r"(f|d|\d+(?:__half|__nv_bfloat16|hip_bfloat16))(?:Li(\d+)ELi(\d+)E)?$", args)
    if not m_type:
        return None
    code, npl, group = m_type.groups()
    dtype = {"f": "float", "d": "double"}.get(code) or re.sub(r"^\d+", "", code)
    dt = _TYPE_NAMES[dtype]
    return scan_name(kind, dt, npl, int(group)) if npl else f"{op}_{kind}<{dt}>"


# ---------------------------------------------------------------------------------------------------------------
# The launcher's shared-memory request per instance. Mirrors make_layout (selective_scan_cuda.cu) and
# fwd_smem_elems / bwd_smem_elems (selective_scan_kernel.cuh); the constants are read from the header.

KERNEL_HEADERS = ("selective_scan_kernel.cuh", "causal_conv1d_kernel.cuh")


def read_headers(csrc):
    """The device code's headers as one text: the scan's (its opening comment states the occupancy floor and the
    exemptions), then the conv's."""
    return "\n".join((Path(csrc) / name).read_text() for name in KERNEL_HEADERS)


def kernel_constants(header_text, hip):
    """kThreads, kSeg, kMinGroup, kMaxChunk, kSmemBudget, and the conv's kMaxWidth and kConvItems, as the headers
    (read_headers) define them for CUDA (hip=False) or HIP (hip=True)."""
    consts = {}
    for name in ("kThreads", "kSeg", "kMinGroup", "kMaxChunk", "kMaxWidth", "kConvItems"):
        m = re.search(rf"constexpr int {name} = (\d+);", header_text)
        consts[name] = int(m.group(1))
    m = re.search(r"constexpr int kSmemBudget = (?:SS_HIP \? (\d+) \* 1024 : )?(\d+) \* 1024;", header_text)
    consts["kSmemBudget"] = 1024 * int(m.group(1) if (hip and m.group(1)) else m.group(2))
    return consts


def smem_row(words):
    return words | 1


def bc_cols(dstate, group):
    return max(dstate, group)


def dbc_cols(npl, dstate, group):
    return group if npl == 1 and group <= 16 else dstate


def sums_stride(chunk, cpb):
    return chunk * smem_row(cpb) + cpb // 4


def fwd_smem_elems(c, chunk, dstate, group):
    cpb = c["kThreads"] // group
    return 3 * chunk * smem_row(cpb) + 2 * chunk * smem_row(bc_cols(dstate, group))


def bwd_smem_elems(c, chunk, dstate, group, npl):
    cpb = c["kThreads"] // group
    segments = c["kThreads"] // c["kSeg"]
    return ((chunk + 1) * c["kThreads"] * npl + 6 * chunk * smem_row(cpb) + 3 * sums_stride(chunk, cpb)
            + 2 * chunk * smem_row(bc_cols(dstate, group))
            + 2 * segments * chunk * smem_row(dbc_cols(npl, dstate, group)))


def layout(c, dstate, acc_bytes):
    """(group, npl, chunk) for one d_state, as make_layout picks them."""
    group = c["kMinGroup"]
    while group < dstate and group < c["kSeg"]:
        group *= 2
    need = -(-dstate // group)
    npl = 1
    while npl < need:
        npl *= 2
    chunk = c["kMaxChunk"]
    while chunk > 1 and bwd_smem_elems(c, chunk, dstate, group, npl) * acc_bytes > c["kSmemBudget"]:
        chunk //= 2
    return group, npl, chunk


def dynamic_smem(c, instance, max_dstate=256):
    """Largest dynamic shared memory (bytes) the launcher requests for `instance` over the d_state it serves."""
    m = re.match(r"conv_(fwd|bwd)<(\w+)>$", instance)
    if m:  # conv_smem_elems at the longest tile and the widest conv (the backward with silu: x K-1 steps longer)
        staged = c["kConvItems"] * c["kThreads"] + c["kMaxWidth"] - 1
        elems = (staged if m.group(1) == "fwd"
                 else 2 * staged + c["kMaxWidth"] - 1 + (c["kMaxWidth"] + 1) * c["kThreads"])
        return elems * ACC_BYTES[m.group(2)]
    m = re.match(r"scan_(fwd|bwd)<(\w+),npl(\d+)(?:,g(\d+))?>$", instance)
    if not m:
        return 0  # combine / reduce: no shared memory
    kind, dt, npl, g = m.group(1), m.group(2), int(m.group(3)), int(m.group(4) or 0)
    acc = ACC_BYTES[dt]
    best = 0
    for dstate in range(1, max_dstate + 1):
        group, n, chunk = layout(c, dstate, acc)
        if n != npl or (g and group != g):
            continue
        elems = (fwd_smem_elems(c, chunk, dstate, group) if kind == "fwd"
                 else bwd_smem_elems(c, chunk, dstate, group, npl))
        best = max(best, elems * acc)
    return best


# ---------------------------------------------------------------------------------------------------------------
# Occupancy models.
#
# NVIDIA (per SM), following the CUDA Occupancy Calculator (cuda_occupancy.h in the CUDA toolkit: register
# allocation per warp in units of 256, registers split over 4 sub-partitions; shared memory in units of 128
# bytes plus 1 KiB reserved per block on cc >= 8.0) and the CUDA C++ Programming Guide's table "Technical
# Specifications per Compute Capability" (64 resident warps and 32 resident blocks per SM, 64 K 32-bit registers
# per SM, shared memory per SM 164 KiB on 8.0 and 228 KiB on 9.0 and 10.0):
#   warps_regs  = 4 * floor((65536 / 4) / roundup(regs * 32, 256))
#   blocks      = min(32, floor(64 / wpb), floor(warps_regs / wpb), floor(smem_sm / roundup(smem + 1024, 128)))
#   occupancy   = blocks * wpb / 64                  (wpb = warps per block = kThreads / 32)
NVIDIA_LIMITS = {
    "sm_80": {"smem_per_sm": 164 * 1024},
    "sm_90": {"smem_per_sm": 228 * 1024},
    "sm_100": {"smem_per_sm": 228 * 1024},
}
NV_MAX_WARPS, NV_MAX_BLOCKS, NV_REGS, NV_SUBPART, NV_REG_UNIT, NV_SMEM_UNIT, NV_SMEM_RESERVED = (
    64, 32, 65536, 4, 256, 128, 1024)


def nvidia_occupancy(target, regs, smem, threads):
    lim = NVIDIA_LIMITS[target]
    wpb = -(-threads // 32)
    reg_alloc = -(-regs * 32 // NV_REG_UNIT) * NV_REG_UNIT
    warps_regs = NV_SUBPART * ((NV_REGS // NV_SUBPART) // reg_alloc) if reg_alloc else NV_MAX_WARPS
    smem_alloc = -(-(smem + NV_SMEM_RESERVED) // NV_SMEM_UNIT) * NV_SMEM_UNIT
    blocks = min(NV_MAX_BLOCKS, NV_MAX_WARPS // wpb, warps_regs // wpb, lim["smem_per_sm"] // smem_alloc)
    return blocks * wpb / NV_MAX_WARPS


# AMD CDNA (per CU), following the AMD Instinct MI200 (CDNA2) and MI300 (CDNA3) ISA reference guides and ROCm's
# "GPU memory / occupancy" documentation (a CU has 4 SIMDs, each holding at most 8 wavefronts of 64 lanes; 512
# VGPRs per lane and SIMD, arch VGPRs and AGPRs from one unified file, allocated in granules of 8; 800 SGPRs per
# SIMD, granules of 16; 64 KiB of LDS per CU on CDNA2/CDNA3, 160 KiB on CDNA4, allocated in 512-byte granules),
# and LLVM's AMDGPU backend (AMDGPUUsage: the same register granules; at most 16 workgroups that use barriers per
# CU). The compiler's own "Occupancy [waves/SIMD]" remark is the first min() below without LDS (the test checks
# that they agree):
#   waves_simd  = min(8, floor(512 / roundup(roundup(vgpr, 4) + agpr, 8)), sgpr_waves(sgpr))
# where sgpr_waves is LLVM's table for these GFX9-generation targets (GCNSubtarget::getOccupancyWithNumSGPRs:
# <= 80 SGPRs 10 waves, <= 88 9, <= 100 8, else 7; 800 / roundup(sgpr, 16) gave 7 at 97-100, where the compiler
# says 8: the fp64 conv backward's 98 on gfx942)
#   blocks      = min(16, floor(4 * waves_simd / wpb), floor(lds_cu / roundup(lds, 512)))
#   occupancy   = blocks * wpb / 32                  (wpb = wavefronts per block = kThreads / 64)
AMD_LIMITS = {
    "gfx90a": {"lds_per_cu": 64 * 1024},
    "gfx942": {"lds_per_cu": 64 * 1024},
    "gfx950": {"lds_per_cu": 160 * 1024},
}
AMD_SIMDS, AMD_WAVES_SIMD, AMD_VGPRS, AMD_VGPR_UNIT, AMD_LDS_UNIT, AMD_MAX_WG = 4, 8, 512, 8, 512, 16


def amd_sgpr_waves(sgpr):
    return 10 if sgpr <= 80 else 9 if sgpr <= 88 else 8 if sgpr <= 100 else 7


def amd_waves_per_simd(vgpr, agpr, sgpr):
    unified = -(-(-(-vgpr // 4) * 4 + agpr) // AMD_VGPR_UNIT) * AMD_VGPR_UNIT
    w_v = AMD_VGPRS // unified if unified else AMD_WAVES_SIMD
    return min(AMD_WAVES_SIMD, w_v, amd_sgpr_waves(sgpr))


def amd_occupancy(target, vgpr, agpr, sgpr, lds, threads):
    wpb = -(-threads // 64)
    waves = amd_waves_per_simd(vgpr, agpr, sgpr)
    by_lds = AMD_LIMITS[target]["lds_per_cu"] // (-(-lds // AMD_LDS_UNIT) * AMD_LDS_UNIT) if lds else AMD_MAX_WG
    blocks = min(AMD_MAX_WG, AMD_SIMDS * waves // wpb, by_lds)
    return blocks * wpb / (AMD_SIMDS * AMD_WAVES_SIMD)


# ---------------------------------------------------------------------------------------------------------------
# Compiler output parsers: {mangled kernel name: {field: int}}

def parse_ptxas(text):
    """nvcc -Xptxas -v output of one target."""
    kernels, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            cur = kernels.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["static_smem"] = int(s.group(1)) if s else 0
    return kernels


_AMD_FIELDS = {"SGPRs": "sgpr", "VGPRs": "vgpr", "AGPRs": "agpr", "ScratchSize [bytes/lane]": "scratch",
               "Occupancy [waves/SIMD]": "compiler_waves_per_simd", "SGPRs Spill": "sgpr_spills",
               "VGPRs Spill": "vgpr_spills", "LDS Size [bytes/block]": "static_lds"}


def parse_amdgpu_remarks(text):
    """clang -Rpass-analysis=kernel-resource-usage remarks of one target."""
    kernels, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            cur = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+(.+?): (\d+) \[-Rpass-analysis=kernel-resource-usage\]", line)
        if m and cur is not None and m.group(1) in _AMD_FIELDS:
            cur[_AMD_FIELDS[m.group(1)]] = int(m.group(2))
    return kernels


# ---------------------------------------------------------------------------------------------------------------

def occupancy_floor(header_text):
    m = re.search(r"Occupancy floor[^:\n]*:\s*([0-9.]+)\s*%", header_text)
    if not m:
        raise SystemExit("kernel_report: no 'Occupancy floor ...: N%' in the kernel's opening comment")
    return float(m.group(1))


def comment_text(header_text):
    """The header's lines joined into one, comment slashes dropped, so that a phrase may span comment lines."""
    return " ".join(line.strip().lstrip("/").strip() for line in header_text.splitlines())


def floor_exemptions(header_text):
    """{(target, kernel)} the kernel's opening comment exempts from the floor, each with its reason there, as lines
    "Exempt from the floor: KERNEL on TARGET TARGET ...". Joined comment lines are searched."""
    text = comment_text(header_text)
    out = set()
    for kernel, targets in re.findall(r"Exempt from the floor: (\S+) on ((?:(?:gfx\w+|sm_\d+),? ?)+)", text):
        out |= {(t.strip(","), kernel) for t in targets.split()}
    return out


def sgpr_exemptions(header_text):
    """{(target, kernel)} the kernel's opening comment allows to park scalar registers in vector lanes (AMD), as
    "Exempt from the scalar-register check: KERNEL KERNEL ... on TARGET TARGET ...", with its reason there."""
    text = comment_text(header_text)
    out = set()
    instance = r"scan_\w+<\w+,npl\d+(?:,g\d+)?>"
    for kernels, targets in re.findall(rf"Exempt from the scalar-register check: ((?:{instance} ?)+) on "
                                       r"((?:gfx\w+,? ?)+)", text):
        out |= {(t.strip(","), k) for t in targets.split() for k in kernels.split()}
    return out


def target_rows(target, log_text, header_text):
    """Report rows of one compiled target, and the problems found (missing / unexpected instances, parse gaps)."""
    hip = not target.startswith("sm_")
    c = kernel_constants(header_text, hip)
    parsed = parse_amdgpu_remarks(log_text) if hip else parse_ptxas(log_text)
    by_name, problems = {}, []
    for mangled, f in parsed.items():
        name = instance_name(mangled)
        if name is None:
            problems.append(f"{target}: unexpected kernel {mangled}")
            continue
        by_name[name] = f
    rows = []
    for name in expected_instances():
        f = by_name.get(name)
        if f is None:
            problems.append(f"{target}: no resource report for {name} (not compiled?)")
            continue
        dyn = dynamic_smem(c, name)
        if hip:
            if not {"vgpr", "agpr", "sgpr", "vgpr_spills", "scratch"} <= f.keys():
                problems.append(f"{target}: incomplete remarks for {name}: {f}")
                continue
            smem = f.get("static_lds", 0) + dyn
            row = {"regs": f["vgpr"] + f["agpr"], "spills": f["vgpr_spills"], "smem": smem,
                   "occupancy": amd_occupancy(target, f["vgpr"], f["agpr"], f["sgpr"], smem, c["kThreads"]),
                   "vgpr": f["vgpr"], "agpr": f["agpr"], "sgpr": f["sgpr"], "sgpr_spills": f.get("sgpr_spills", 0),
                   "scratch_bytes_per_lane": f["scratch"], "waves_per_simd": amd_waves_per_simd(
                       f["vgpr"], f["agpr"], f["sgpr"]),
                   "compiler_waves_per_simd": f.get("compiler_waves_per_simd")}
        else:
            if not {"regs", "spill_stores"} <= f.keys():
                problems.append(f"{target}: incomplete ptxas output for {name}: {f}")
                continue
            smem = f["static_smem"] + dyn
            row = {"regs": f["regs"], "spills": -(-f["spill_stores"] // 4), "smem": smem,
                   "occupancy": nvidia_occupancy(target, f["regs"], smem, c["kThreads"]),
                   "spill_store_bytes": f["spill_stores"], "spill_load_bytes": f["spill_loads"],
                   "stack_bytes": f.get("stack", 0)}
        row.update(target=target, kernel=name, dynamic_smem=dyn, mangled=mangled_of(parsed, name))
        rows.append(row)
    return rows, problems


def mangled_of(parsed, name):
    return next((k for k in parsed if instance_name(k) == name), None)


def pct(fraction):
    """0.0625 -> '6.25', 0.125 -> '12.5', 0.5 -> '50': exact for the occupancies the models give."""
    return f"{fraction * 100:.2f}".rstrip("0").rstrip(".")


def format_row(r):
    line = (f"{r['target']} {r['kernel']} regs={r['regs']} spills={r['spills']} smem={r['smem']} "
            f"occupancy={pct(r['occupancy'])}%")
    if "sgpr_spills" in r:
        line += f" sgpr_spills={r['sgpr_spills']}"
    if r.get("exempt"):
        line += " (exempt from the floor)"
    if r.get("sgpr_exempt") and r.get("sgpr_spills", 0) > 0:
        line += " (SGPRs in VGPR lanes allowed)"
    return line


def check_rows(rows, floor_pct, exempt=frozenset(), sgpr_exempt=frozenset()):
    """Failures of the report's rows: spills to memory, SGPRs spilled into VGPR lanes (AMD; except the (target,
    kernel) pairs in `sgpr_exempt`), scratch use, occupancy below the floor (except the pairs in `exempt`)."""
    bad = []
    for r in rows:
        if r["spills"] > 0:
            bad.append(f"{r['target']} {r['kernel']}: {r['spills']} register(s) spilled to memory")
        if r.get("sgpr_spills", 0) > 0 and (r["target"], r["kernel"]) not in sgpr_exempt:
            bad.append(f"{r['target']} {r['kernel']}: {r['sgpr_spills']} SGPR(s) spilled into VGPR lanes")
        if r.get("scratch_bytes_per_lane", 0) > 0:
            bad.append(f"{r['target']} {r['kernel']}: {r['scratch_bytes_per_lane']} bytes of scratch per lane")
        if r["occupancy"] * 100 < floor_pct - 1e-9 and (r["target"], r["kernel"]) not in exempt:
            bad.append(f"{r['target']} {r['kernel']}: occupancy {pct(r['occupancy'])}% below the floor "
                       f"{floor_pct:g}%")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csrc", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--compiled", nargs=3, action="append", default=[], metavar=("TARGET", "COMPILER", "LOG"))
    ap.add_argument("--not-compiled", nargs=2, action="append", default=[], metavar=("TARGET", "REASON"))
    a = ap.parse_args(argv)
    header = read_headers(a.csrc)
    floor_pct = occupancy_floor(header)
    exempt, sgpr_exempt = floor_exemptions(header), sgpr_exemptions(header)
    report = {"occupancy_floor_pct": floor_pct, "exempt_from_floor": sorted(f"{t} {k}" for t, k in exempt),
              "exempt_from_sgpr_check": sorted(f"{t} {k}" for t, k in sgpr_exempt),
              "instances": expected_instances(), "targets": {}}
    problems, rows_all = [], []
    for target, compiler, log in a.compiled:
        rows, probs = target_rows(target, Path(log).read_text(errors="replace"), header)
        for r in rows:
            r["exempt"] = (target, r["kernel"]) in exempt
            r["sgpr_exempt"] = (target, r["kernel"]) in sgpr_exempt
        problems += probs
        rows_all += rows
        report["targets"][target] = {"compiled": True, "compiler": compiler, "kernels": rows}
    for target, reason in a.not_compiled:
        report["targets"][target] = {"compiled": False, "reason": reason}
    for target, compiler, _ in a.compiled:
        rows = report["targets"][target]["kernels"]
        print(f"{target}: compiled by {compiler} ({len(rows)} kernel instances reported)")
        for r in rows:
            print(format_row(r))
    for target, reason in a.not_compiled:
        print(f"{target}: not compiled: {reason}")
    bad = problems + check_rows(rows_all, floor_pct, exempt, sgpr_exempt)
    report["failures"] = bad
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    for b in bad:
        print(f"FAIL: {b}")
    print(f"report: {len(rows_all)} kernel instance(s) on {len(a.compiled)} target(s), floor {floor_pct:g}%, "
          f"{len(bad)} problem(s); JSON in {a.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
