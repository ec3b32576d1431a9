"""The Vim/DeiT optimisation recipe: batch-scaled learning rate, per-step warmup + cosine.

DeepSpeed builds the optimizer from the JSON's "optimizer" section (so offload picks its CPU Adam); we hand it the
parameter groups (`vim_ds.models.param_groups`: which parameters take weight decay is a fact about the model, also
needed to read checkpoints) and a scheduler, which it steps once per optimizer step and saves in its checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING

from timm.scheduler import CosineLRScheduler

from ..config.ds_config import ConfigError
from ..config.options_file import option_name, shown
from ..config.run_config import DEEPSPEED_SETS_TOO

if TYPE_CHECKING:
    from ..config.run_config import OptimOptions


def scaled_lr(base_lr: float, global_batch: int, unscale: bool = False) -> float:
    """DeiT's linear scaling rule: the lr given on the command line is for a global batch of 512."""
    return base_lr if unscale else base_lr * global_batch / 512.0


class PerStepScheduler:
    """timm's cosine schedule with linear warmup (the one DeiT and Vim use), advanced once per optimizer step.

    DeepSpeed calls `step()` after every optimizer step and saves `state_dict()` with its checkpoints; timm's
    scheduler is driven by `step_update(num_updates)`. This adapter connects the two.
    """

    def __init__(self, optimizer, *, total_steps: int, warmup_steps: int, warmup_lr: float, min_lr: float):
        peak = min(group.get("initial_lr", group["lr"]) for group in optimizer.param_groups)
        problem = schedule_error(peak, min_lr, warmup_lr if warmup_steps > 0 else None)
        # the last line of defence (train.py's preflight and the Trainer say it first, in full)
        if problem:
            raise ValueError(f"the lr schedule would not decay: {problem}")
        self.optimizer = optimizer
        self.num_updates = 0
        self.schedule = CosineLRScheduler(optimizer, t_initial=max(total_steps, 1), lr_min=min_lr,
                                          warmup_t=warmup_steps, warmup_lr_init=warmup_lr, t_in_epochs=False)
        self.schedule.step_update(0)

    def step(self, **_):
        self.num_updates += 1
        self.schedule.step_update(self.num_updates)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates}

    def load_state_dict(self, state: dict):
        self.num_updates = int(state["num_updates"])
        self.schedule.step_update(self.num_updates)


def ds_auto_values(optim: OptimOptions, batch) -> dict:
    """The run's values (its optimisation options) for a DeepSpeed config's "auto" entries ({dotted.path: value}),
    the lr scaled to the resolved global batch (`batch`: ds_config.BatchSizes)."""
    return {"optimizer.params.lr": scaled_lr(optim.lr, batch.global_, optim.unscale_lr),
            "optimizer.params.weight_decay": optim.weight_decay, "optimizer.params.betas": list(optim.opt_betas),
            "optimizer.params.eps": optim.opt_eps, "gradient_clipping": optim.clip_grad or 0.0}


# What a DeepSpeed config and the command line can both set: the JSON's dotted path -> the option (dest). Defined with
# the options (run_config.DEEPSPEED_SETS_TOO), since a RunConfig records which of them were given (`optim.given`)
SHARED = DEEPSPEED_SETS_TOO


def settle_shared(optim: OptimOptions, prepared) -> tuple[OptimOptions, str | None]:
    """One value for each of SHARED, whichever source sets it (ds_configs/README.md): "auto" (or a value the file
    leaves out: an optimizer param; gradient_clipping, when --clip-grad is given) is the command line's; a number in
    the JSON must agree with a value given on the command line or in a --config file (`optim.given`), or the run is
    refused in one line (a ConfigError naming both), as for the batch sizes; a number the command line did not give
    wins, and the options take it, so that what runs is what the parameter groups' weight decay, the --engine
    baselines, options.yaml and the checkpoints use and say. Returns the options and a note naming the values the
    JSON set (None when it set none)."""
    ours = ds_auto_values(optim, prepared.batch)
    taken = {}
    for path, dest in SHARED.items():
        value = _at(prepared.config, path)
        if path in prepared.filled or value is None or _same(value, ours[path]):
            continue
        if dest in optim.given and path in prepared.unset:
            # the file is silent (DeepSpeed's default written down): what was given runs, as "auto" would give it
            prepared.config[path] = ours[path]
            continue
        if dest in optim.given:
            raise ConfigError(_disagreement(optim, prepared, path, value))
        taken[dest] = value
    if not taken:
        return optim, None
    if "lr" in taken:  # the JSON's lr is the optimizer's, not one per 512 images to scale
        taken["unscale_lr"] = True
    if "opt_betas" in taken:
        taken["opt_betas"] = tuple(taken["opt_betas"])

    unset = {SHARED[path] for path in prepared.unset}
    said = ", ".join(f"{option_name(dest)} {shown(value)}" + (" (DeepSpeed's default: the file leaves it out)"
                                                               if dest in unset else "")
                     for dest, value in taken.items() if dest != "unscale_lr")
    note = (f"note: {prepared.source} sets {said} (not given on the command line): the file's values run, and "
            f"options.yaml records them")
    return dataclasses.replace(optim, **taken), note


def _at(config: dict, path: str):
    node = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=0)


def _disagreement(optim: OptimOptions, prepared, path: str, value) -> str:
    """The refusal of a JSON number that contradicts the command line, in the batch sizes' words."""
    dest = SHARED[path]
    flag = option_name(dest)
    where = f"{prepared.source} sets {path}={json.dumps(value)}"
    fix = f"set it to \"auto\" or drop {flag}"
    given = f"{flag} is {shown(getattr(optim, dest))}"
    if dest == "lr" and not optim.unscale_lr:
        given = (f"{flag} {shown(optim.lr)} gives {shown(scaled_lr(optim.lr, prepared.batch.global_))} (x global "
                 f"batch {prepared.batch.global_} / 512)")
    elif dest == "clip_grad" and not optim.clip_grad:
        given = f"{flag} is {shown(optim.clip_grad or 0.0)} (no clipping)"
    return f"{where} but {given}; {fix}"


def schedule_error(peak: float, min_lr: float, warmup_lr: float | None) -> str | None:
    """Why a cosine schedule from `peak` to `min_lr` (with a warmup from `warmup_lr`, None without one) would raise
    the lr instead of lowering it, or None. Equal values are fine (a constant lr)."""
    if min_lr > peak:
        return f"--min-lr {min_lr:g} is above the peak lr {peak:g}"
    if warmup_lr is not None and warmup_lr > peak:
        return f"--warmup-lr {warmup_lr:g} is above the peak lr {peak:g}"
    return None


# the floor and the warmup start: (dest, option, what the schedule would do with a value above the peak)
_SCHEDULE_ENDS = (("min_lr", "--min-lr", "the cosine schedule would raise the lr to it over the run", "the floor",
                   "e.g. --min-lr 0"),
                  ("warmup_lr", "--warmup-lr", "the warmup would lower the lr to the peak instead of raising it",
                   "the warmup's start", "or --warmup-epochs 0 for no warmup"))


def check_lr_settings(optim: OptimOptions, peak: float, peak_from: str,
                      fix: str) -> tuple[OptimOptions, list[str]]:
    """Learning-rate settings that contradict each other, found once the peak lr is known (after the batch
    scaling, or the DeepSpeed config's own number): a --min-lr, or with a warmup a --warmup-lr, above the peak.

    A value given (on the command line or in a --config file) is refused with a ValueError naming the values and
    the fix. The built-in default (optim.lr_defaults, resolved with the RunConfig: the recipe's 1e-5 / 1e-6, meant
    for a global batch of 512, which a small batch scales the lr below) is lowered to the peak instead, and a note
    says so: a user who never chose the floor is not refused for a small batch, and the lr never rises. Returns the
    options with any default lowered (`optim` itself is frozen) and the notes. `peak_from` says where the peak
    comes from; `fix` how to raise it."""
    notes = []
    for dest, option, effect, role, hint in _SCHEDULE_ENDS:
        value = getattr(optim, dest)
        if value is None or value <= peak or (dest == "warmup_lr" and not optim.warmup_epochs > 0):
            continue
        if dest in optim.lr_defaults:
            optim = dataclasses.replace(optim, **{dest: peak})
            notes.append(f"note: the default {option} {value:g} is above this run's peak lr {peak:g} ({peak_from}): "
                         f"{role} is lowered to {_exact(peak)}, so the lr never rises; give {option} to choose it "
                         f"({hint})")
            continue
        raise ValueError(f"{option} {value:g} is above the peak lr {peak:g} ({peak_from}): {effect}; give {option} "
                         f"at most {_exact(peak)} ({hint}){fix}")
    return optim, notes


def _exact(value: float) -> str:
    """The shortest text that reads back as `value` (an "at most" a user can type: 9.765625e-07, not 9.76563e-07)."""
    return next((text for text in (f"{value:.{p}g}" for p in range(6, 18)) if float(text) == value), repr(value))


def peak_lr(optim: OptimOptions, prepared) -> tuple[float, str, str]:
    """(the optimizer's peak lr, where it comes from, how to raise it) for a prepared DeepSpeed config
    (ds_config.PreparedConfig): its optimizer.params.lr, a number written in the JSON winning over --lr."""
    scaled = scaled_lr(optim.lr, prepared.batch.global_, optim.unscale_lr)
    params = prepared.config.get("optimizer", {}).get("params", {})
    lr = params.get("lr", scaled)
    if "lr" in params and "optimizer.params.lr" not in prepared.filled:  # a number the JSON holds
        return lr, f"optimizer.params.lr in {prepared.source}, which wins over --lr", \
            f", or a larger optimizer.params.lr in {prepared.source}"
    if optim.unscale_lr:
        return lr, f"--lr {optim.lr:g}, --unscale-lr", ", or a larger --lr"
    return lr, f"--lr {optim.lr:g} x global batch {prepared.batch.global_} / 512", \
        ", or a larger --lr (or --unscale-lr to use --lr as it is)"
