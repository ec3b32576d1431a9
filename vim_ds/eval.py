"""`vim-ds eval` = `python -m vim_ds.eval` = `vim-ds train --eval`: top-1/top-5/loss of saved weights on a
validation set, distributed over however many ranks are launched.

The weights come from `--resume` (a DeepSpeed checkpoint directory written by `vim-ds train`, any ZeRO stage and
rank count, or a plain .pth/.safetensors file) or from `--finetune` (a published checkpoint). The model runs
replicated on every rank (no DeepSpeed engine is needed to evaluate); the validation set is sharded.
"""
from __future__ import annotations

import os
import sys

import torch


def load_eval_weights(args, model) -> dict | None:
    """Put the weights to evaluate into `model`; return the EMA state dict when the source has one."""
    from .checkpoint import deepspeed_dir, load_model_weights, safe_load
    from .checkpoint.consolidate import fp32_state_dict
    from .checkpoint.files import CheckpointError, load_weights_file
    from .models.vim import load_state_dict_into

    source = args.resume or args.finetune
    if not source:
        raise ValueError("--eval needs weights: --resume CHECKPOINT_DIR_OR_FILE (or --finetune FILE)")
    if os.path.isdir(source):
        save_dir, tag = deepspeed_dir.resolve(source)
        try:
            load_state_dict_into(model, fp32_state_dict(save_dir, tag), strict=True)
        except ValueError as exc:
            raise CheckpointError(f"{source}: {exc}") from exc
        ema_path = os.path.join(save_dir, tag, deepspeed_dir.EMA_FILE)
        return safe_load.load(ema_path) if os.path.isfile(ema_path) else None
    obj = load_weights_file(source)
    weights = obj["model"] if isinstance(obj.get("model"), dict) else obj
    head = weights.get("head.weight")
    if torch.is_tensor(head) and head.shape[0] != model.num_classes:
        # loading would re-initialise the head (right for --finetune) and score a random classifier
        raise CheckpointError(f"{source} classifies {head.shape[0]} classes, the validation set has "
                              f"{model.num_classes}")
    load_model_weights(model, source)
    return obj.get("model_ema") if isinstance(obj.get("model_ema"), dict) else None


def evaluate_weights(args, dist_info) -> dict:
    from .data import ShardedEvalSampler, build_dataset
    from .data.loader import build_loader
    from .engine.evaluate import evaluate
    from .engine.metrics import MetricsLog
    from .engine.trainer import PRECISION_DTYPES, build_model
    from .models.vim import load_state_dict_into

    val_set, num_classes = build_dataset(args, is_train=False)
    model = build_model(argparse_copy(args, finetune=""), num_classes)
    ema_state = load_eval_weights(args, model)
    precision = args.precision or "fp32"
    if precision == "fp16" and dist_info.device.type == "cpu":
        raise ValueError("fp16 is not supported on CPU; use --precision bf16 or fp32")
    dtype = PRECISION_DTYPES[precision]
    model = model.to(dist_info.device, dtype).eval()
    batch = max(1, int(1.5 * (args.batch_size or 64)))
    loader = build_loader(val_set, ShardedEvalSampler(len(val_set), batch_size=batch, rank=dist_info.rank,
                                                      world_size=dist_info.world_size),
                          args, "val", local_world_size=dist_info.local_world_size)
    shape = (3, args.input_size, args.input_size)
    record = {"step": None, "epoch": None, "source": args.resume or args.finetune}
    record.update({f"eval_{k}": v for k, v in evaluate(model, loader, dist_info.device, dtype, shape).items()})
    if ema_state is not None:
        load_state_dict_into(model, ema_state, strict=True)
        ema = evaluate(model, loader, dist_info.device, dtype, shape)
        record.update({f"ema_eval_{k}": v for k, v in ema.items() if k in ("acc1", "acc5", "loss")})
    if dist_info.is_main:
        log = MetricsLog(args.output_dir, True, total_steps=0)
        log.evaluation(record)
        log.close()
    return record


def argparse_copy(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def main(argv=None) -> int:
    from .train import parse_args
    from .engine.trainer import run

    argv = list(sys.argv[1:] if argv is None else argv)
    return run(parse_args(argv + ["--eval"], prog="vim-ds eval"), prog="vim-ds eval")


if __name__ == "__main__":
    sys.exit(main())
