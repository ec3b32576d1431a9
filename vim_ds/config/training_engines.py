"""The training engines `vim-ds train --engine` chooses from, each one `TrainingEngine`: what it can do, as the rest of
the package asks it (saves checkpoints, keeps an EMA, compiles, splits the sequence, ...), its precision rules, and
how it is built. `ENGINES` maps each name to its engine; `training_engine(name)` looks one up. Nothing else in the
package compares engine names (tests/test_engines.py checks it): it asks the engine what it can do.

deepspeed  DeepSpeed's engine (runtime/deepspeed_engine.py): ZeRO 0-3, checkpoints, EMA, --compile, sequence
           parallelism
ddp, fsdp  PyTorch DDP and FSDP2 (runtime/baselines.py), the measurement baselines of `vim-ds zero-compare`

The command line reads the registry for --engine's choices and its rules; DeepSpeed itself is imported only where a
run builds its engine (runtime/deepspeed_engine.py). The registry is the configuration's: a RunConfig derives
--model-ema from it and its rules (config/run_rules.py) ask it; the backends it builds are the runtime's, below it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import baselines, deepspeed_engine
from ..runtime.baselines import precision_label
from .ds_config import PRECISION_DTYPES


@dataclass(frozen=True)
class TrainingEngine:
    """A training engine, by what the package asks of it; this class builds DeepSpeed's."""
    name: str
    # saves DeepSpeed checkpoints (universal ones included) under OUTPUT_DIR/checkpoints: --resume and
    # --save-interval need it, and the output folder's checkpoints/ is checked writable only for it
    saves_checkpoints: bool
    # keeps an EMA of the weights: --model-ema's default, refused where False
    keeps_ema: bool
    # --compile (through DeepSpeed's engine.compile())
    compiles: bool
    # --sequence-parallel N > 1 (the split's collectives inside its forward)
    splits_sequence: bool
    # get_global_grad_norm() answers without ZeRO too (DeepSpeed's answers None at stage 0: the trainer computes it)
    reports_grad_norm_without_zero: bool
    # a PyTorch measurement baseline of `vim-ds zero-compare` (its --baselines), not a ZeRO stage
    baseline: bool
    # each rank holds dim-0 shards of the model states (FSDP full sharding), not whole ones; for a baseline
    shards_states: bool = False
    # what each rank holds, as zero-compare's report says it (a baseline's)
    states_held: str = ""

    def runs_precision(self, precision: str) -> str:
        """The precision the engine runs a `--precision` in (ValueError: one it cannot run)."""
        return precision

    def param_dtype(self, precision: str):
        """The dtype of the parameters and of the inputs the model is given."""
        return PRECISION_DTYPES[precision]

    def build(self, model, groups: list[dict], ds, device, scheduler_factory, compile_backend: str | None):
        """The engine that trains `model` (parameter groups `groups`, the DeepSpeed config `ds`, the lr schedule
        `scheduler_factory(optimizer)` makes), compiled with `compile_backend` where given: (the engine, its lr
        scheduler, what was compiled or None)."""
        return deepspeed_engine.build(model, groups, ds, scheduler_factory, compile_backend)


@dataclass(frozen=True)
class TorchBaseline(TrainingEngine):
    """A PyTorch baseline (runtime/baselines.py): fp32 parameters, bf16 as autocast, FSDP2 when it shards."""

    def runs_precision(self, precision: str) -> str:
        return precision_label(precision)

    def param_dtype(self, precision: str):
        return torch.float32  # bf16: under autocast

    def build(self, model, groups: list[dict], ds, device, scheduler_factory, compile_backend: str | None):
        wrapper = baselines.FSDPEngine if self.shards_states else baselines.DDPEngine
        engine = wrapper(model, groups, ds, device, scheduler_factory)
        return engine, engine.scheduler, None


_BASELINE = dict(saves_checkpoints=False, keeps_ema=False, compiles=False, splits_sequence=False,
                 reports_grad_norm_without_zero=True, baseline=True)
ENGINES = {engine.name: engine for engine in (
    TrainingEngine("deepspeed", saves_checkpoints=True, keeps_ema=True, compiles=True, splits_sequence=True,
                   reports_grad_norm_without_zero=False, baseline=False),
    TorchBaseline("ddp", **_BASELINE, shards_states=False,
                  states_held="DistributedDataParallel (gradients as bucket views): whole fp32 parameters, gradients "
                              "and Adam moments on every rank, expected 16Ψ"),
    TorchBaseline("fsdp", **_BASELINE, shards_states=True,
                  states_held="FSDP2 `fully_shard` per block + root, full sharding (reshard_after_forward=True): each "
                              "rank holds dim-0 shards (DTensor local tensors) of parameters, gradients and Adam "
                              "moments, expected 16 bytes x rank 0's shard of every tensor (≈ 16Ψ/N, rounded up per "
                              "tensor)"),
)}
DEFAULT = "deepspeed"  # --engine's default


def training_engine(name: str) -> TrainingEngine:
    """The engine called `name`; ValueError, in one line, for a name that is none."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown training engine {name!r}: choose {', '.join(ENGINES)}") from None


def baseline_names() -> list[str]:
    """The names of zero-compare's baselines, in the registry's order."""
    return [name for name, engine in ENGINES.items() if engine.baseline]
