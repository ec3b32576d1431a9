"""One plain fp32 state dict from a DeepSpeed checkpoint directory, with no GPU and no process group.

ZeRO 1/2/3 (and bf16) checkpoints keep the fp32 master weights partitioned over the optimizer files; DeepSpeed's
own `zero_to_fp32` reassembles them for any rank count. A checkpoint without ZeRO partitions (stage 0 in fp32)
holds the full module in `mp_rank_00_model_states.pt`.
"""
from __future__ import annotations

import contextlib
import glob
import io
import os

import torch

from .files import CheckpointError


def _module_weights(tag_dir: str) -> dict[str, torch.Tensor]:
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{tag_dir} has neither ZeRO optimizer partitions nor mp_rank_00_model_states.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own training output, not a user file
    module = state.get("module")
    if not module:
        raise CheckpointError(f"{path} holds no module weights")
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def fp32_state_dict(save_dir: str, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = os.path.join(save_dir, tag)
    if not glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        return _module_weights(tag_dir)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 narrates every tensor
            state = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag)
    except ValueError as exc:
        if "is not a zero checkpoint" in str(exc):  # stage 0: the module file has the weights
            return _module_weights(tag_dir)
        raise CheckpointError(f"cannot consolidate {tag_dir}: {exc}") from exc
    return dict(state)
