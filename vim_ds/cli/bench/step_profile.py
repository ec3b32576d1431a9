"""`vim-ds bench profile DIR`: where a training step's time goes, from a run's `--profile-steps` profile
(OUTPUT_DIR/profile/summary.json, engine/profiling.py), each large item beside its roofline on the GPU that ran it.

Rooflines (the least time the hardware allows, per step):
- matrix products (aten::mm, bmm, addmm, baddbmm, linear): max(FLOPs / the peak matrix rate, bytes of the operands
  and the result / HBM bandwidth), FLOPs as the profiler counts them, bytes as the recorded shapes give them (a
  weight expanded over the batch, as the mixer's projections pass it, counts once per batch row: an upper bound);
  the rate is bf16's dense tensor-core peak for a bf16 or autocast run, the FP32 peak otherwise (PyTorch leaves
  TF32 off for matmuls);
- the selective scan (vim_ds::selective_scan_fwd/_bwd, and the fused branches vim_ds::ssm_branch_fwd/_bwd and
  vim_ds::bimamba_branch_fwd/_bwd, whose bound is their scans' (two in the latter)): the performance model's bound
  at the op's shapes (scan_model), the backward's as the forward + backward bound less the forward's;
- the depthwise conv (vim_ds::causal_conv1d/_bwd): its bytes (x and out forward; x, dout and dx backward) / HBM
  bandwidth.
Everything else (elementwise ops, norms, copies, the optimizer) has no roofline in that table ("—"); a second table
puts each kind of operator (step_anatomy.KINDS, by each operator's own time: the kernels it launched itself) beside
the same kind in `vim-ds bench anatomy`'s step on paper for the run's model and batch (every operator at its
roofline, times the micro steps an optimizer step takes), and the device time no operator launched (the
optimizer's fused kernels, communication) beside the optimizer's.
"""
from __future__ import annotations

import json
import os

from . import scan_model, step_anatomy

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::linear", "aten::matmul")
# name -> (index of x or u, index of A, direction, scans the op runs)
SCAN_OPS = {"vim_ds::selective_scan_fwd": (0, 2, "fwd", 1), "vim_ds::selective_scan_bwd": (0, 2, "bwd", 1),
            "vim_ds::ssm_branch_fwd": (0, 6, "fwd", 1), "vim_ds::ssm_branch_bwd": (1, 7, "bwd", 1),
            "vim_ds::bimamba_branch_fwd": (0, 6, "fwd", 2), "vim_ds::bimamba_branch_bwd": (1, 7, "bwd", 2)}
CONV_OPS = {"vim_ds::causal_conv1d": 2, "vim_ds::causal_conv1d_bwd": 3}  # (batch, dim, L) tensors it moves


class ProfileError(ValueError):
    """A folder without a readable profile (one line; `vim-ds bench` exits 2)."""


def load(folder: str) -> dict:
    """summary.json of a profile folder (OUTPUT_DIR/profile) or of a run's output folder."""
    for path in (os.path.join(folder, "summary.json"), os.path.join(folder, "profile", "summary.json")):
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    summary = json.load(f)
            except (OSError, ValueError) as e:
                raise ProfileError(f"{path}: not a readable profile summary ({e})") from None
            if not isinstance(summary, dict) or "kernels" not in summary or "ops" not in summary:
                raise ProfileError(f"{path}: not a profile summary written by `vim-ds train --profile-steps`")
            return summary
    raise ProfileError(f"{folder}: no profile here (expected summary.json, or profile/summary.json: what "
                       f"`vim-ds train --profile-steps FIRST:LAST --output_dir DIR` writes)")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def roofline_ms(op: dict, gpu, dtype: str):
    """(least ms per call on `gpu`, what it is bound by), or (None, why not) for an op without one."""
    name, shapes, e = op["name"], op["shapes"], scan_model.ELEM_BYTES.get(dtype, 4)
    if name in MATMULS and op.get("flops"):
        rate = scan_model.BF16_MATMUL_FLOPS[gpu.name] if dtype == "bfloat16" else gpu.fp32_flops
        flops = op["flops"] / max(op["calls"], 1)
        operands = [s for s in shapes if s][:3]
        moved = sum(_numel(s) for s in operands) * e
        if len(operands) >= 2 and len(operands[0]) == len(operands[1]) >= 2:
            moved += _numel(operands[0][:-1]) * operands[1][-1] * e  # the result
        compute, memory = flops / rate * 1e3, moved / gpu.hbm_bytes_per_s * 1e3
        return (compute, "matrix rate") if compute >= memory else (memory, "bytes")
    if name in SCAN_OPS:
        xi, ai, kind, scans = SCAN_OPS[name]
        if len(shapes) <= ai or len(shapes[xi]) != 3 or len(shapes[ai]) != 2:
            return None, "shapes not recorded"
        (batch, dim, seqlen), d_state = shapes[xi], shapes[ai][1]
        b = scan_model.predict(batch, dim, seqlen, d_state, dtype)["bounds"][gpu.name]
        ms = scans * (b["fwd_ms"] if kind == "fwd" else b["fwd_bwd_ms"] - b["fwd_ms"])
        alone = " (the scans alone)" if scans > 1 else " (the scan alone)" if "branch" in name else ""
        return ms, "scan model" + alone
    if name in CONV_OPS:
        if not shapes or len(shapes[0]) != 3:
            return None, "shapes not recorded"
        return CONV_OPS[name] * _numel(shapes[0]) * e / gpu.hbm_bytes_per_s * 1e3, "bytes"
    return None, ""


# the run's precision (DeepSpeed's or autocast's) -> the dtype its matrix products and scans run in
PRECISION_DTYPE = {"bf16": "bfloat16", "autocast-bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def report(summary: dict, dtype: str | None = None, limit: int = 15) -> tuple[str, list]:
    """The profile's two tables as markdown: the top kernels, and the ops beside their rooflines (at `dtype`, by
    default the run's precision); and the ops' rows (with roofline_ms_per_step, ratio and bound_by where a modelled
    GPU ran them)."""
    dtype = dtype or PRECISION_DTYPE.get(summary.get("precision"), "float32")
    gpu = scan_model.gpu_for_device(summary.get("device_name", "")) if summary.get("device") == "cuda" else None
    n = max(summary.get("profiled_steps", 1), 1)
    first, last = summary.get("steps", ["?", "?"])
    lines = [f"Profile of optimizer steps {first}-{last} on {summary.get('device_name', '?')}: "
             f"{summary.get('wall_ms_per_step', 0):.1f} ms a step (wall), {summary.get('timed_ms', 0) / n:.1f} ms "
             f"of {summary.get('time', 'timed')} time a step.", "",
             "| kernel | calls | ms per step | share |", "|---|---|---|---|"]
    for k in summary["kernels"][:limit]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name}` | {k['calls']} | {k['ms_per_step']:.3f} | {100 * k['share']:.1f} % |")
    where = gpu.name if gpu else "none: not a modelled GPU" if summary.get("device") == "cuda" else "none on a CPU"
    lines += ["", f"Operators beside their rooflines (roofline GPU: {where}; {dtype}):", "",
              "| op | shapes | calls per step | ms per step | roofline ms per step | measured / roofline | bound by |",
              "|---|---|---|---|---|---|---|"]
    rows = []
    for op in summary["ops"]:
        row = dict(op)
        per_call, basis = roofline_ms(op, gpu, dtype) if gpu else (None, "")
        if per_call is not None:
            row["roofline_ms_per_step"] = per_call * op["calls"] / n
            row["ratio"] = op["ms_per_step"] / row["roofline_ms_per_step"] if row["roofline_ms_per_step"] else None
            row["bound_by"] = basis
        rows.append(row)
    for row in rows[:limit]:
        shapes = " ".join("x".join(map(str, s)) for s in row["shapes"][:3] if s)
        roof, ratio = row.get("roofline_ms_per_step"), row.get("ratio")
        lines.append(f"| `{row['name']}` | {shapes} | {row['calls'] / n:g} | {row['ms_per_step']:.3f} | "
                     f"{'—' if roof is None else f'{roof:.3f}'} | {'—' if ratio is None else f'{ratio:.1f}x'} | "
                     f"{row.get('bound_by', '—')} |")
    kinds = by_kind(summary, gpu)
    if kinds:
        lines += ["", f"Where the step's time goes, by kind of operator (each operator's own time), beside the step "
                  f"on paper (`vim-ds bench anatomy`; roofline GPU: {where}):", "",
                  "| kind | measured ms per step | on paper ms per step | measured / paper |", "|---|---|---|---|"]
        for k in kinds:
            measured, paper = k["ms_per_step"], k.get("paper_ms_per_step")
            ratio = "—" if measured is None or not paper else f"{measured / paper:.1f}x"
            lines.append(f"| {k['kind']} | {_ms(measured)} | {_ms(paper)} | {ratio} |")
    if gpu:
        lines += ["", "Peak rates: " + scan_model.BF16_SOURCES + "; " + gpu.source]
    return "\n".join(lines) + "\n", rows


def _ms(value) -> str:
    return "—" if value is None else f"{value:.3f}"


OUTSIDE = "no operator's (optimizer, communication, ...)"
# the run's precision -> the paper step's (autocast's matrix products run in bf16: the bf16 step is the nearer floor)
PAPER_PRECISION = {"bf16": "bf16", "autocast-bf16": "bf16", "fp32": "fp32"}


def by_kind(summary: dict, gpu) -> list:
    """[{kind, ms_per_step, paper_ms_per_step}]: the operators' own times by kind (op_times), the device time no
    operator launched beside the optimizer's step on paper, and the total; the paper's column where `gpu` is a
    modelled GPU and the summary names the run's model and batch (runs from before it have neither: [])."""
    op_times, run = summary.get("op_times"), summary.get("run") or {}
    if not op_times:
        return []
    measured = dict.fromkeys((k for k in step_anatomy.KINDS if k != step_anatomy.OPTIMIZER_KIND), 0.0)
    for op in op_times:
        kind = step_anatomy.classify(op["name"])
        if kind is not None:
            measured[kind] += op["ms_per_step"]
    device = summary.get("device_ms_per_step")
    outside = None if device is None else max(device - sum(measured.values()), 0.0)
    paper = {}
    if gpu is not None and run.get("model"):
        kwargs = dict(run.get("model_kwargs") or {}, num_classes=run.get("num_classes", 1000))
        step = step_anatomy.anatomy(run["model"], run["micro_batch"], run["input_size"],
                                    PAPER_PRECISION.get(summary.get("precision"), "fp32"), gpu.name, kwargs, top=0)
        micro = run.get("micro_steps", 1)
        paper = {k["kind"]: k["ms"] * (1 if k["kind"] == step_anatomy.OPTIMIZER_KIND else micro) for k in step["kinds"]}
    rows = [{"kind": kind, "ms_per_step": ms, "paper_ms_per_step": paper.get(kind)} for kind, ms in measured.items()]
    rows.append({"kind": OUTSIDE, "ms_per_step": outside, "paper_ms_per_step": paper.get(step_anatomy.OPTIMIZER_KIND)})
    total = None if outside is None else sum(measured.values()) + outside
    rows.append({"kind": "total", "ms_per_step": total if total is not None else sum(measured.values()),
                 "paper_ms_per_step": sum(paper.values()) if paper else None})
    return rows


def run_profile(args) -> dict:
    summary = load(args.folder)
    text, rows = report(summary, args.dtype)
    print(text)
    return {"summary": summary, "ops": rows}
