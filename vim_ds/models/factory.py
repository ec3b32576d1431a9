"""What a model is (`ModelConfig`), how it is built, and which of its parameters take weight decay.

These are facts about the model that several layers need: the trainer builds its model and AdamW groups from them
and records the description in its checkpoints; evaluation, resume checks, prediction and export rebuild the model
from that description; checkpoint conversion rebuilds the groups to name the fp32 master weights that DeepSpeed's
stage-0 optimizer stores in group order.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import timm
import torch

from . import vim  # noqa: F401  (registers the Vim variants)
from .vim import ALIASES

# The keys under which a checkpoint's client state and a converted file's metadata describe the model.
DESCRIPTION_KEYS = ("model", "model_kwargs", "num_classes", "input_size")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model as a run names it: a registered Vim name or alias, its constructor overrides (`--model-kwargs`), the
    head's classes and the image side. Dropout, stochastic depth and gradient checkpointing change how it trains,
    not its weights, so checkpoints record only the description (`description()`). `drop`/`drop_path` None: the
    architecture's own rate (a Vim's published stochastic depth 0.1, timm's DeiT none), as the benchmarks and the
    demo build their models; a run gives its --drop/--drop-path."""

    name: str
    num_classes: int
    input_size: int = 224
    kwargs: Mapping = dataclasses.field(default_factory=dict)
    drop: float | None = 0.0
    drop_path: float | None = 0.0
    grad_checkpointing: bool = False

    @classmethod
    def from_description(cls, description: Mapping) -> "ModelConfig | None":
        """The model a checkpoint or converted file describes (DESCRIPTION_KEYS), or None where it does not."""
        if any(description.get(key) is None for key in ("model", "num_classes", "input_size")):
            return None
        return cls(description["model"], description["num_classes"], description["input_size"],
                   dict(description.get("model_kwargs") or {}))

    def description(self) -> dict:
        """What checkpoints and converted files record (DESCRIPTION_KEYS)."""
        return {"model": self.name, "model_kwargs": dict(self.kwargs), "num_classes": self.num_classes,
                "input_size": self.input_size}

    def same_description(self, other: "ModelConfig") -> bool:
        """The same description, an alias (vim_t) counting as its name (vim_tiny)."""
        canonical = lambda c: (ALIASES.get(c.name, c.name), dict(c.kwargs), c.num_classes, c.input_size)  # noqa: E731
        return canonical(self) == canonical(other)

    def shown(self) -> str:
        """`vim_tiny depth=2, 10 classes, input size 32`, as messages name a model."""
        kwargs = "".join(f" {k}={v}" for k, v in sorted(self.kwargs.items()))
        return f"{self.name}{kwargs}, {self.num_classes} classes, input size {self.input_size}"

    def build(self) -> torch.nn.Module:
        """The model, randomly initialised (the caller loads weights); a bad name or keyword is a ValueError."""
        rates = {key: rate for key, rate in (("drop_rate", self.drop), ("drop_path_rate", self.drop_path))
                 if rate is not None}
        try:
            model = timm.create_model(self.name, pretrained=False, num_classes=self.num_classes,
                                      img_size=self.input_size, **rates, **self.kwargs)
        except RuntimeError as exc:
            if "Unknown model" in str(exc):
                raise ValueError(f"unknown model {self.name!r} (try vim_tiny, vim_small, vim_base, "
                                 f"vim_small_s8)") from exc
            raise
        except TypeError as exc:
            raise ValueError(f"--model-kwargs: {exc}") from exc
        if self.grad_checkpointing:
            model.set_grad_checkpointing(True)
        return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay for matrices, none for biases, norms, 1-D parameters, the position embedding,
    the class token (timm's `model.no_weight_decay()` names), and the SSM's A_log/A_b_log and D/D_b (marked
    `_no_weight_decay` by the mixer)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip or getattr(p, "_no_weight_decay", False):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
