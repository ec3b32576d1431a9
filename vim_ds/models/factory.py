"""Models from a run's arguments, and which of their parameters take weight decay.

Both are facts about the model that several layers need: the trainer builds its model and AdamW groups from them,
evaluation builds the model to score, and checkpoint conversion rebuilds the groups to name the fp32 master weights
that DeepSpeed's stage-0 optimizer stores in group order.
"""
from __future__ import annotations

import torch


def build_model(args, num_classes: int) -> torch.nn.Module:
    """The model named by `args.model` (a registered Vim name or alias) with the run's size, dropout,
    `--model-kwargs` and `--grad-checkpointing`; randomly initialised (the caller loads `--finetune` weights)."""
    import timm

    from . import vim  # noqa: F401  (registers the Vim variants)

    try:
        model = timm.create_model(args.model, pretrained=False, num_classes=num_classes, img_size=args.input_size,
                                  drop_rate=args.drop, drop_path_rate=args.drop_path, **args.model_kwargs)
    except RuntimeError as exc:
        if "Unknown model" in str(exc):
            raise ValueError(f"unknown model {args.model!r} (try vim_tiny, vim_small, vim_base, vim_small_s8)") from exc
        raise
    except TypeError as exc:
        raise ValueError(f"--model-kwargs: {exc}") from exc
    if getattr(args, "grad_checkpointing", False):  # --grad-checkpointing (absent from converters' namespaces)
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
