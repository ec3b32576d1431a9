"""The whole training state in one vim_ds checkpoint, by parameter name, whatever ZeRO stage and rank count wrote it:
fp32 weights, Adam's moments and step counts, each parameter group's hyperparameters and members, the EMA, the lr
scheduler and the run's position. Two of them compared say whether a resumed run is the uninterrupted one
(`vim-ds compare-runs --state A B`; tests/test_resume_exact.py). Reads files only: no GPU, no process group.

Where DeepSpeed 0.19 keeps the optimizer's state:
- no ZeRO (stage 0): `mp_rank_00_model_states.pt` holds the torch optimizer's state_dict (in bf16 wrapped by
  FP16_Optimizer, beside its fp32 masters). Its parameters are numbered in group order; the groups are the model's
  `param_groups`, rebuilt from the model description in the client state to name them.
- ZeRO-1/2: each group is one flat vector (its parameters in `param_shapes[group]` order, each followed by its
  alignment padding) cut into one contiguous slice per rank: the moments in `base_optimizer_state.state[group]`,
  the weights in `single_partition_of_fp32_groups[group]`. ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer, files
  `bf16_zero_pp_rank_*`) keeps the same layout under the same keys.
- ZeRO-3: each rank holds ceil(numel / ranks) elements of every parameter, concatenated in `param_shapes` order
  (and cut into sub-groups): the moments in `optimizer_state_dict.state[sub_group]`, the weights in
  `fp32_flat_groups`.
"""
from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass, field

import torch

from . import deepspeed_dir as layout
from . import safe_load
from .consolidate import fp32_state_dict, named_param_groups
from .files import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")
HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")
POSITION = ("epoch", "step", "step_in_epoch", "images_seen", "images_bad")


@dataclass
class TrainingState:
    # fp32 (master) weights
    weights: dict[str, torch.Tensor]
    # name -> {"exp_avg", "exp_avg_sq"}
    moments: dict[str, dict[str, torch.Tensor]]
    # name -> Adam's step count
    steps: dict[str, float]
    # HYPERPARAMETERS and "params": [names], in group order
    groups: list[dict]
    # the lr scheduler's state_dict
    scheduler: dict
    # POSITION values of the client state
    position: dict
    ema: dict[str, torch.Tensor] | None = None
    files: list[str] = field(default_factory=list)


def _rank_files(tag_dir: str, pattern: str) -> list[str]:
    files = glob.glob(os.path.join(tag_dir, pattern))
    return sorted(files, key=lambda f: int(re.search(r"zero_pp_rank_(\d+)", os.path.basename(f)).group(1)))


def _step(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _groups(saved_groups: list[dict], names: list[list[str]]) -> list[dict]:
    return [{**{k: tuple(g[k]) if isinstance(g.get(k), (list, tuple)) else g.get(k) for k in HYPERPARAMETERS},
             "params": list(group_names)} for g, group_names in zip(saved_groups, names)]


def _unpartitioned_stage0(tag_dir: str, model_states: dict) -> tuple:
    optimizer = model_states.get("optimizer") or {}
    # FP16_Optimizer (bf16) wraps the torch one
    inner = optimizer.get("optimizer_state_dict", optimizer)
    names = named_param_groups(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), model_states)
    flat_names = [n for group in names for n, _ in group]
    moments, steps = {}, {}
    for index, name in enumerate(flat_names):
        state = inner["state"].get(index, {})
        moments[name] = {k: state[k].float() for k in MOMENTS if k in state}
        steps[name] = _step(state.get("step", 0))
    return moments, steps, _groups(inner["param_groups"], [[n for n, _ in g] for g in names])


def _zero12(optim_states: list[dict], param_shapes: list[dict]) -> tuple:
    """ZeRO-1/2: concatenate the ranks' slices of each group's flat vector, then walk its parameters."""
    first = optim_states[0]
    paddings = first.get("param_alignment_paddings")
    out = {key: {} for key in ("fp32", *MOMENTS)}
    steps = {}
    for g, shapes in enumerate(param_shapes):
        flats = {"fp32": torch.cat([s["single_partition_of_fp32_groups"][g] for s in optim_states])}
        for key in MOMENTS:
            flats[key] = torch.cat([s["base_optimizer_state"]["state"][g][key] for s in optim_states])
        group_step = _step(first["base_optimizer_state"]["state"][g].get("step", 0))
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            for key, flat in flats.items():
                out[key][name] = flat[offset:offset + numel].float().view(shape).clone()
            steps[name] = group_step
            offset += numel + (paddings[g][i] if paddings else 0)
    return out, steps, first["base_optimizer_state"]["param_groups"]


def _zero3(optim_states: list[dict], param_shapes: list[dict]) -> tuple:
    """ZeRO-3: every rank holds the same-sized slice of each parameter, in order: zip the slices back together."""
    ranks = len(optim_states)
    inner = [s["optimizer_state_dict"] for s in optim_states]
    flats = {"fp32": [torch.cat([t.reshape(-1) for t in s["fp32_flat_groups"]]) for s in optim_states]}
    for key in MOMENTS:
        flats[key] = [torch.cat([st[key].reshape(-1) for _, st in sorted(o["state"].items())]) for o in inner]
    out = {key: {} for key in flats}
    steps = {}
    group_step = _step(next(iter(inner[0]["state"].values())).get("step", 0))
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / ranks)
            for key, per_rank in flats.items():
                whole = torch.cat([flat[offset:offset + part] for flat in per_rank])[:numel]
                out[key][name] = whole.float().view(shape).clone()
            steps[name] = group_step
            offset += part
    return out, steps, inner[0]["param_groups"]


def read_training_state(tag_dir: str) -> TrainingState:
    """The state of the complete checkpoint `tag_dir` (a `global_stepN` directory vim_ds wrote)."""
    if not layout.is_tag_dir(tag_dir):
        raise CheckpointError(f"{tag_dir} is not a DeepSpeed checkpoint directory (no *model_states.pt)")
    model_files = _rank_files(tag_dir, "*zero_pp_rank_*_model_states.pt") or \
        [os.path.join(tag_dir, "mp_rank_00_model_states.pt")]
    model_states = safe_load.load(model_files[0])
    optim_files = _rank_files(tag_dir, "*zero_pp_rank_*_optim_states.pt")
    files = model_files + optim_files
    if not optim_files:  # no ZeRO partitions: the module file holds everything
        weights = fp32_state_dict(os.path.dirname(tag_dir), os.path.basename(tag_dir))
        moments, steps, groups = _unpartitioned_stage0(tag_dir, model_states)
    else:
        optim_states = [safe_load.load(f)["optimizer_state_dict"] for f in optim_files]
        stage = int(optim_states[0].get("zero_stage", 2))
        if len(optim_states) != optim_states[0].get("partition_count", len(optim_states)) and stage == 3:
            raise CheckpointError(f"{tag_dir}: {len(optim_states)} optimizer files for "
                                  f"{optim_states[0]['partition_count']} ranks")
        reader = _zero3 if stage == 3 else _zero12
        values, steps, saved_groups = reader(optim_states, model_states["param_shapes"])
        weights = values.pop("fp32")
        moments = {name: {key: values[key][name] for key in MOMENTS} for name in weights}
        groups = _groups(saved_groups, [list(shapes) for shapes in model_states["param_shapes"]])
    client = model_states
    ema_path = os.path.join(tag_dir, layout.EMA_FILE)
    ema = safe_load.load(ema_path) if os.path.isfile(ema_path) else None
    return TrainingState(weights=weights, moments=moments, steps=steps, groups=groups,
                         scheduler=dict(model_states.get("lr_scheduler") or {}),
                         position={k: client.get(k) for k in POSITION}, ema=ema, files=files)


def _tensor_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 for equal tensors; the largest |a - b| where b is all zeros). A norm, not the largest
    element: a reordered sum that flips the rounding of one near-zero gradient moves that element's Adam update a
    lot and the tensor hardly at all, while a wrong weight decay or a lost moment moves all of it."""
    a, b = a.detach().double(), b.detach().double()
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm else float((a - b).abs().max(initial=0.0))


def differences(a: TrainingState, b: TrainingState) -> dict:
    """Per kind of state, how far `a` is from `b`: the worst `_tensor_diff` of a tensor ("weights",
    "exp_avg", "exp_avg_sq", "ema") with the tensor's name, and for the exact parts ("steps", "groups",
    "scheduler", "position") the entries that differ. Names present in only one side are an error."""
    if a.weights.keys() != b.weights.keys():
        raise CheckpointError(f"the two checkpoints hold different parameters: "
                              f"{sorted(a.weights.keys() ^ b.weights.keys())[:5]}")

    def worst(pairs):
        diffs = [(_tensor_diff(x, y), name) for name, x, y in pairs]
        return max(diffs) if diffs else (0.0, None)

    out = {"weights": worst((n, a.weights[n], b.weights[n]) for n in a.weights if a.weights[n].is_floating_point())}
    for key in MOMENTS:
        out[key] = worst((n, a.moments[n][key], b.moments[n][key]) for n in a.moments)
    if (a.ema is None) != (b.ema is None):
        raise CheckpointError("only one of the two checkpoints has EMA weights")
    out["ema"] = worst((n, a.ema[n], b.ema[n]) for n in a.ema if a.ema[n].is_floating_point()) \
        if a.ema is not None else (0.0, None)
    out["steps"] = {n: (a.steps[n], b.steps[n]) for n in a.steps if a.steps[n] != b.steps.get(n)}
    out["groups"] = [(i, ga, gb) for i, (ga, gb) in enumerate(zip(a.groups, b.groups)) if ga != gb]
    if len(a.groups) != len(b.groups):
        out["groups"].append(("count", len(a.groups), len(b.groups)))
    out["scheduler"] = {} if a.scheduler == b.scheduler else {"a": a.scheduler, "b": b.scheduler}
    out["position"] = {k: (a.position[k], b.position[k]) for k in POSITION if a.position[k] != b.position[k]}
    return out
