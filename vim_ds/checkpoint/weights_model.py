"""A model with the weights of a file, for inference (`vim-ds predict`, `vim-ds export`): the model is the one the
file describes (a `vim-ds convert` file's "vim_ds" entry or safetensors metadata) unless the caller names it, its
head's classes are the weights' own, and the class names are those the file records."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..models import ModelConfig
from .class_names import recorded
from .convert import read_vim_ds_meta
from .files import is_safetensors, load_into, load_weights_file, select_weights


class LoadedModel(NamedTuple):
    model: torch.nn.Module      # in eval mode
    input_size: int
    num_classes: int            # 0: a backbone's weights, the model returns pooled features
    class_names: list | None    # as the file records them (None when it records none)


def load_model(weights: str, model: str | None = None, kwargs=None, input_size: int | None = None,
               num_classes: int | None = None, ema: bool = False, backbone_ok: bool = False) -> LoadedModel:
    """The model of `weights` (`model`, `kwargs` (K=V pairs), `input_size` override the file's description). A
    file without a classification head is refused (a random head would be built in its place), unless
    `backbone_ok` and `num_classes` 0 ask for the backbone alone (timm's convention: the model then returns its
    pooled features); `num_classes` other than the head's is refused (loading would re-initialise it). Bad input
    is a ValueError (a CheckpointError for a file that does not load) naming the option to change."""
    obj = load_weights_file(weights)
    meta = read_vim_ds_meta(weights if is_safetensors(weights) else obj) or {}
    state = select_weights(obj, weights, ema=ema)
    name = model or meta.get("model")
    if not name:
        raise ValueError(f"{weights} does not name its model: give --model")
    kwargs = dict(kwargs) if kwargs is not None else dict(meta.get("model_kwargs") or {})
    input_size = input_size or meta.get("input_size") or 224
    head = state.get("head.weight")
    has_head = isinstance(head, torch.Tensor)
    if not has_head and not (backbone_ok and num_classes == 0):
        hint = "; or pass --num-classes 0 to export the backbone's features" if backbone_ok else ""
        raise ValueError(f"{weights} has no classification head (no head.weight): it holds a backbone, and a "
                         f"random head would classify in its place; give the weights of a trained classifier{hint}")
    classes = head.shape[0] if has_head else 0
    if has_head and num_classes not in (None, classes):
        raise ValueError(f"{weights} classifies {classes} classes, --num-classes is {num_classes}: "
                         f"omit --num-classes (or give {classes})")
    net = ModelConfig(name, classes, input_size, kwargs).build()
    load_into(net, state, weights)
    return LoadedModel(net.eval(), input_size, net.num_classes, recorded(meta, net.num_classes))
