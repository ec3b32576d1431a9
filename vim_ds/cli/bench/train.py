"""`vim-ds bench train`: training throughput (images/s) and peak memory per rank for each ZeRO stage, the real
trainer (`vim_ds.train`) on synthetic data started by a real launcher (torchrun or deepspeed), one run per config,
read back from its metrics.jsonl."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile

import torch

from ...runtime.launched_runs import (
    clear_run_folder,
    describe_config,
    foreign_run_folder,
    resolve_config,
    run_train_config,
)

DEFAULT_TRAIN_CONFIGS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# The published Vim fine-tuning speed we compare a GPU against: about 39 images/s per GPU, from the Vim
# paper/repo's fine-tune logs of Vim-small stride 8 (`vim_small_s8`, fp32) on 8x AMD MI210 (the logged rate of the
# whole node divided by its 8 GPUs). The goal is at least REFERENCE_SPEEDUP_GOAL times that per GPU in bf16.
MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU = 39.0
REFERENCE_SPEEDUP_GOAL = 4.0
# data wait + the loop's bookkeeping (logging, loss all-reduce, EMA) vs the whole step
LOOP_OVERHEAD_GOAL = 0.10


def loop_overhead_verdict(rows) -> tuple[bool | None, float | None]:
    """(every successful run's loop overhead < LOOP_OVERHEAD_GOAL, the largest one); (None, None) without runs."""
    values = [r["loop_overhead"] for r in rows if "error" not in r and r.get("loop_overhead") is not None]
    if not values:
        return None, None
    return max(values) < LOOP_OVERHEAD_GOAL, max(values)


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


TRAIN_COLUMNS = ("config", "stage", "offload", "precision", "ranks", "global batch", "images/s",
                 "peak MiB/rank (max)", "loop overhead", "final loss")


def train_table(rows) -> str:
    lines = []
    table = []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']}: FAILED: {r['error']}")
            continue
        table.append((r["config"], str(r["stage"]), r["offload"], r["precision"], str(r["ranks"]),
                      str(r["global_batch"]), _fmt(r["images_per_sec"], ".2f"), _fmt(r["peak_memory_mb_max"], ".0f"),
                      "-" if r["loop_overhead"] is None else f"{100 * r['loop_overhead']:.1f} %",
                      _fmt(r["final_loss"], ".4f")))
    if table:
        widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(TRAIN_COLUMNS)]
        fmt_row = lambda cells: "  ".join(c.ljust(w) if i < 4 else c.rjust(w)  # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths)))
        lines = [fmt_row(TRAIN_COLUMNS), fmt_row(["-" * w for w in widths])] + [fmt_row(t) for t in table] + lines
    return "\n".join(lines)


def reference_lines(rows, model: str) -> list[str]:
    """On a GPU with Vim-small stride 8: images/s per GPU against the published 8x MI210 fp32 fine-tune rate."""
    if model != "vim_small_s8" and "small_patch16_stride8" not in model:
        return []
    out = []
    for r in rows:
        if "error" in r or r.get("device") != "cuda" or not r.get("images_per_sec_per_rank"):
            continue
        ratio = r["images_per_sec_per_rank"] / MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU
        r["vs_mi210_fp32_finetune"] = ratio
        out.append(f"{r['config']}: {r['images_per_sec_per_rank']:.1f} images/s per GPU ({r['precision']}) vs "
                   f"~{MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU:.0f} per GPU published (8x MI210, fp32 fine-tune): "
                   f"{ratio:.1f}x (goal >= {REFERENCE_SPEEDUP_GOAL:.0f}x: "
                   f"{'met' if ratio >= REFERENCE_SPEEDUP_GOAL else 'not met'})")
    return out


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_args(parser, args) -> None:
    """The counts' ranges, as usage errors of `parser`."""
    for name, least in (("steps", 1), ("warmup_steps", 0), ("nproc", 1), ("batch_size", 1), ("num_workers", 0),
                        ("sequence_parallel", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")


def exit_status(results) -> int:
    """1 when a config's run failed, else 0."""
    return 1 if any("error" in r for r in results["rows"]) else 0


def run_train(args) -> dict:
    """One run per config; returns what --json holds (settings, rows, loop-overhead verdict, the reference rate),
    also written to --json after each run (a stopped benchmark keeps the runs it finished). A ValueError: bad
    input."""
    gpus = _gpu_count()
    device = "cuda" if gpus else "cpu"
    nproc = args.nproc or gpus or 2
    batch_size = args.batch_size or (64 if gpus else 8)
    if args.precision == "fp16" and not gpus:
        raise ValueError("fp16 is GPU only (DeepSpeed refuses it on CPU); use --precision bf16 or fp32")
    model_kwargs = dict(args.model_kwargs)
    settings = dict(device=device, nproc=nproc, launcher=args.launcher, model=args.model, model_kwargs=model_kwargs,
                    input_size=args.input_size, batch_size=batch_size, steps=args.steps, warmup=args.warmup_steps,
                    precision=args.precision or "bf16", workers=args.num_workers, nb_classes=args.nb_classes,
                    grad_checkpointing=args.grad_checkpointing, sequence_parallel=args.sequence_parallel)
    kwargs = "".join(f" {k}={v}" for k, v in model_kwargs.items())
    checkpointing = ", gradient checkpointing" if args.grad_checkpointing else ""
    checkpointing += f", tokens split over groups of {args.sequence_parallel}" if args.sequence_parallel > 1 else ""
    print(f"vim-ds bench train: {args.model}{kwargs} {args.input_size}^2 on {nproc} {device} rank(s) "
          f"via {args.launcher}, batch {batch_size} per rank{checkpointing}, {args.warmup_steps} warmup + "
          f"{args.steps} timed steps", flush=True)
    extra_args = shlex.split(args.train_args or "") + (["--grad-checkpointing"] if args.grad_checkpointing else [])
    extra_args += ["--sequence-parallel", str(args.sequence_parallel)] if args.sequence_parallel > 1 else []
    work = args.keep or tempfile.mkdtemp(prefix="vim-ds-bench-train-")
    rows, used = [], set()
    try:
        for config in args.configs:
            label = os.path.splitext(os.path.basename(config))[0]
            precision = args.precision
            try:
                file_precision = describe_config(resolve_config(config)[1])["file_precision"]
            except (OSError, ValueError):
                file_precision = None  # run_train_config records the error
            if file_precision == "fp16" and not gpus:
                print(f"skipping {config}: an fp16 config is GPU only (DeepSpeed refuses fp16 on CPU)", flush=True)
                continue
            if precision is None and file_precision != "fp16":
                precision = "bf16"
            name, n = label, 2
            while name in used:
                name, n = f"{label}-{n}", n + 1
            used.add(name)
            out_dir = os.path.join(work, name)
            # a previous benchmark's run (metrics.jsonl is appended to); never a folder that is not one
            problem = foreign_run_folder(out_dir)
            if problem:
                rows.append({"config": config, "error": problem})
                print(f"[{config}] skipped: {problem}", flush=True)
                continue
            clear_run_folder(out_dir)
            print(f"[{config}] training ...", flush=True)
            row = run_train_config(config, nproc=nproc, launcher=args.launcher, model=args.model,
                                   model_kwargs=model_kwargs, input_size=args.input_size, batch_size=batch_size,
                                   steps=args.steps, warmup=args.warmup_steps, precision=precision,
                                   workers=args.num_workers, out_dir=out_dir, nb_classes=args.nb_classes,
                                   extra_args=extra_args, timeout=args.timeout)
            if args.keep:
                row["output_dir"] = out_dir
            rows.append(row)
            if "error" in row:
                print(f"[{config}] FAILED: {row['error']}", flush=True)
            else:
                overhead = row["loop_overhead"]
                print(f"[{config}] {_fmt(row['images_per_sec'], '.2f')} images/s, peak "
                      f"{_fmt(row['peak_memory_mb_max'], '.0f')} MiB per rank, loop overhead "
                      f"{_fmt(None if overhead is None else 100 * overhead, '.1f')} % ({row['wall_s']:.0f} s)",
                      flush=True)
            if args.json:  # progress: `vim-ds bench` writes the final one
                with open(args.json, "w") as f:
                    json.dump(train_results(settings, rows, args.model), f, indent=2)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(train_table(rows))
    ok, worst = loop_overhead_verdict(rows)
    verdict = "n/a (no run finished)" if ok is None else f"{'yes' if ok else 'no'} (max {100 * worst:.1f}%)"
    print(f"loop overhead (data, logging, EMA) < {LOOP_OVERHEAD_GOAL:.0%} of step time: {verdict}")
    for line in reference_lines(rows, args.model):
        print(line)
    if not gpus:
        print(f"(CPU: peak memory is each process's peak resident set size; images/s are for {nproc} processes "
              f"sharing this machine's cores)")
    return train_results(settings, rows, args.model)


def train_results(settings, rows, model) -> dict:
    """The settings, the rows and the verdicts, as --json holds them."""
    reference_lines(rows, model)  # adds vs_mi210_fp32_finetune to the rows it applies to
    ok, worst = loop_overhead_verdict(rows)
    return {"settings": settings, "rows": rows, "loop_overhead_max": worst, "loop_overhead_ok": ok,
            "reference_images_per_sec_per_gpu": MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU}
