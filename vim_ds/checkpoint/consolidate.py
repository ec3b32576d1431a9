"""One plain fp32 state dict from a DeepSpeed checkpoint directory, with no GPU and no process group.

ZeRO 1/2/3 (and bf16) checkpoints keep the fp32 master weights partitioned over the optimizer files; DeepSpeed's
own `zero_to_fp32` reassembles them for any rank count. A checkpoint without ZeRO partitions (stage 0 in fp32)
holds the full module in `mp_rank_00_model_states.pt`. Stage 0 in bf16/fp16 runs DeepSpeed's FP16_Optimizer, which
keeps the fp32 masters (`fp32_groups`, in optimizer parameter-group order) inside `mp_rank_00_model_states.pt`
next to the half-precision module: those masters are what is returned, matched to parameter names by rebuilding
the model's parameter groups (vim_ds.models.param_groups).
"""
from __future__ import annotations

import contextlib
import glob
import io
import os

import torch

from ..models import ModelConfig, param_groups
from . import safe_load
from .files import CheckpointError


def _module_weights(tag_dir: str) -> dict[str, torch.Tensor]:
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{tag_dir} has neither ZeRO optimizer partitions nor mp_rank_00_model_states.pt")
    state = safe_load.load(path)
    module = state.get("module")
    if not module:
        raise CheckpointError(f"{path} holds no module weights")
    optimizer = state.get("optimizer")
    # half-precision stage 0: fp32 masters
    if isinstance(optimizer, dict) and optimizer.get("fp32_groups"):
        return _fp32_masters(path, state, optimizer["fp32_groups"])
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def named_param_groups(path: str, state: dict) -> list[list[tuple[str, torch.Size]]]:
    """(name, shape) of each parameter in the optimizer's groups, in their order, for a checkpoint without ZeRO
    partitions (whose files number parameters instead of naming them): the model's `param_groups`, rebuilt from
    the model description the trainer saves in its client state."""
    config = ModelConfig.from_description(state)
    if config is None:
        raise CheckpointError(f"{path} has optimizer state but no model description to name its parameters")
    model = config.build()  # on CPU: the Vim constructor cannot run on the meta device
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(names[id(p)], p.shape) for p in g["params"]] for g in param_groups(model, 0.0) if g["params"]]


def _fp32_masters(path: str, state: dict, fp32_groups) -> dict[str, torch.Tensor]:
    """Name FP16_Optimizer's fp32 master groups (per-parameter tensors or one flat tensor per group)."""
    groups = named_param_groups(path, state)
    masters = [g if isinstance(g, (list, tuple)) else [g] for g in fp32_groups]
    masters = [g for g in masters if len(g) and sum(t.numel() for t in g)]
    if len(groups) != len(masters):
        raise CheckpointError(f"{path}: {len(masters)} fp32 master groups, the model has {len(groups)}")
    out = {}
    for named, tensors in zip(groups, masters):
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        numels = [shape.numel() for _, shape in named]
        if flat.numel() != sum(numels):
            raise CheckpointError(f"{path}: fp32 masters ({flat.numel()} values) do not fit the model "
                                  f"({sum(numels)} parameters in that group)")
        for (name, shape), chunk in zip(named, flat.split(numels)):
            out[name] = chunk.reshape(shape).clone()
    # in the module's order; buffers and anything not in the optimizer (frozen parameters) come from the module
    return {name: out[name] if name in out else (value.float() if value.is_floating_point() else value)
            for name, value in state["module"].items()}


def fp32_state_dict(save_dir: str, tag: str) -> dict[str, torch.Tensor]:
    # DeepSpeed here, not at the top: seconds of start-up that reading a weights file never needs
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = os.path.join(save_dir, tag)
    if not glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        return _module_weights(tag_dir)
    # zero_to_fp32 loads with weights_only=False: forced to weights_only here; it narrates every tensor
    try:
        with safe_load.deepspeed_loads(tag_dir), contextlib.redirect_stdout(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag)
    except CheckpointError:
        raise
    except ValueError as exc:
        if "is not a zero checkpoint" in str(exc):  # stage 0: the module file has the weights
            return _module_weights(tag_dir)
        raise CheckpointError(f"cannot consolidate {tag_dir}: {exc}") from exc
    return dict(state)
