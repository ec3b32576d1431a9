"""Whether this run can resume a checkpoint, decided from what the checkpoint records before DeepSpeed's loader runs
(which otherwise fails deep inside with `AssertionError`, `'NoneType' object has no attribute 'copy'`, a missing
`*optim_states.pt` or a state_dict error cut to its first line).

What DeepSpeed 0.19.8 can load (tried on CPU): a checkpoint goes back into a run whose optimizer state has the
same form (`_optimizer`): the same stage, or ZeRO-1 and ZeRO-2 with each other, and bf16 on or off on both sides
(it names the files). A universal checkpoint (`vim-ds convert --universal`, or the copy vim_ds makes when the rank
count changes) loads into ZeRO-1 or ZeRO-2 in any precision, or into ZeRO-3 when ZeRO-3 wrote it; never into
ZeRO-0. The model must have the checkpoint's parameter shapes.
"""
from __future__ import annotations

import torch

from ..checkpoint import class_names
from ..checkpoint.convert import client_state
from ..checkpoint.files import CheckpointError
from ..models import ModelConfig


def _optimizer(stage: int, precision: str) -> str:
    """The form in which a run of this stage and precision writes and reads its optimizer state. ZeRO-1 and ZeRO-2
    share it (BF16_Optimizer, which ZeRO-1 runs in bf16, keeps the same keys); with bf16 on, DeepSpeed reads ZeRO
    partitions named `bf16_zero_pp_rank_*` only, and without it `zero_pp_rank_*` only."""
    if stage == 0:
        return "FP16_Optimizer" if precision in ("bf16", "fp16") else "torch"
    return ("ZeRO-3" if stage == 3 else "ZeRO-1/2") + (" bf16" if precision == "bf16" else "")


def _optimizer_refusal(tag_dir: str, saved: dict, stage: int, precision: str, universal: bool) -> str | None:
    """`universal`: the run loads it through a universal checkpoint (decided by parts.plan_resume)."""
    saved_stage, saved_precision = int(saved.get("zero_stage") or 0), saved.get("precision")
    saved_world = saved.get("world_size")
    if saved_precision is None:
        return None  # not written by vim_ds's trainer: left to DeepSpeed
    # the universal format loads there in any precision
    both_1_or_2 = stage in (1, 2) and saved_stage in (1, 2)
    if universal:
        if both_1_or_2 or stage == saved_stage == 3:
            return None
        cannot, convert = "DeepSpeed cannot load its universal checkpoint into that", ""
    else:
        if _optimizer(stage, precision) == _optimizer(saved_stage, saved_precision):
            return None
        cannot = "DeepSpeed cannot load the optimizer state of one into the other"
        convert = f", or convert it with `vim-ds convert --universal {tag_dir}` and resume {tag_dir}_universal" \
            if both_1_or_2 else ""
    ranks = f" on {saved_world} rank{'s' if saved_world != 1 else ''}" if saved_world else ""
    same = f"ZeRO-{saved_stage} --deepspeed_config" + ("" if saved_precision == precision else
                                                      f" and --precision {saved_precision}")
    return (f"{tag_dir} was saved by ZeRO-{saved_stage} {saved_precision}{ranks}; this run uses ZeRO-{stage} "
            f"{precision}, and {cannot}: resume with a {same}{convert}")


def _shapes(model) -> dict[str, tuple]:
    # on CPU: the Vim constructor cannot run on the meta device
    with torch.random.fork_rng(devices=[]):
        return {k: tuple(v.shape) for k, v in model.build().state_dict().items()}


def _model_refusal(tag_dir: str, saved: dict, model) -> str | None:
    """Another model than the checkpoint's (`model`: this run's models.ModelConfig): named by its first parameter
    of another shape."""
    there = ModelConfig.from_description(saved)
    if there is None or saved.get("model_kwargs") is None:
        return None  # no description: DeepSpeed's strict load still refuses another model
    if there.same_description(model):
        # the same description (a model built twice to compare costs seconds for Vim-base)
        return None
    saved_shapes, shapes = _shapes(there), _shapes(model)
    differ = [k for k in saved_shapes if saved_shapes[k] != shapes.get(k)] + \
        [k for k in shapes if k not in saved_shapes]
    if not differ:
        return None  # another name for the same architecture
    first = differ[0]
    shown = lambda table: str(table[first]) if first in table else "absent"  # noqa: E731
    more = f" and {len(differ) - 1} more" if len(differ) > 1 else ""
    return (f"{tag_dir} holds another model ({first}: {shown(saved_shapes)} there, {shown(shapes)} in this run{more}): "
            f"it was {there.shown()}; this run builds {model.shown()}; resume with its --model, "
            f"--model-kwargs, --input-size and data")


def _classes_refusal(tag_dir: str, saved: dict, data_source: str, classes: list | None) -> str | None:
    """Other class names than the checkpoint's (a class folder renamed, added or removed; the same count would
    train on with labels that mean other classes)."""
    return class_names.refusal(tag_dir, class_names.recorded(saved), data_source, classes,
                               "resume with the data it was trained on")


def check(tag_dir: str, model, data_source: str, ds, universal: bool, classes: list | None = None) -> str | None:
    """Raise CheckpointError (one line: what the checkpoint was saved by, what this run is, what to do) when this
    run's DeepSpeed engine could not load the checkpoint in `tag_dir` (`universal`: loaded as a universal
    checkpoint, already one or converted for another rank count), or when it holds another model than `model` (a
    models.ModelConfig), or was trained on other class names than `classes` (this run's data, named in messages as
    `data_source`, in label order). Returns a note for rank 0 to print, or None: a checkpoint saved
    before the names were recorded cannot be compared (the run's next checkpoint records them)."""
    saved = client_state(tag_dir, mmap=True)
    problem = _optimizer_refusal(tag_dir, saved, ds.zero_stage, ds.precision, universal) or \
        _classes_refusal(tag_dir, saved, data_source, classes) or _model_refusal(tag_dir, saved, model)
    if problem:
        raise CheckpointError(problem)
    # vim_ds's, from before
    if classes and saved.get("precision") is not None and "classes" not in saved:
        return (f"note: {tag_dir} records no class names (saved by an earlier vim_ds): {data_source} is "
                f"taken to have the classes it was trained on, in the same order; its checkpoints from now on "
                f"record them")
    return None
