"""The report of `bash tools/gpu_check.sh`: one markdown file ($OUT/report.md) from what its steps left in $OUT
(device.txt, steps.tsv, the logs and the benchmarks' JSON), to paste into the README or docs/performance.md.

    python -m vim_ds.bench.gpu_report OUT_DIR        # writes OUT_DIR/report.md and prints its path

It never fails for a missing or broken input: a step that did not run, or left no file, is said to be missing.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib.metadata import version

import torch

import vim_ds

from . import scan_model, step_profile


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _json(path):
    text = _read(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _version(dist):
    try:
        return version(dist)
    except Exception:
        return "not installed"


def versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "CUDA (torch)": torch.version.cuda or "-", "ROCm (torch)": torch.version.hip or "-",
            "vim_ds": vim_ds.__version__, "deepspeed": _version("deepspeed"), "timm": _version("timm"),
            "mamba_ssm": _version("mamba_ssm")}


def _ms(v, digits=3):
    return "—" if v is None else f"{v:.{digits}f}"


def _x(v):
    return "—" if v is None else f"{v:.1f}x"


def _steps(out_dir):
    rows = []
    for line in (_read(os.path.join(out_dir, "steps.tsv")) or "").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append(parts[:4] + [""] * (4 - len(parts[:4])))
    return rows


def _gpu_tests(out_dir, ran):
    log = _read(os.path.join(out_dir, "gpu_tests.log"))
    if not ran:
        return "no GPU: the GPU tests (`pytest -m gpu`) were not run."
    if log is None:
        return "the tests step left no log."
    summary = [line for line in log.splitlines() if line.strip().startswith(("=", "FAILED", "ERROR"))
               or " passed" in line or " failed" in line or " skipped" in line]
    return "`pytest -m gpu`: " + (summary[-1].strip("= ").strip() if summary else "no summary line (see gpu_tests.log)")


def _op_times(r) -> str:
    """The cells of an op's row (`scan._op_row`): ours and PyTorch's medians, forward and forward+backward, and the
    speed-ups."""
    return (f"{_ms(r['kernel_fwd_ms'])} | {_ms(r['kernel_fwd_bwd_ms'])} | {_ms(r['ref_fwd_ms'])} | "
            f"{_ms(r['ref_fwd_bwd_ms'])} | {_x(r['speedup_fwd'])}, {_x(r['speedup_fwd_bwd'])}")


def _scan_section(data) -> list:
    lines = ["## Selective scan: measured against the performance model", ""]
    if data is None:
        return lines + ["The scan step left no `bench_scan.json`.", ""]
    rows = data.get("rows", data) if isinstance(data, dict) else data
    gpu_rows = [r for r in rows if r.get("device") == "cuda" and "op" not in r]
    conv_rows = [r for r in rows if r.get("device") == "cuda" and r.get("op") == "causal_conv1d"]
    norm_rows = [r for r in rows if r.get("device") == "cuda" and r.get("op") == "add_rms_norm"]
    if not gpu_rows:
        lines += ["no GPU: measured n/a (the lower bounds below are the model's, on paper).", ""]
    else:
        modelled = data.get("modelled_gpu") if isinstance(data, dict) else None
        lines += [f"`vim-ds bench scan --predict` on {data.get('device', '?') if isinstance(data, dict) else '?'}"
                  f" (bounds for: {modelled or 'none, not a modelled GPU'}); times are medians in ms, "
                  f"measured / bound is how far from the hardware's lower bound (1.0x = at it).", "",
                  "| shape | dtype | ours fwd | ours fwd+bwd | mamba_ssm fwd | mamba_ssm fwd+bwd | bound fwd | "
                  "bound fwd+bwd | ours measured/bound fwd, fwd+bwd | mamba_ssm measured/bound fwd, fwd+bwd | "
                  "speed-up vs `ref` fwd+bwd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in gpu_rows:
            speed = r.get("speedup_fwd_bwd")
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {_ms(r['kernel_fwd_ms'])} | {_ms(r['kernel_fwd_bwd_ms'])} | "
                f"{_ms(r.get('mamba_fwd_ms'))} | {_ms(r.get('mamba_fwd_bwd_ms'))} | {_ms(r.get('bound_fwd_ms'))} | "
                f"{_ms(r.get('bound_fwd_bwd_ms'))} | {_x(r.get('ratio_fwd'))}, {_x(r.get('ratio_fwd_bwd'))} | "
                f"{_x(r.get('mamba_ratio_fwd'))}, {_x(r.get('mamba_ratio_fwd_bwd'))} | "
                f"{'—' if speed is None else f'{speed:.0f}x'} |")
        if not any("mamba_fwd_ms" in r for r in gpu_rows):
            lines += ["", "mamba_ssm: not installed, so not timed."]
        lines.append("")
    if conv_rows:
        lines += ["The branch's depthwise causal conv (4 taps), our GPU kernel beside PyTorch's F.conv1d (cuDNN / "
                  "MIOpen), through the op with autograd; medians in ms:", "",
                  "| shape | dtype | ours fwd | ours fwd+bwd | F.conv1d fwd | F.conv1d fwd+bwd | "
                  "speed-up fwd, fwd+bwd |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['dtype']} | {_op_times(r)} |" for r in conv_rows]
        lines.append("")
    if norm_rows:
        lines += ["The blocks' residual add, stochastic depth and RMSNorm, our Triton kernel beside PyTorch's "
                  "composition (mask multiply, add, fused RMSNorm, cast), bf16 with an fp32 stream, through the op "
                  "with autograd; medians in ms, and the largest difference of the normalised rows:", "",
                  "| shape | ours fwd | ours fwd+bwd | PyTorch fwd | PyTorch fwd+bwd | speed-up fwd, fwd+bwd | "
                  "largest difference |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {_op_times(r)} | {r['max_abs_diff']:.2g} |" for r in norm_rows]
        lines.append("")
    cpu_rows = [r for r in rows if r.get("device") == "cpu"]
    if cpu_rows:
        lines += ["CPU rows of the same run:", "",
                  "| op | shape | dtype | variant | kernel fwd ms | kernel fwd+bwd ms |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.get('op', 'selective_scan')} | {r['shape']} | {r['dtype']} | {r.get('isa', '')} | "
                  f"{_ms(r['kernel_fwd_ms'])} | {_ms(r['kernel_fwd_bwd_ms'])} |" for r in cpu_rows]
        lines.append("")
    preds = data.get("predictions") if isinstance(data, dict) else None
    lines += ["### The performance model's lower bounds", "",
              "Minimum bytes (every input read once, every output written once), exp and FMA counts per kernel, and "
              "max(bytes / bandwidth, FMA / FMA rate, exp / exp rate) on each GPU (`vim_ds/cli/bench/scan_model.py`; "
              "the derivation is in `csrc/selective_scan_kernel.cuh`, \"Performance model\"). Peak rates used:", "",
              scan_model.sources_text(), "", scan_model.table(preds or scan_model.predictions()), ""]
    return lines


def _layouts_section(data, missing) -> list:
    """Our scan under other work layouts than the launcher's own (`vim-ds bench scan --layouts`): what each of the
    kernel's design choices costs on this GPU."""
    lines = ["## The scan under other work layouts (`vim-ds bench scan --layouts`)", ""]
    rows = [r for r in (data or []) if isinstance(r, dict) and r.get("device") == "cuda"]
    if not rows:
        return lines + [missing, ""]
    lines += ["Each layout changes one choice of the launcher (csrc/selective_scan_cuda.h, ScanTuning): chunk length "
              "(stored states, shared memory per block), channel tiles a backward block walks, blocks aimed at "
              "(segments along the sequence), how the blocks of channels sum dB, dC (in a chain, or as partial sums "
              "a reduction adds); the bytes are what the layout adds to the minimum by design; medians in ms, and "
              "fwd+bwd against the launcher's own layout.", "",
              "| shape | dtype | layout | chunk | tiles (channels a block) | blocks of channels | segments bwd (fwd) | "
              "stored states MB | dB/dC over blocks | fwd | fwd+bwd | x own |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chunk, tiles, cpb, blocks, n_seg, partials = r["bwd_layout"]
        extra = r["design_bytes"]
        sums = f"partials {extra['partials'] / 1e6:.0f} MB" if partials else "chain" if blocks > 1 else "—"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['layout']} | {chunk} | {tiles} ({cpb}) | {blocks} | "
                     f"{n_seg} ({r['fwd_layout'][4]}) | {extra['saved'] / 1e6:.0f} | {sums} | "
                     f"{_ms(r['kernel_fwd_ms'])} | {_ms(r['kernel_fwd_bwd_ms'])} | {_x(r['vs_own_fwd_bwd'])} |")
    return lines + [""]


def _generic_table(rows, limit_keys=12) -> list:
    keys = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and isinstance(v, (int, float, str, type(None))) and len(keys) < limit_keys:
                keys.append(k)
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    return out


def _cell(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "—" if v is None else str(v).replace("|", "/")


def _bench_section(title, data, missing) -> list:
    lines = [f"## {title}", ""]
    if data is None:
        return lines + [missing, ""]
    rows = data.get("rows") if isinstance(data, dict) else data
    if not rows:
        return lines + ["(no rows)", ""]
    return lines + _generic_table(rows) + [""]


def build_report(out_dir) -> str:
    device = (_read(os.path.join(out_dir, "device.txt")) or "unknown (no device.txt)").strip()
    steps = _steps(out_dir)
    no_gpu = any(s[1].startswith("skipped (no GPU)") for s in steps) or "no GPU" in device
    ran_tests = any(s[0] == "tests" and not s[1].startswith("skipped") for s in steps)
    lines = ["# GPU check report", "",
             f"`bash tools/gpu_check.sh`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
             "**Device:** " + ("no GPU on this machine: every GPU step reported \"no GPU\"; only the performance "
                               "model's predictions below are numbers." if no_gpu else device.replace("\n", "; ")),
             "", "| | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in versions().items()]
    lines += ["", "## Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {s[0]} | {s[1]} | {s[2]} | {s[3]} |" for s in steps] or ["| (none recorded) | | | |"]
    lines += ["", "## GPU tests", "", _gpu_tests(out_dir, ran_tests), ""]
    lines += _scan_section(_json(os.path.join(out_dir, "bench_scan.json")))
    skipped = "no GPU: not run." if no_gpu else "The step left no JSON (see its log)."
    lines += _layouts_section(_json(os.path.join(out_dir, "bench_layouts.json")), skipped)
    lines += _bench_section("Model: Vim vs DeiT (`vim-ds bench model`)",
                            _json(os.path.join(out_dir, "bench_model.json")), skipped)
    lines += _bench_section("Training through the real trainer (`vim-ds bench train`)",
                            _json(os.path.join(out_dir, "bench_train.json")), skipped)
    lines += _profile_section(_json(os.path.join(out_dir, "bench_profile.json")), skipped)
    lines += _bench_section("The sequence split's memory per rank (`vim-ds bench split --share-gpu`)",
                            _json(os.path.join(out_dir, "bench_split.json")), skipped)
    return "\n".join(lines).rstrip() + "\n"


def _profile_section(data, missing) -> list:
    """Where a training step's time goes (the profile step: `vim-ds train --profile-steps`, then `vim-ds bench
    profile`): the top kernels and the ops beside their rooflines; the Chrome trace is in profile/."""
    lines = ["## Where a training step's time goes (`--profile-steps`, `vim-ds bench profile`)", ""]
    if not isinstance(data, dict) or "summary" not in data:
        return lines + [missing, ""]
    text, _ = step_profile.report(data["summary"])
    return lines + [text, "The Chrome trace: `profile/trace.json.gz` (chrome://tracing, ui.perfetto.dev).", ""]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m vim_ds.bench.gpu_report OUT_DIR (a folder gpu_check.sh wrote)", file=sys.stderr)
        return 2
    path = os.path.join(argv[0], "report.md")
    with open(path, "w") as f:
        f.write(build_report(argv[0]))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
