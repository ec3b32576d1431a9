"""Compile the Triton kernels (vim_ds/ops/rms_norm_triton.py: a block's residual add and RMSNorm, forward and
backward) for every GPU target without a GPU, and report each variant's registers and spills.

Triton compiles ahead of time for a named target (``triton.compile`` of the kernel's source for a ``GPUTarget``)
with what its wheel carries: ptxas for NVIDIA, its own LLVM and lld for AMD. So the kernels that Triton's
interpreter checks on CPU (tests/rms_norm_kernels.py) are also compiled here for sm_80, sm_90, sm_100, gfx90a,
gfx942 and gfx950, each variant the models launch: the dtypes of DeepSpeed's bf16 (bf16 hidden and weight, fp32
stream), fp32, fp64 and fp16 autocast (fp32 weight), Vim-tiny's, -small's and -base's widths (192, 384, 768), the
first block (no residual), stochastic depth (a per-sample scale) and the last block's backward (no stream gradient
from downstream). The arguments are what the launchers pass (``forward_launch`` / ``backward_launch`` on meta
tensors), so the signature compiled here is the one a GPU run compiles.

Per variant, on one line: ``TARGET KERNEL regs=N spills=N``. It fails (exit 1) when a variant does not compile, when
one spills (NVIDIA: local memory, from cuobjdump's resource usage; AMD: VGPRs or SGPRs spilled, or scratch), and
when a float64 variant does any float32 arithmetic (its LLVM IR names no ``float`` value): an fp32 scalar argument
added to an fp64 sum, which the interpreter does not show (it keeps a Python float at double precision), gave the
GPU's float64 norm an eps rounded to fp32.

usage: triton_report.py [--json OUT] [--targets T ...]    (T: sm_80, gfx942, ...; default: all)
A target whose backend this Triton lacks is reported "TARGET: not compiled: REASON" and does not fail.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGETS = ("sm_80", "sm_90", "sm_100", "gfx90a", "gfx942", "gfx950")
WIDTHS = (192, 384, 768)
EPS = 1e-5
# (name, hidden, residual (the stream's dtype with it), weight): DeepSpeed's bf16, fp32, fp64, fp16 autocast
DTYPES = (("bf16", "bfloat16", "float32", "bfloat16"), ("fp32", "float32", "float32", "float32"),
          ("fp64", "float64", "float64", "float64"), ("fp16", "float16", "float32", "float32"))
_FLOAT32_VALUE = re.compile(r"\bfloat\b")


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget

    if name.startswith("sm_"):
        return GPUTarget("cuda", int(name[3:]), 32)
    return GPUTarget("hip", name, 64)


def variants():
    """[(name, Launch)]: every dtype at every width with all of a kernel's options on, and at 384 in bf16 each
    option off in turn."""
    import torch

    from vim_ds.ops import rms_norm_triton as k

    meta = torch.device("meta")
    out = []

    def add(dt, dim, residual, scale, downstream):
        name, hd, rd, wd = dt
        hidden_dtype, stream_dtype, weight_dtype = getattr(torch, hd), getattr(torch, rd), getattr(torch, wd)
        hidden = torch.empty(4, 9, dim, device=meta, dtype=hidden_dtype)
        res = torch.empty(4, 9, dim, device=meta, dtype=stream_dtype) if residual else None
        weight = torch.empty(dim, device=meta, dtype=weight_dtype)
        sc = torch.empty(4, device=meta, dtype=hidden_dtype) if scale else None
        stream_dt = stream_dtype if residual else torch.promote_types(hidden_dtype, torch.float32)
        (normed, stream, rstd), fwd = k.forward_launch(hidden, res, weight, EPS, stream_dt, sc)
        dsi = torch.empty_like(stream) if downstream else None
        _, bwd = k.backward_launch(torch.empty_like(normed), dsi, stream, weight, rstd, hidden_dtype, sc)
        tag = f"{name},d{dim}" + (",residual" if residual else "") + (",scale" if scale else "")
        out.append((f"add_rms_norm_fwd<{tag}>", fwd))
        out.append((f"add_rms_norm_bwd<{name},d{dim}" + (",downstream" if downstream else "")
                    + (",scale" if scale else "") + ">", bwd))

    for dt in DTYPES:
        for dim in WIDTHS:
            add(dt, dim, True, True, True)
    bf16 = DTYPES[0]
    add(bf16, 384, False, False, False)
    add(bf16, 384, True, False, True)
    add(bf16, 384, False, True, False)
    return out


def signature(launch) -> tuple[dict, dict]:
    """(signature, constexprs) for triton.compile: each argument's Triton type as the launcher would mangle it."""
    from triton.runtime.jit import mangle_type

    from vim_ds.ops import rms_norm_triton as k

    fn = k._kernels()[launch.kernel]
    names = [p.name for p in fn.params]
    sig = {n: mangle_type(a) for n, a in zip(names, launch.args)}
    sig.update({n: "constexpr" for n in launch.constexprs})
    return sig, dict(launch.constexprs)


def _nvidia_tool(name: str) -> str | None:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else None


def resources(target: str, compiled) -> dict:
    """{regs, spills}: NVIDIA from cuobjdump's resource usage of the cubin (spills: its local memory and stack frame
    bytes / 4), AMD from the code object's metadata in the assembly (VGPR count; VGPR + SGPR spills, or scratch bytes
    / 4)."""
    if target.startswith("sm_"):
        tool = _nvidia_tool("cuobjdump")
        if tool is None:
            raise RuntimeError("no cuobjdump in triton's wheel")
        with tempfile.TemporaryDirectory() as d:
            cubin = Path(d) / "k.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                                   check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
        if len(fields) != 3:
            raise RuntimeError(f"no REG, STACK and LOCAL in cuobjdump's resource usage: {usage.strip()[:200]!r}")
        return {"regs": fields["REG"], "spills": (fields["LOCAL"] + fields["STACK"]) // 4}
    asm = compiled.asm["amdgcn"]

    def field(pattern):
        m = re.search(pattern, asm)
        if m is None:
            raise RuntimeError(f"{pattern!r} not in the AMD assembly")
        return int(m.group(1))

    spills = (field(r"\.vgpr_spill_count:\s+(\d+)") + field(r"\.sgpr_spill_count:\s+(\d+)")
              + field(r"; ScratchSize: (\d+)") // 4)
    return {"regs": field(r"\.vgpr_count:\s+(\d+)"), "spills": spills}


def float32_in_float64(llir: str) -> list[str]:
    """The LLVM IR lines of a kernel that hold a float32 value (declarations aside): none in a float64 variant."""
    return [line.strip() for line in llir.splitlines()
            if _FLOAT32_VALUE.search(line) and not line.lstrip().startswith("declare")]


def compile_launch(launch, target: str, **options):
    """The launch's kernel compiled for ``target`` (``options``: more of Triton's, e.g. maxnreg)."""
    import triton
    from triton.compiler import ASTSource

    from vim_ds.ops import rms_norm_triton as k

    sig, constexprs = signature(launch)
    return triton.compile(ASTSource(k._kernels()[launch.kernel], sig, constexprs), target=gpu_target(target),
                          options={"num_warps": launch.num_warps, **options})


def report(targets=TARGETS) -> tuple[dict, list[str]]:
    """({target: {"compiled": {variant: {regs, spills}}} or {"not compiled": reason}}, problems)."""
    results, problems = {}, []
    todo = variants()
    for target in targets:
        try:
            compile_launch(todo[0][1], target)
        except Exception as exc:  # this Triton has no backend for it (e.g. an older wheel without gfx950)
            results[target] = {"not compiled": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"{target}: not compiled: {results[target]['not compiled']}")
            continue
        compiled = results.setdefault(target, {"compiled": {}})["compiled"]
        for name, launch in todo:
            try:
                kernel = compile_launch(launch, target)
            except Exception as exc:
                problems.append(f"{target} {name}: does not compile ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:300]})")
                continue
            try:
                row = resources(target, kernel)
            except Exception as exc:
                problems.append(f"{target} {name}: compiled, but its resources could not be read ({exc})")
                continue
            compiled[name] = row
            print(f"{target} {name} regs={row['regs']} spills={row['spills']}")
            if row["spills"]:
                problems.append(f"{target} {name}: spills {row['spills']} registers")
            if "<fp64" in name and (lines := float32_in_float64(kernel.asm["llir"])):
                problems.append(f"{target} {name}: float32 values in a float64 kernel, e.g. {lines[0]}")
    return results, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the report here as JSON")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
    try:
        import triton  # noqa: F401
    except ImportError:
        print("SKIP: triton is not installed")
        return 3
    results, problems = report(args.targets)
    if args.json:
        Path(args.json).write_text(json.dumps({"targets": results, "problems": problems}, indent=1))
    count = sum(len(r.get("compiled", {})) for r in results.values())
    print(f"triton: {count} variant(s) compiled, {len(problems)} problem(s)")
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
