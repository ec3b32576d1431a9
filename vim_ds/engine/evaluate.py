"""Distributed evaluation: top-1, top-5 and cross-entropy over the validation set, exact for any rank count.

Each rank scores a disjoint shard (no padding, no duplicates) and the sums are added across ranks. Images that
failed to decode (ok == 0) are left out of every sum and counted. Under ZeRO-3 every forward pass is a
collective, so ranks whose shard has fewer batches run blank batches until all ranks have run as many.

`evaluate` scores a model during training; `evaluate_weights` scores saved weights (`vim-ds eval`); both read the
validation set in `eval_sampler`'s batches.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..checkpoint import class_names, deepspeed_dir, safe_load
from ..checkpoint.consolidate import fp32_state_dict
from ..checkpoint.convert import client_state
from ..checkpoint.files import CheckpointError, load_into, load_weights_file, split_weights
from ..config.components import dataset_config, loader_config, model_config
from ..config.ds_config import PRECISION_DTYPES, autocast_dtype, eval_batch_size
from ..config.run_config import RunConfig
from ..data import ShardedEvalSampler
from ..data.loader import build_loader
from ..models import load_state_dict_into
from ..runtime import distributed, faults, sequence_groups
from .metrics import MetricsLog


def eval_sampler(dataset, micro_batch: int | None, groups):
    """This rank's batches of the validation set `dataset`: ds_config.eval_batch_size(micro_batch) images each, the
    set split over the data-parallel ranks of `groups` (sequence_groups.SequenceGroups: the ranks of a sequence
    group score the same images)."""
    return ShardedEvalSampler(len(dataset), batch_size=eval_batch_size(micro_batch), rank=groups.data_rank,
                              world_size=groups.data_world)


def autocast_context(device: torch.device, autocast_dtype: torch.dtype | None):
    """torch.autocast for an autocast precision (fp32 parameters, half-precision matmuls), else nothing."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype)


@torch.no_grad()
def evaluate(forward, loader, device: torch.device, dtype: torch.dtype, input_shape: tuple,
             autocast_dtype: torch.dtype | None = None, stop=None, counts: bool = True) -> dict:
    """dtype: the inputs' (the parameters'); autocast_dtype: run the forward under torch.autocast in it (the
    autocast-bf16 precision; a DeepSpeed engine with torch_autocast enters the same context itself). `stop`: asked
    before each batch, the same number of times on every rank (it may be a collective); True ends the evaluation
    there, and the result covers the batches seen. `counts`: whether this rank's images enter the sums over ranks
    (under --sequence-parallel only one rank of each group counts the images the group shares)."""
    with autocast_context(device, autocast_dtype):
        return _evaluate(forward, loader, device, dtype, input_shape, stop, counts)


def _evaluate(forward, loader, device: torch.device, dtype: torch.dtype, input_shape: tuple, stop=None,
              counts: bool = True) -> dict:
    correct1 = correct5 = loss_sum = count = bad = 0.0
    batches = len(loader)
    most = int(distributed.all_reduce_max([batches], device)[0])
    # every rank runs `most` forwards (ZeRO-3 gathers parameters in each): its own batches, then dummy ones
    mine = iter(loader)
    for i in range(most):
        if stop is not None and stop():
            break
        if i >= batches:
            forward(torch.zeros((1, *input_shape), device=device, dtype=dtype))
            continue
        images, targets, ok = next(mine)
        images = images.to(device, dtype, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        keep = ok.to(device, non_blocking=True).bool()
        logits = forward(images).float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top5 == targets[:, None]
        correct1 += (hit[:, 0] & keep).sum().item()
        correct5 += (hit.any(dim=1) & keep).sum().item()
        loss_sum += (F.cross_entropy(logits, targets, reduction="none") * keep).sum().item()
        count += keep.sum().item()
        bad += (~keep).sum().item()
    sums = [correct1, correct5, loss_sum, count, bad] if counts else [0.0] * 5
    correct1, correct5, loss_sum, count, bad = distributed.all_reduce_sum(sums, device)
    n = max(count, 1.0)
    return {"acc1": 100.0 * correct1 / n, "acc5": 100.0 * correct5 / n, "loss": loss_sum / n,
            "images": int(count), "bad_images": int(bad)}


def load_eval_weights(config: RunConfig, model, classes: list | None = None) -> dict | None:
    """Put the weights to evaluate into `model`; return the EMA state dict when the source has one. `classes`: the
    validation set's class names, refused when the weights record other ones (their labels would mean other
    classes: a score of other classes' images)."""
    source = config.run.resume or config.model.finetune
    if not source:
        raise ValueError("--eval needs weights: --resume CHECKPOINT_DIR_OR_FILE (or --finetune FILE)")
    fix = "evaluate it on the data it was trained on"
    data = class_names.data_source(dataset_config(config))
    if os.path.isdir(source):
        save_dir, tag = deepspeed_dir.resolve(source)
        class_names.check(source, class_names.recorded(client_state(os.path.join(save_dir, tag), mmap=True)),
                          data, classes, fix)
        load_into(model, fp32_state_dict(save_dir, tag), source)
        ema_path = os.path.join(save_dir, tag, deepspeed_dir.EMA_FILE)
        return safe_load.load(ema_path) if os.path.isfile(ema_path) else None
    obj = load_weights_file(source)
    weights, ema = split_weights(obj, source)
    class_names.check(source, class_names.of_file(source, obj), data, classes, fix)
    head = weights.get("head.weight")
    if torch.is_tensor(head) and head.shape[0] != model.num_classes:
        # loading would re-initialise the head (right for --finetune) and score a random classifier
        raise CheckpointError(f"{source} classifies {head.shape[0]} classes, the validation set has "
                              f"{model.num_classes}")
    load_into(model, weights, source)
    return ema


def evaluate_weights(config: RunConfig, dist_info, datasets) -> dict:
    """`vim-ds eval`: score the weights of `--resume`/`--finetune` (and their EMA weights, when saved) on the
    validation set of `datasets` (parts.build_datasets(config, train=False)), the model replicated on every rank
    and the set sharded over the data-parallel ranks (under --sequence-parallel N each group of N ranks splits its
    images' tokens); rank 0 logs the record."""
    val_set = datasets.val_set
    model = model_config(config, datasets.num_classes).build()
    ema_state = load_eval_weights(config, model, datasets.classes)
    precision = config.optim.precision or "fp32"
    if precision == "fp16" and dist_info.device.type == "cpu":
        raise ValueError("fp16 is not supported on CPU; use --precision bf16, autocast-bf16 or fp32")
    dtype, autocast = PRECISION_DTYPES[precision], autocast_dtype(precision)
    model = model.to(dist_info.device, dtype).eval()
    groups = sequence_groups.build(config.run.sequence_parallel, dist_info.rank, dist_info.world_size)
    groups.split(model)
    # this command's own workers (not a trainer's: see data.loader's _worker_init), started afresh per evaluation
    loader = build_loader(val_set, eval_sampler(val_set, config.optim.batch_size, groups), loader_config(config),
                          "val", local_world_size=dist_info.local_world_size,
                          stall_at=faults.for_rank(dist_info.rank).loader("val")["stall_at"])
    size = config.model.input_size
    shape = (3, size, size)
    record = {"step": None, "epoch": None, "source": config.run.resume or config.model.finetune}
    counts = groups.counts_images
    record.update({f"eval_{k}": v for k, v in evaluate(model, loader, dist_info.device, dtype, shape,
                                                                    autocast, counts=counts).items()})
    if ema_state is not None:
        load_state_dict_into(model, ema_state, strict=True)
        ema = evaluate(model, loader, dist_info.device, dtype, shape, autocast, counts=counts)
        record.update({f"ema_eval_{k}": v for k, v in ema.items() if k in ("acc1", "acc5", "loss")})
    if dist_info.is_main:
        log = MetricsLog(config.run.output_dir, True, total_steps=0)
        log.evaluation(record)
        log.close()
    return record
