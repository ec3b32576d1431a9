"""DeepSpeed's engine, as `training_engines` builds it for `--engine deepspeed`: `deepspeed.initialize` on the
model's parameter groups and the DeepSpeed config, and with --compile torch.compile through DeepSpeed's
`engine.compile()` (what DeepSpeed refuses becomes one line)."""
from __future__ import annotations

import contextlib
import os

import torch

from ..models.vim import BiMambaMixer, Block, VisionMamba
from .errors import first_line


def build(model: torch.nn.Module, groups: list[dict], ds, scheduler_factory, compile_backend: str | None):
    """The DeepSpeed engine of `model` (compiled with `compile_backend` where given): (the engine, its lr scheduler,
    what was compiled or None)."""
    # DeepSpeed here, not at the top: seconds of start-up, which --engine ddp/fsdp runs never pay
    import deepspeed

    compiled = compile_backend is not None
    with _dynamo_off(not compiled):
        engine, _, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=groups, config=ds.config,
                                                          lr_scheduler=scheduler_factory)
    untrack_flat_buffers(engine.optimizer)
    what = compile_engine(engine, ds, compile_backend) if compiled else None
    return engine, lr_scheduler, what


# The flat buffers DeepSpeed's optimizers keep their 16-bit (or, under ZeRO-1/2 in fp32, 32-bit) parameters in:
# BF16_Optimizer's, and ZeRO-1/2's DeepSpeedZeroOptimizer's; and the lists of each rank's partition of them (views)
FLAT_BUFFERS = ("bf16_groups_flat", "bit16_groups_flat")
PARTITIONS = ("bf16_partitioned_groups", "parallel_partitioned_bit16_groups")


def untrack_flat_buffers(optimizer) -> None:
    """Stop autograd recording the flat parameter buffers of DeepSpeed's optimizers (FLAT_BUFFERS, detached in
    place) and the partitions cut from them (PARTITIONS, replaced by the same views untracked).

    Why: an optimizer that flattens each group's parameters with autograd recording leaves a buffer that requires
    grad, and cuts each rank's partition from it as a view that carries that history; after each step the ranks'
    partitions are all-gathered into the buffer, and on a CPU (gloo) autograd refuses the in-place writes into its
    views: every multi-rank CPU run stopped at its first step. BF16_Optimizer (bf16 without ZeRO on DeepSpeed 0.16)
    with torch 2.4: `A view was created in no_grad mode and is being modified inplace with grad mode enabled`;
    ZeRO-1/2's optimizer on DeepSpeed 0.18 (its PR #7828; 0.16, 0.17 and 0.19 detach the buffer, PR #7948), with
    torch 2.4.1 and 2.14.1: `Output 0 of SplitBackward0 is a view and is being modified inplace`. The buffers are
    storage only (the parameters point into them through `.data`, and no gradient flows through them), so they can
    stop being recorded: the same tensors and values, as DeepSpeed 0.19 makes them. Found by what autograd records,
    not by the version: where DeepSpeed detached them, nothing is done."""
    for name in FLAT_BUFFERS:
        for flat in getattr(optimizer, name, None) or ():
            if flat.requires_grad and flat._base is None:  # (none is a view: each is a concatenation)
                flat.detach_()
    for name in PARTITIONS:
        for parts in getattr(optimizer, name, None) or ():
            for index, part in enumerate(parts):
                if isinstance(part, torch.Tensor) and part.requires_grad:
                    parts[index] = part.detach()  # the same storage, offset and shape


def is_bf16_optimizer(optimizer) -> bool:
    """Whether `optimizer` is DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation), by its class."""
    # DeepSpeed here, not at the top (start-up): only a DeepSpeed engine's optimizer can be one
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:  # a DeepSpeed without it: none of its optimizers is one
        return False
    return isinstance(optimizer, BF16_Optimizer)


def module_grad_norm(engine) -> float:
    """The norm of the gradients in the engine's module (whole and averaged over the ranks at ZeRO-0, where DeepSpeed
    reports none), unscaled: divided by the loss scale the engine's optimizer multiplied the loss by before backward.

    Why: without ZeRO DeepSpeed wraps a bf16 (and fp16) model's optimizer in its FP16_UnfusedOptimizer, whose
    `loss_scale` is the factor its backward multiplies the loss by. DeepSpeed 0.17 applies fp16's dynamic loss scale
    (65536) to bf16 there too, so the gradients and the reported norm were 65536 times too large; newer releases
    scale bf16 by 1 (then this divides by 1.0: the same value). An optimizer without a loss scale (fp32: torch's own)
    leaves the gradients as they are."""
    norms = [p.grad.float().norm() for p in engine.module.parameters() if p.grad is not None]
    norm = float(torch.stack(norms).norm()) if norms else 0.0
    return norm / float(getattr(engine.optimizer, "loss_scale", 1.0))


def drop_stepped_gradients(module: torch.nn.Module) -> None:
    """Set to None the gradients left in `module`'s parameters after an optimizer step (ZeRO-0, where the
    gradients live in the parameters' `.grad` and the next backward adds to them).

    Why: DeepSpeed's engine clears them after its step, except DeepSpeed 0.17 with bf16 and no ZeRO, which routes
    bf16 to FP16_UnfusedOptimizer (whose step leaves them) but clears the gradients of a bf16 run only where ZeRO is
    on: each step's gradient was the sum of every earlier step's, and ZeRO-0's losses drifted 1.4 % from ZeRO-1/2/3's
    in 10 steps. Found by what is left, not by the version: where DeepSpeed cleared them, nothing is left to do."""
    for param in module.parameters():
        if param.grad is not None:
            param.grad = None


@contextlib.contextmanager
def _dynamo_off(off: bool):
    """TorchDynamo off (TORCHDYNAMO_DISABLE=1, which `torch.compile` reads when it is called) while DeepSpeed builds
    the engine of a run without --compile. For ZeRO 1-3 `deepspeed.initialize` imports DeepSpeed's Muon optimizer,
    whose module wraps its functions in `torch.compile` at import, and that imports most of torch._inductor,
    torch._functorch and networkx: about a CPU-second of every rank's start-up (2026-11-27, 2-core EPYC), for
    functions only the Muon optimizer calls, which vim_ds's configs cannot name (AdamW or Adam only). A
    TORCHDYNAMO_DISABLE the user set is left as it is."""
    if not off or "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)


def _declare_direct_weight_reads(model: torch.nn.Module):
    """ZeRO-3 gathers a module's parameters when the module is called; Vim's modules read some of their children's
    weights without calling them: the mixer its projections' and convs' (in_proj, conv1d, x_proj, dt_proj,
    out_proj), a block its norm's and the model its final norm's (the residual add and the norm are one op). Eager
    DeepSpeed notices such a read when it happens and gathers then; a compiled graph reads the partitioned
    placeholder instead, so declare them."""
    # DeepSpeed here, not at the top (start-up): as in build
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for module in model.modules():
        read = (list(module.children()) if isinstance(module, BiMambaMixer)
                else [module.norm] if isinstance(module, Block)
                else [module.norm_f] if isinstance(module, VisionMamba) else [])
        for child in read:
            for param in child.parameters():
                register_external_parameter(module, param)


def compile_engine(engine, ds, backend: str) -> str:
    """torch.compile through DeepSpeed (its hooks stay in place); what DeepSpeed refuses becomes one line. Returns
    what was compiled, for the messages of a compilation that fails later (it compiles lazily)."""
    deepcompile = bool(getattr(engine, "is_deepcompile_enabled", lambda: False)())
    what = f"ZeRO-{ds.zero_stage}" + (" with DeepCompile" if deepcompile else "")
    if ds.zero_stage == 3:
        _declare_direct_weight_reads(engine.module)
    try:
        engine.compile(backend=backend)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises many types; the user needs the reason
        raise ValueError(f"--compile: DeepSpeed cannot compile the model under {what} "
                         f"({first_line(exc)}); train without --compile") from exc
    return what
