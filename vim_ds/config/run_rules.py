"""The rules a run's options must keep, alone and together, checked on the typed config (config/run_config.py):
`validate(config)` is the first rule it breaks, said in one line, or None. The command line says it as a usage
error (run_options.parse_config: `vim-ds train: error: ...`, exit 2); engine/run.run says it the same way for a
config made in code. No argparse here, and nothing is changed: a config is resolved as it is made.
"""
from __future__ import annotations

from ..models import ALIASES, VARIANTS
from .run_config import OPTIONS, RULES, RunConfig
from .training_engines import ENGINES, training_engine


def validate(config: RunConfig) -> str | None:
    """The first rule `config` breaks (in the order the command line has always checked them), or None."""
    for rule in (_ranges, _choices, _deepscale, _timeouts, _initial_weights, _engine_can, _sequence_parallel,
                 _compile, _patch_grid, _profile):
        problem = rule(config)
        if problem:
            return problem
    return None


def range_error(values: dict) -> str | None:
    """The first option (in --help order) whose value (`values`: dest -> value) is outside its range rule
    (run_config.Option.rule), said in one line with the value as given."""
    for option in OPTIONS.values():
        value = values[option.dest]
        if not option.rule or value is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(map(RULES[option.rule], items)):
            shown = " ".join(f"{v:g}" if isinstance(v, float) and float(f"{v:g}") == v else str(v) for v in items)
            return f"{option.flag} must be {option.rule}, got {shown}" + (f" ({option.hint})" if option.hint else "")
    return None


def _ranges(config: RunConfig) -> str | None:
    return range_error(config.to_dict())


def _choices(config: RunConfig) -> str | None:
    """An option with choices holding none of them: argparse and option files refuse it before a config is made,
    a config made in code is told here."""
    values = config.to_dict()
    for option in OPTIONS.values():
        value = values[option.dest]
        if option.choices is not None and value is not None and value not in option.choices:
            return f"{option.flag} {value!r} is not one of {', '.join(map(str, option.choices))}"
    return None


def _deepscale(config: RunConfig) -> str | None:
    """DeepSpeed's deprecated spelling, which its own scripts may still pass, names the config when
    --deepspeed_config does not (run_config.resolution); two that disagree are refused."""
    ds = config.deepspeed
    if ds.deepscale_config and ds.deepspeed_config and ds.deepspeed_config != ds.deepscale_config:
        return (f"--deepscale_config {ds.deepscale_config} and --deepspeed_config {ds.deepspeed_config} disagree: "
                f"pass --deepspeed_config alone")
    return None


def _timeouts(config: RunConfig) -> str | None:
    dist_timeout, data_timeout = config.run.dist_timeout, config.data.data_timeout
    if dist_timeout <= 0:
        return f"--dist-timeout must be a positive number of seconds, got {dist_timeout}"
    # a --data-timeout not given holds run_config.derived's value, which keeps the rule
    if data_timeout < 0 or data_timeout >= dist_timeout:
        return (f"--data-timeout must be 0 (no limit) or below --dist-timeout ({dist_timeout:g} s), so that a "
                f"stalled rank stops the job before its peers' collectives time out; got {data_timeout:g}")
    return None


def _initial_weights(config: RunConfig) -> str | None:
    model = config.model
    if sum(map(bool, (model.finetune, model.init_weights, model.save_init_weights))) > 1:
        return "--finetune, --init-weights and --save-init-weights each set the initial weights: pass one"
    return None


def _engine_can(config: RunConfig) -> str | None:
    """What the engine cannot do (training_engines: what each can), asked for."""
    engine = training_engine(config.run.engine)
    refused = [name for name, on, can in (("--resume", config.run.resume, engine.saves_checkpoints),
                                          ("--save-interval", config.run.save_interval, engine.saves_checkpoints),
                                          ("--model-ema", config.model.model_ema, engine.keeps_ema)) if on and not can]
    if refused:
        return (f"--engine {engine.name} is a measurement baseline: it saves no checkpoints and keeps no EMA; drop "
                f"{', '.join(refused)}")
    return None


def _sequence_parallel(config: RunConfig) -> str | None:
    n = config.run.sequence_parallel
    if n <= 1:
        return None
    # the split's collectives run inside the forward: a recomputation would repeat them
    engine = ENGINES[config.run.engine]
    refused = [name for name, on in (("--engine " + engine.name, not engine.splits_sequence),
                                     ("--compile", config.model.compile),
                                     ("--grad-checkpointing", config.model.grad_checkpointing)) if on]
    if refused:
        return (f"--sequence-parallel {n} runs through DeepSpeed's engine, eagerly, without recomputing blocks: drop "
                f"{', '.join(refused)}")
    return None


def _compile(config: RunConfig) -> str | None:
    if config.model.compile and not ENGINES[config.run.engine].compiles:
        return f"--compile goes through DeepSpeed's engine.compile(); --engine {config.run.engine} does not have it"
    return None


def _patch_grid(config: RunConfig) -> str | None:
    model = config.model
    return patch_grid_error(model.model, model.model_kwargs, model.input_size)


def patch_grid_error(model: str, model_kwargs: dict, input_size: int) -> str | None:
    """Why `input_size` is no whole grid of `model`'s patches (which start every `stride` pixels, so
    (input_size - patch_size) must be a multiple of the stride, and the patch must fit), or None. Patch size and
    stride are the registered variant's unless --model-kwargs sets them; an unknown model is left to the factory."""
    arch = VARIANTS.get(ALIASES.get(model, model))
    if arch is None:
        return None
    arch = {**arch[0], **model_kwargs}
    patch, stride = arch.get("patch_size"), arch.get("stride")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (patch, stride)):
        return None  # not a plain size: the model's constructor says what is wrong
    left = (input_size - patch) % stride
    if input_size >= patch and not left:
        return None
    lower = input_size - left
    nearest = " or ".join(str(n) for n in (lower, lower + stride) if n >= patch)
    where = f"{model}'s patches (patch size {patch}, stride {stride})"
    if input_size < patch:
        return f"--input-size {input_size} is smaller than {where}; the nearest valid size is {nearest}"
    return (f"--input-size {input_size} does not fit {where}: the last {left} pixel rows and columns would be "
            f"dropped; the nearest valid sizes are {nearest}")


def profile_steps(text: str) -> tuple[int, int] | None:
    """--profile-steps "FIRST:LAST" (or "STEP") -> (FIRST, LAST); "" -> None; a ValueError saying what it should be."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        steps = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise ValueError(f"--profile-steps must be FIRST:LAST optimizer steps (e.g. 5:8), got {text!r}") from None
    if not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"--profile-steps must be FIRST:LAST with 1 <= FIRST <= LAST, got {text!r}")
    return steps


def _profile(config: RunConfig) -> str | None:
    try:
        steps = profile_steps(config.run.profile_steps)
    except ValueError as e:
        return str(e)
    if steps and not config.run.output_dir:
        return "--profile-steps writes its profile to OUTPUT_DIR/profile: give --output_dir"
    return None
