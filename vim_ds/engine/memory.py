"""Model-state bytes held by one rank of a DeepSpeed engine: parameters, gradients, optimizer states.

Read from the engine and optimizer objects of DeepSpeed 0.19.8 (partitioned sizes as held, not assumed from the
ZeRO stage), so that `vim-ds zero-compare` can put measurements beside the ZeRO paper's arithmetic. Activations,
communication buckets, allocator caches and temporaries are not model states and are not counted here (peak
memory in the run summary covers them).
"""
from __future__ import annotations

import torch


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


class _Counter:
    """Sums tensor bytes, each byte of memory once: the part of a tensor that overlaps memory already counted
    (under an earlier kind) is not counted again, so a master copy that *is* the parameter storage (fp32 ZeRO-3,
    where the partitions are views of the same flat buffer) counts as parameters only."""

    def __init__(self):
        self.spans = []  # (start, end) byte addresses already counted

    def add(self, tensors) -> int:
        total = 0
        for t in tensors:
            if not torch.is_tensor(t) or t.numel() == 0:
                continue
            start = t.data_ptr()
            end = start + _nbytes(t)
            covered = sum(max(0, min(end, e) - max(start, s)) for s, e in self.spans)
            total += max(0, end - start - covered)
            self.spans.append((start, end))
        return total


def _flat(items):
    for item in items or ():
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        elif torch.is_tensor(item):
            yield item


def _inner_optimizer(opt):
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _master_tensors(opt) -> list:
    """fp32 master weights held by DeepSpeed's wrappers (ZeRO 1/2 partitions, ZeRO-3 partitions, the ZeRO-0 fp16
    wrapper's flat copies, the ZeRO-0 bf16 `FP16_UnfusedOptimizer`'s per-parameter `fp32_groups`)."""
    out = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat",
                 "fp32_groups_flat_partition", "fp32_groups"):
        out += list(_flat(getattr(opt, name, None)))
    return out


def _live_grads(engine, opt, stage: int) -> list:
    if stage == 3:
        return [opt.grad_partitions_flat_buffer] if torch.is_tensor(
            getattr(opt, "grad_partitions_flat_buffer", None)) else []
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    averaged = getattr(opt, "averaged_gradients", None)
    grads += list(_flat(list(averaged.values()) if isinstance(averaged, dict) else averaged))
    if torch.is_tensor(getattr(opt, "grads_in_partition", None)):
        grads.append(opt.grads_in_partition)
    for master in _master_tensors(opt):  # the wrappers' fp32 gradients, where they hold them
        if torch.is_tensor(master.grad):
            grads.append(master.grad)
    return grads


def _layout_grad_bytes(engine, opt, stage: int) -> int:
    """What the engine's backward allocates for gradients when none are live (after `engine.step()` freed them):
    ZeRO-0 a whole gradient per trainable parameter in the parameters' dtype; ZeRO-1/2 this rank's partition of
    the averaged gradients (the size of its fp32 master partition) in the parameters' dtype: DeepSpeed 0.19.8
    reduces them into the partition at the end of the accumulation boundary's backward, for stage 1 too."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if stage in (1, 2) and getattr(opt, "single_partition_of_fp32_groups", None):
        itemsize = params[0].element_size() if params else 4
        return sum(t.numel() for t in _flat(opt.single_partition_of_fp32_groups)) * itemsize
    return sum(p.numel() * p.element_size() for p in params)


def _local(t):
    """The part of a tensor this rank holds: a DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def torch_state_bytes(params, optimizer) -> dict:
    """Bytes of model states held by THIS rank of a PyTorch DDP or FSDP2 baseline (`runtime/baselines.py`):
    the local shards of the parameters, of their gradients (zeroed, not freed, between steps: always "live") and
    of the torch optimizer's state tensors (Adam's moments and its per-parameter step counter). No master copy:
    the parameters are the fp32 masters."""
    counter = _Counter()
    params = list(params)
    param_bytes = counter.add(_local(p).data for p in params)
    grad_bytes = counter.add(_local(p.grad) for p in params if p.grad is not None)
    state = [_local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": counter.add(state),
            "master_bytes": 0, "persistent_param_bytes": 0, "grad_source": "live"}


def state_bytes(engine) -> dict:
    """Bytes of model states held by THIS rank of a DeepSpeed engine (or of a DDP/FSDP baseline:
    `torch_state_bytes`).

    param_bytes   the module's parameter storage: the whole parameters under ZeRO 0-2; under ZeRO-3 each
                  parameter's partition `p.ds_tensor` (not the gathered parameter). ZeRO-3 "persistent" small
                  parameters (below stage3_param_persistence_threshold) are also kept gathered in full; those full
                  copies are NOT in param_bytes, they are reported apart as persistent_param_bytes.
    optim_bytes   the torch optimizer's `state` tensors (Adam's exp_avg, exp_avg_sq, ...) plus fp32 master weights
                  held by DeepSpeed (ZeRO 1/2 `single_partition_of_fp32_groups`, ZeRO-3
                  `fp32_partitioned_groups_flat`, the ZeRO-0 bf16/fp16 wrappers' `fp32_groups_flat`). A tensor
                  that is also a parameter is counted once, as parameters (pure fp32 ZeRO-0 and ZeRO-3 update the
                  parameters in place, where they do). Note DeepSpeed 0.19.8 ZeRO 1-3 keep an fp32 master
                  partition even in fp32 (a clone, measured: a separate allocation), so there optim_bytes =
                  8 bytes x partition (moments) + 4 bytes x partition (master).
    master_bytes  the master-weight part of optim_bytes.
    grad_bytes    gradient buffers between backward and step. If gradients are live when this is called (right
                  after `engine.backward`), the live buffers: ZeRO-0 `p.grad` (+ the wrapper's fp32 grads),
                  ZeRO-1/2 the partitioned averaged gradients (at an accumulation boundary), ZeRO-3
                  `grad_partitions_flat_buffer`. The trainer calls
                  this at the end of the run, after `engine.step()` has freed them: then ZeRO-3's persistent
                  flat partition buffer is still measured, and for ZeRO 0-2 the size is read from the engine's
                  layout instead (whole gradients in the parameters' dtype for ZeRO-0, the rank's partition for
                  ZeRO-1/2); grad_source says which ("live" or "layout"). Communication buckets are not counted.
    """
    if getattr(engine, "is_torch_baseline", False):
        return torch_state_bytes(engine.params, engine.optimizer)
    opt = engine.optimizer
    inner = _inner_optimizer(opt)
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
    counter = _Counter()

    params = list(engine.module.parameters())
    if stage == 3:
        param_bytes = counter.add(p.ds_tensor for p in params if hasattr(p, "ds_tensor"))
        persistent = _Counter().add(p.data for p in params if p.data.numel() > 0)
    else:
        param_bytes = counter.add(p.data for p in params)
        persistent = 0

    master_bytes = counter.add(_master_tensors(opt))
    state = [t for s in getattr(inner, "state", {}).values() for t in s.values() if torch.is_tensor(t)]
    moment_bytes = counter.add(state)

    live = _live_grads(engine, opt, stage)
    if live:
        grad_bytes, source = counter.add(live), "live"
    else:
        grad_bytes, source = _layout_grad_bytes(engine, opt, stage), "layout"
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": master_bytes + moment_bytes,
            "master_bytes": master_bytes, "persistent_param_bytes": persistent, "grad_source": source}
