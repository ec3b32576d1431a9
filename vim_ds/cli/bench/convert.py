"""`vim-ds bench convert`: peak memory of `vim-ds convert` on a large model (vim_base by default) against its fp32
size."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from ...checkpoint import deepspeed_dir
from ...checkpoint.convert import convert
from ...checkpoint.files import CheckpointError
from ...engine.trainer import peak_memory_mb
from ...runtime.errors import report_error


def child(ckpt: str, out: str) -> dict:
    """Run in a fresh process: peak RSS after the imports (the floor), then after `vim-ds convert`."""
    # DeepSpeed here, not at the top: seconds of start-up for the parent; its logger binds stdout at import
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed.utils.zero_to_fp32  # noqa: F401

    # this process's peak resident set so far, as the trainer's run summary reports it
    def peak_bytes() -> int:
        return int(peak_memory_mb(torch.device("cpu")) * 2 ** 20)

    floor = peak_bytes()
    t0 = time.perf_counter()
    try:
        summary = convert(ckpt, out)
    except CheckpointError as exc:  # one line for the parent to report
        raise SystemExit(str(exc)) from None
    seconds = time.perf_counter() - t0
    # what resume, eval and convert pay before using a checkpoint: the sizes and CRC-32s of its files re-read and
    # compared with its marker (convert above read them once, so this reads them from the page cache, as a resume
    # soon after the save does)
    tag_dir = summary["source"]
    t0 = time.perf_counter()
    problem = deepspeed_dir.damage(tag_dir)
    verify_seconds = time.perf_counter() - t0
    if problem:
        raise SystemExit(problem)
    checked = sum(size for size, _ in deepspeed_dir.read_marker(tag_dir).get("files", {}).values())
    return {"floor_bytes": floor, "peak_bytes": peak_bytes(), "seconds": seconds, "verify_seconds": verify_seconds,
            "verified_bytes": checked, "parameters": summary["parameters"], "has_ema": summary["has_ema"],
            "source": tag_dir}


def run_convert(args) -> dict:
    """Train `--steps` steps of `--model` (synthetic data, real launcher) to get a checkpoint, or take `--checkpoint`;
    then convert it in a fresh process and report its peak memory against the fp32 size of the model."""
    tmp = tempfile.mkdtemp(prefix="vim_ds_bench_convert_")
    try:
        ckpt = args.checkpoint
        if not ckpt:
            ckpt = os.path.join(tmp, "run")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   "-m", "vim_ds.train", "--deepspeed_config", args.config, "--precision", args.precision,
                   "--data-set", "synthetic", "--synthetic-size", str(4 * args.nproc), "--nb-classes", "1000",
                   "--model", args.model, "--input-size", str(args.input_size), "--batch-size", "2",
                   "--max-steps", "1", "--num_workers", "0", "--output_dir", ckpt,
                   *(["--no-model-ema"] if args.no_ema else [])]
            print(f"training 1 step of {args.model} ({args.config}, {args.precision}, {args.nproc} ranks) for a "
                  f"checkpoint ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise SystemExit(report_error("vim-ds bench convert", f"training failed: {last}", code=1))
        out = subprocess.run([sys.executable, "-m", "vim_ds.cli.bench", "_convert_child", ckpt,
                              os.path.join(tmp, "converted.pth")], capture_output=True, text=True)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            raise SystemExit(report_error("vim-ds bench convert", last, code=1))
        r = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fp32 = 4 * r["parameters"]
    r.update(fp32_bytes=fp32, peak_over_fp32=(r["peak_bytes"] - r["floor_bytes"]) / fp32)
    print(f"vim-ds convert of {r['source']}: {r['parameters'] / 1e6:.1f}M parameters = {fp32 / 2**20:.0f} MiB in "
          f"fp32{' (+ the same again of EMA weights)' if r['has_ema'] else ''}; {r['seconds']:.1f} s\n"
          f"  peak RSS {r['peak_bytes'] / 2**20:.0f} MiB, of which {r['floor_bytes'] / 2**20:.0f} MiB is the "
          f"interpreter, torch and DeepSpeed before converting\n"
          f"  conversion's own peak: {(r['peak_bytes'] - r['floor_bytes']) / 2**20:.0f} MiB = "
          f"{r['peak_over_fp32']:.2f} x the fp32 model size\n"
          f"  checkpoint verification (sizes and CRC-32s against vim_ds_complete.json, as resume, eval and convert "
          f"do): {r['verify_seconds']:.2f} s for {r['verified_bytes'] / 2**30:.2f} GiB of files")
    return r
