"""`vim-ds bench scan|model|train|convert|profile|anatomy|data|split`: how fast the kernels, the model and the trainer
are, beside baselines.

scan   the selective scan at a Vim layer shape: compiled kernel vs the pure-PyTorch reference, forward and
       forward+backward, on CPU and (when present) GPU, there also at the performance model's shapes, beside
       mamba_ssm's kernel when installed; --predict adds the model's lower bounds and measured / bound, and the
       GPU kernels' bytes, operations and chains counted in the CPU emulator beside the model's minimum;
       --layouts times our GPU kernel under other work layouts than the launcher's own (the emulator's counts
       without a GPU).
model  a Vim training step vs timm's DeiT of the same size, eager and torch.compile'd, and high-resolution
       inference (time and peak memory), each measured in the same run so that the ratio is meaningful.
train  training throughput (images/s) and peak memory per rank for each ZeRO stage: the real trainer
       (`vim_ds.train`) on synthetic data, started by a real launcher (torchrun or deepspeed), one run per config.
convert  peak memory of `vim-ds convert` on a large model (vim_base by default) against its fp32 size, and the
         time to verify the checkpoint's files against their recorded checksums.
split  a training step with each image's tokens split over N ranks (sequence parallelism) beside the unsplit
       model: peak memory per rank, forward and backward time, communication per block, logits agreement.
profile  where a training step's time goes: a run's `vim-ds train --profile-steps` profile, its top kernels and
         each large operator beside its roofline on the GPU that ran it.
anatomy  a training step on paper, without a GPU: every operator of one forward and backward (traced on the meta
         device) and the optimizer step, each beside its roofline on a modelled GPU, by kind and costliest first.
data   the input pipeline alone (decode, transform, collate, Mixup, hand-over to the training process) on a folder
       of JPEGs: the trainer's loader vs timm's create_loader, images/s and per core, and where the time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ...runtime import env_vars
from ...runtime.errors import report_error
from ..run_options import add_model_kwargs
from . import convert, data, model, scan, split, step_anatomy, step_profile, train
from ...runtime.launched_runs import REPO_DIR, error_line, run_train_config, summarise_metrics
from .train import (DEFAULT_TRAIN_CONFIGS, LOOP_OVERHEAD_GOAL, MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU,
                    REFERENCE_SPEEDUP_GOAL, reference_lines)

__all__ = ["DEFAULT_TRAIN_CONFIGS", "LOOP_OVERHEAD_GOAL", "MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU",
           "REFERENCE_SPEEDUP_GOAL", "error_line", "main", "reference_lines", "run_train_config", "summarise_metrics"]


def build_parser() -> argparse.ArgumentParser:
    """`vim-ds bench`'s options; each subcommand's parser carries what runs it (`run`: args -> results, written by
    --json) and, where it has them, its checks of the parsed values (`check`) and its exit status (`exit_status`:
    results -> status)."""
    parser = argparse.ArgumentParser(prog="vim-ds bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(check=None, exit_status=None)
    sub = parser.add_subparsers(dest="what", required=True)
    for add in (_add_scan, _add_model, _add_train, _add_convert, _add_profile):
        add(sub)
    data.add_parser(sub)
    sub.choices["data"].set_defaults(run=data.run_data, check=data.check_args)
    split.add_parser(sub)
    step_anatomy.add_parser(sub)
    return parser


def _add_scan(sub) -> None:
    p = sub.add_parser("scan", help="selective-scan kernels vs the pure-PyTorch reference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=384, help="channels (d_inner); 384 is Vim-tiny's")
    p.add_argument("--seqlen", type=int, default=197)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-ref", action="store_true", help="time only the compiled kernels (the reference is "
                   f"never timed beyond L = {scan.REF_MAX_SEQLEN})")
    p.add_argument("--predict", action="store_true",
                   help="also print the performance model's lower bounds (bytes, exp, FMA on H100 SXM, H200 SXM, "
                   "MI250X, MI300X) and, on a modelled GPU, measured / bound per row, and what the GPU kernels "
                   "do at small shapes, counted in the CPU kernel emulator, against the model's minimum; --json "
                   "then writes {rows, predictions, gpus, counts}")
    p.add_argument("--predict-only", action="store_true", help="print the model's predictions and the emulator's "
                   "counts, time nothing")
    p.add_argument("--no-counts", action="store_true", help="with --predict(-only): leave out the emulator's counts "
                   "(they build and run the kernel emulator: a C++ compile the first time, then seconds)")
    p.add_argument("--layouts", action="store_true",
                   help="time only our GPU kernel, under each work layout of scan_layouts.LAYOUTS (chunk length, "
                   "channel tiles, segments, dB/dC partials or chain) beside the launcher's own, at the model's first "
                   "three shapes; without a GPU, the kernel emulator's counts per layout instead")
    p.add_argument("--mamba", action="store_true",
                   help="also time mamba_ssm's kernel (an error if it is not installed or there is no GPU) "
                   "[timed on a GPU whenever installed]; VIM_DS_SCAN=mamba asks the same")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(run=scan.run_scan)


def _add_model(sub) -> None:
    m = sub.add_parser("model", help="Vim vs DeiT: training step and high-resolution inference")
    m.add_argument("--train-batch", type=int, default=8)
    m.add_argument("--hires", type=int, default=1024, help="image side for the inference comparison")
    m.add_argument("--repeat", type=int, default=3, help="timed steps per measurement (median)")
    m.add_argument("--rounds", type=int, default=2, help="alternating measurements per model (fastest kept)")
    m.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile (inductor) training-step rows [eager and compiled, side by side]")
    m.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    m.set_defaults(run=model.run_model)


def _add_train(sub) -> None:
    t = sub.add_parser(
        "train", help="training images/s and peak memory per rank for each ZeRO stage (real trainer and launcher)",
        description="Train on synthetic data once per DeepSpeed config through a real launcher and report images/s "
        "(timed steps after the warmup), peak memory per rank, the loop overhead and the final loss. A failed run "
        "is reported with its one-line error and the next config runs; the exit status is then 1 (2 for a usage "
        "error, 0 when every run finished).")
    t.add_argument("--configs", nargs="+", default=list(DEFAULT_TRAIN_CONFIGS), metavar="CONFIG",
                   help="names in ds_configs/ or paths to JSON files; fp16 ones (zero2_fp16) are skipped on a "
                   "CPU [the four ZeRO stages and the two offload configs]")
    t.add_argument("--nproc", type=int, default=None, help="ranks [the number of GPUs, or 2 on a CPU]")
    t.add_argument("--launcher", choices=["torchrun", "deepspeed"], default="torchrun")
    t.add_argument("--model", default="vim_tiny")
    add_model_kwargs(t, default=[], help="model constructor overrides, e.g. depth=2 embed_dim=32 patch_size=4 stride=4")
    t.add_argument("--input-size", type=int, default=224)
    t.add_argument("--batch-size", type=int, default=None, help="micro batch per rank [64 on GPUs, 8 on a CPU]")
    t.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    t.add_argument("--warmup-steps", type=int, default=5, help="optimizer steps before the timed ones (not timed)")
    t.add_argument("--precision", choices=["bf16", "fp16", "fp32", "autocast-bf16"], default=None,
                   help="[bf16; on GPUs a config whose file enables fp16 (zero2_fp16) stays fp16 unless given]")
    t.add_argument("--num-workers", type=int, default=2, help="data-loader workers per rank")
    t.add_argument("--nb-classes", type=int, default=1000, help="classes of the synthetic data (the head's size)")
    t.add_argument("--grad-checkpointing", action="store_true",
                   help="train with gradient checkpointing (compare its peak memory with a run without)")
    t.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="split each image's tokens over groups of N ranks (vim-ds train --sequence-parallel)")
    t.add_argument("--train-args", default="", metavar="'ARGS'",
                   help="further vim_ds.train options, one quoted string, e.g. '--mixup 0 --cutmix 0'")
    t.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run")
    t.add_argument("--keep", metavar="DIR", help="keep each run's output directory as DIR/<config> (replaced if "
                   "present) [a temporary directory, removed]")
    t.add_argument("--json", metavar="FILE", help="also write the settings and every run's results as JSON")
    t.set_defaults(run=train.run_train, check=train.check_args, exit_status=train.exit_status)


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="peak memory of `vim-ds convert` against the fp32 model size, "
                       "and the checkpoint verification's time",
                       description="Make a checkpoint (1 training step on synthetic data through torchrun), or take "
                       "--checkpoint, convert it in a fresh process and print its peak resident memory beside the "
                       "fp32 size of the model, and what verifying the checkpoint's files costs (as resume, eval "
                       "and convert do before using it).")
    c.add_argument("--checkpoint", metavar="DIR", help="convert this checkpoint instead of training one")
    c.add_argument("--model", default="vim_base")
    c.add_argument("--input-size", type=int, default=64, help="training resolution (small: only the weights count)")
    c.add_argument("--config", default=os.path.join(REPO_DIR, "ds_configs", "zero3.json"))
    c.add_argument("--precision", choices=["bf16", "fp32", "autocast-bf16"], default="bf16")
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--no-ema", action="store_true", help="train without EMA (the file then holds one model)")
    c.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    c.set_defaults(run=convert.run_convert)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="a run's --profile-steps profile: top kernels, ops beside their rooflines",
                       description=step_profile.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", metavar="DIR", help="OUTPUT_DIR/profile of a run (or the run's OUTPUT_DIR)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="the dtype the rooflines assume [the run's precision]")
    p.add_argument("--json", metavar="FILE", help="also write the summary and the ops' rooflines as JSON")
    p.set_defaults(run=step_profile.run_profile)


def main(argv=None) -> int:
    """argv -> the subcommand's checks -> its run -> --json and the exit status. A ValueError out of a run is bad
    input (BenchError, the data set's DataError, Mixup's odd batch, an unusable --mamba or --precision): one line
    `vim-ds bench WHAT: error: ...` (VIM_DS_TRACEBACK=1 adds the traceback) and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_child"]:
        print(json.dumps(model.child(json.loads(argv[1]))))
        return 0
    if argv[:1] == ["_convert_child"]:
        print(json.dumps(convert.child(argv[1], argv[2])))
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    refused = env_vars.refusal(f"vim-ds bench {args.what}")  # a VIM_DS_* variable it cannot read: one line
    if refused:
        return refused
    if args.check:
        args.check(parser, args)
    try:
        results = args.run(args)
    except ValueError as exc:
        return report_error(f"vim-ds bench {args.what}", exc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return args.exit_status(results) if args.exit_status else 0
