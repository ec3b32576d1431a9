"""DeepSpeed JSON configs: load, check, resolve batch sizes and precision, fill ``"auto"`` values.

``prepare_ds_config`` turns a config (``ds_configs/*.json`` or a user's own) plus the command line into the dict
handed to ``deepspeed.initialize(config=...)``. Every mistake it can see is a one-line ``ConfigError`` raised before
any model is built or process group touched: unknown keys (checked against what DeepSpeed 0.19.8 reads, with
DeepSpeed's own pydantic models where it has them), contradicting batch sizes, fp16 on a CPU, ``"auto"`` values
that nothing fills. ``ds_configs/README.md`` documents the rules for users.

DeepSpeed itself would accept some of these and fail later (or silently ignore a misspelt key, which is worse): its
top-level config is a plain dict read with defaults, so ``"gradient_cliping": 1.0`` trains with the default.
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from ..runtime import versions

AUTO = "auto"
PRECISIONS = ("bf16", "fp16", "fp32", "autocast-bf16")
# The dtype of the model's parameters and inputs. "autocast-bf16" keeps fp32 parameters (and fp32 optimizer
# states, no separate master copy) and runs the forward under torch.autocast(bf16): DeepSpeed's torch_autocast
# mode, what Mamba's authors recommend (state-spaces/mamba#6), since A_log, D and dt_proj are sensitive to bf16
# weight updates.
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                    "autocast-bf16": torch.float32}
AUTOCAST_DTYPES = {"autocast-bf16": torch.bfloat16}  # the dtype torch.autocast runs the forward in
# what DeepSpeed 0.19.8 reads
TORCH_AUTOCAST_KEYS = frozenset({"enabled", "dtype", "lower_precision_safe_modules"})
DEFAULT_MICRO_BATCH = 64  # --batch-size when neither it nor the JSON gives one
DEFAULT_ACCUM_STEPS = 1
# what DeepSpeed 0.19.8 clips at when a config has no gradient_clipping (runtime/constants.py): written down, so that
# a run without --clip-grad says it clips there and the --engine ddp/fsdp baselines clip as DeepSpeed does (a given
# --clip-grad takes its place: optim.settle_shared)
DEEPSPEED_DEFAULT_CLIPPING = 1.0
# the optimizer's params the command line sets too (optim.SHARED): one the file leaves out is filled as "auto" is
# (DeepSpeed would pass nothing and the optimizer class would use its own default, which the command line never saw)
COMMAND_LINE_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")

# Every top-level key DeepSpeed 0.19.8 reads: deepspeed/runtime/config.py (DeepSpeedConfig._initialize_params and
# the get_* helpers, with names from runtime/constants.py) and the section parsers it calls (monitor/config.py,
# comm/config.py, profiling, autotuning, data_pipeline, swap_tensor/aio_config.py, model_checkpointing, datastates,
# compile, utils/config.py timers, tensor_parallel, expert_parallel), plus the two keys deepspeed.initialize reads
# itself (sequence_parallel_size, data_parallel_size).
DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    # batch
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    # optimizer, schedule, gradients
    "optimizer", "scheduler", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "communication_data_type", "seq_parallel_communication_data_type",
    "disable_allgather",
    # ZeRO
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    # precision
    "fp16", "bf16", "bfloat16", "torch_autocast", "data_types",
    # logging, monitoring, profiling
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "log_level", "timers",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "autotuning",
    # checkpointing and I/O
    "checkpoint", "aio", "datastates_ckpt", "activation_checkpointing",
    # data
    "dataloader_drop_last", "data_efficiency",
    # parallelism and other engines
    "pipeline", "hybrid_engine", "tensor_parallel", "expert_parallel", "use_data_before_expert_parallelism",
    "sequence_parallel_size", "data_parallel_size", "weight_quantization", "compile",
    # misc
    "disable_python_gc", "vocabulary_size",
})

# Top-level keys earlier DeepSpeed versions accepted and 0.19.8 rejects (runtime/config.py,
# _REMOVED_TOP_LEVEL_CONFIG_KEYS): named separately so the message says "removed", not "misspelt".
DEEPSPEED_REMOVED_TOP_LEVEL_KEYS = frozenset({
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop",
})

OPTIMIZER_SECTION_KEYS = frozenset({"type", "params", "legacy_fusion"})

# Optimizer params DeepSpeed pops before constructing an Adam/AdamW (engine.get_optimizer_configuration and
# _configure_basic_optimizer), so they are valid whatever the implementation.
_DEEPSPEED_ADAM_KEYS = frozenset({"torch_adam", "adam_w_mode", "fp32_optimizer_states"})

# FusedAdam-only params that change nothing when torch.optim.AdamW runs instead: torch always corrects the bias,
# and zero_grad() sets gradients to None by default.
_TORCH_ADAM_EQUIVALENT = {"bias_correction": True, "set_grad_none": None}


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be used; the message is one line naming the file and the key."""


def eval_batch_size(micro_batch: int | None) -> int:
    """The images per rank in one evaluation batch: 1.5 x the training micro batch (DEFAULT_MICRO_BATCH's when
    None), as the published main.py: a forward without gradients or activations kept for backward has room for
    more. The trainer's evaluation, `vim-ds eval` and `vim-ds bench data` all batch by it."""
    return max(1, int(1.5 * (micro_batch or DEFAULT_MICRO_BATCH)))


@dataclass(frozen=True)
class BatchSizes:
    micro: int  # per-rank micro batch (train_micro_batch_size_per_gpu)
    accum: int  # gradient_accumulation_steps
    world: int  # data-parallel ranks

    @property
    def global_(self) -> int:
        """train_batch_size: samples per optimizer step over all ranks."""
        return self.micro * self.accum * self.world


@dataclass
class PreparedConfig:
    config: dict  # fully resolved, no "auto" left; ready for deepspeed.initialize(config=...)
    batch: BatchSizes
    precision: str  # "bf16" | "fp16" | "fp32" | "autocast-bf16"
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    source: str  # file path or "<dict>"
    # the dotted paths whose "auto" was filled from the command line (the others hold what the JSON says)
    filled: frozenset = frozenset()
    # the dotted paths the file leaves out and that hold DeepSpeed's default (gradient_clipping)
    unset: frozenset = frozenset()
    # the precision the file's own sections choose, when --precision chose another ("" when the same or not given)
    overridden_precision: str = ""


# ----------------------------------------------------------------------------------------------------- loading


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def load_ds_config(path: str | os.PathLike) -> dict:
    """Read a DeepSpeed JSON config file (strict JSON; duplicate keys are an error, as in DeepSpeed)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"DeepSpeed config file not found: {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"DeepSpeed config path is not a file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read DeepSpeed config: {_one_line(e)}") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: key {e.args[0]!r} appears twice in one object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object {{...}}, not {_json_type(data)}")
    return data


# ----------------------------------------------------------------------------------------------------- preparing


def prepare_ds_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int,
    device_type: str,
    micro_batch: int | None = None,
    accum_steps: int | None = None,
    precision: str | None = None,
    auto_values: Callable[[BatchSizes], dict[str, Any]] | None = None,
) -> PreparedConfig:
    """Check and resolve a DeepSpeed config for one run.

    source       path of a JSON file, or a dict (deep-copied, never modified)
    world_size   data-parallel ranks
    device_type  the accelerator's device type ("cpu", "cuda", ...)
    micro_batch  --batch-size (per rank), None when not given
    accum_steps  --accum-steps, None when not given
    precision    --precision ("bf16", "fp16", "fp32", "autocast-bf16"), None to let the JSON decide
    auto_values  called with the resolved batch sizes; returns {dotted.path: value} used to fill "auto" values
    """
    if isinstance(source, Mapping):
        config, src = copy.deepcopy(dict(source)), "<dict>"
    elif isinstance(source, (str, os.PathLike)):
        src = os.fspath(source)
        config = load_ds_config(src)
    else:
        raise TypeError(f"source must be a path or a dict, not {type(source).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, not {world_size!r}")
    device_type = str(device_type).lower()

    _check_top_level(config, src)
    unset = _write_down_default_clipping(config)
    zero = _check_zero(config, src)
    zero_section = copy.deepcopy(config.get("zero_optimization"))
    file_precision = _file_precision(config) if precision is not None else None
    resolved_precision = _resolve_precision(config, src, precision, device_type)

    batch = _resolve_batch(config, src, world_size, micro_batch, accum_steps)
    config["train_batch_size"] = batch.global_
    config["train_micro_batch_size_per_gpu"] = batch.micro
    config["gradient_accumulation_steps"] = batch.accum

    filled = frozenset()
    if auto_values is not None:
        values = auto_values(batch)
        _left_out_params_as_auto(config, values)
        filled = _fill_auto(config, values)
    left = list(_auto_paths(config))
    if left:
        raise ConfigError(f"{src}: still \"auto\" with nothing to fill it: {', '.join(left)}; "
                          f"set a value in the JSON")

    # "auto" values in it were filled: check again
    if config.get("zero_optimization") != zero_section:
        zero = _check_zero(config, src)
    _check_zero2_accumulation(int(zero.stage), batch.accum, src)
    offload_optimizer = _offload_device(zero.offload_optimizer) in ("cpu", "nvme")
    offload_param = _offload_device(zero.offload_param) in ("cpu", "nvme")

    _choose_cpu_adam(config, device_type, offload_optimizer)
    _check_optimizer(config, src, offload_optimizer)

    return PreparedConfig(
        config=config,
        batch=batch,
        precision=resolved_precision,
        zero_stage=int(zero.stage),
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        source=src,
        filled=filled,
        unset=unset,
        overridden_precision=file_precision if file_precision not in (None, resolved_precision) else "",
    )


# DeepSpeed releases whose ZeRO-2 computes wrong gradients with gradient accumulation (from, to): 0.17.6 to 0.18.2
# (https://github.com/deepspeedai/DeepSpeed/issues/7718, fixed in 0.18.3)
ZERO2_ACCUMULATION_BROKEN = ((0, 17, 6), (0, 18, 3))


def _check_zero2_accumulation(stage: int, accum: int, src: str) -> None:
    """Refuse ZeRO-2 with more than one micro step a step where the installed DeepSpeed accumulates wrongly.

    Why: on DeepSpeed 0.17.6 one rank with 2 micro steps a step trained away from one micro step of the same 16
    images (losses 1 % apart by step 2, the gradient norm 0.53 where it is 0.78; ZeRO-1 agreed to 1e-5), and a ZeRO-2
    resume onto 1 rank with accumulation 2 ended at other weights (matrix, torch 2.4.1). A fixed bug has no module to
    find it by: the version says it."""
    deepspeed = versions.installed()["deepspeed"]
    release = versions.patch_release(deepspeed) if deepspeed else None
    first, fixed = ZERO2_ACCUMULATION_BROKEN
    if stage == 2 and accum > 1 and release is not None and first <= release < fixed:
        raise ConfigError(f"{src}: ZeRO-2 with gradient accumulation ({accum} micro steps a step) computes wrong "
                          f"gradients in DeepSpeed {deepspeed} (0.17.6 to 0.18.2, DeepSpeed issue 7718); use "
                          f"ZeRO-1 or 3 (ds_configs/zero1.json), --accum-steps 1, or install deepspeed>=0.18.3")


# ----------------------------------------------------------------------------------------------------- 1. keys


def _check_top_level(config: dict, src: str) -> None:
    removed = sorted(k for k in config if k in DEEPSPEED_REMOVED_TOP_LEVEL_KEYS)
    if removed:
        raise ConfigError(f"{src}: {_quoted(removed)} {'was' if len(removed) == 1 else 'were'} removed from "
                          f"DeepSpeed 0.19.8; delete {'it' if len(removed) == 1 else 'them'}")
    unknown = [k for k in config if k not in DEEPSPEED_TOP_LEVEL_KEYS]
    if unknown:
        comment = any(k.startswith("_") or "comment" in k.lower() for k in unknown)
        raise ConfigError(f"{src}: unknown top-level key{'s' if len(unknown) > 1 else ''} "
                          f"{_with_suggestions(unknown, DEEPSPEED_TOP_LEVEL_KEYS)} (not a DeepSpeed 0.19.8 setting"
                          f"{'; JSON has no comments, document the file in a README instead' if comment else ''})")
    for section in ("zero_optimization", "optimizer", "fp16", "bf16", "bfloat16", "scheduler", "torch_autocast"):
        if section in config and not isinstance(config[section], dict):
            hint = ' like {"stage": 2}' if section == "zero_optimization" else ""
            raise ConfigError(f"{src}: {section} must be an object{hint}, not {_json_type(config[section])}")
    if "bfloat16" in config:
        if "bf16" in config:
            raise ConfigError(f"{src}: both bf16 and its old name bfloat16 are set; keep only bf16")
        config["bf16"] = config.pop("bfloat16")
    optimizer = config.get("optimizer")
    if optimizer is not None:
        unknown = [k for k in optimizer if k not in OPTIMIZER_SECTION_KEYS]
        if unknown:
            raise ConfigError(f"{src}: unknown key{'s' if len(unknown) > 1 else ''} in optimizer: "
                              f"{_with_suggestions(unknown, OPTIMIZER_SECTION_KEYS)} (expected type, params)")
        if "params" in optimizer and not isinstance(optimizer["params"], dict):
            raise ConfigError(f"{src}: optimizer.params must be an object, not {_json_type(optimizer['params'])}")


def _write_down_default_clipping(config: dict) -> frozenset:
    """A gradient_clipping the file leaves out is DeepSpeed's default, written down; returns the paths so given."""
    if "gradient_clipping" in config:
        return frozenset()
    config["gradient_clipping"] = DEEPSPEED_DEFAULT_CLIPPING
    return frozenset({"gradient_clipping"})


def _left_out_params_as_auto(config: dict, values: Mapping[str, Any]) -> None:
    """An optimizer param of COMMAND_LINE_OPTIMIZER_PARAMS that the file leaves out is "auto": filled from the
    command line (`values`, when it has one)."""
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict):
        return
    params = optimizer.setdefault("params", {})
    for key in COMMAND_LINE_OPTIMIZER_PARAMS:
        if key not in params and f"optimizer.params.{key}" in values:
            params[key] = AUTO


def _check_zero(config: dict, src: str):
    """Validate zero_optimization with DeepSpeed's own model (it forbids unknown keys); return the model."""
    # DeepSpeed here, not at the top: seconds of start-up for every command that reads ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return _validate_model(DeepSpeedZeroConfig, config.get("zero_optimization", {}), "zero_optimization", src)


def _validate_model(model_cls, data: dict, section: str, src: str):
    # pydantic here, not at the top: start-up; only DeepSpeed's config models need it
    from pydantic import ValidationError

    try:
        return model_cls(**data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join([section] + [str(part) for part in err["loc"]])
            if section == "zero_optimization" and tuple(err["loc"]) == ("stage",):
                problems.append(f"{loc}: must be 0, 1, 2 or 3, not {_show(err.get('input'))}")
            elif err["type"] == "extra_forbidden":
                names = _model_field_names(model_cls, err["loc"][:-1])
                suggestion = _suggest(str(err["loc"][-1]), names)
                problems.append(f"{loc}: unknown key{suggestion}")
            else:
                problems.append(f"{loc}: {err['msg']}" if err["loc"] else f"{section}: {err['msg']}")
        raise ConfigError(f"{src}: {'; '.join(_one_line(p) for p in problems)}") from None
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(f"{src}: {section}: {_one_line(e)}") from None


def _model_field_names(model_cls, loc: tuple) -> set[str]:
    """Field names and aliases of the (nested) pydantic model at loc, for "did you mean" hints."""
    try:
        for part in loc:
            annotation = model_cls.model_fields[part].annotation
            # Optional[Model] -> Model
            args = getattr(annotation, "__args__", None) or (annotation,)
            model_cls = next(a for a in args if hasattr(a, "model_fields"))
        names = set()
        for name, field in model_cls.model_fields.items():
            names.add(name)
            if field.alias:
                names.add(field.alias)
        return names
    except (KeyError, StopIteration, AttributeError):
        return set()


def _offload_device(offload) -> str:
    if offload is None:
        return "none"
    device = getattr(offload, "device", "none")
    return str(getattr(device, "value", device))


# ----------------------------------------------------------------------------------------------------- 2. precision


def _enabled(config: dict, section: str, src: str) -> bool:
    """A section's "enabled": true/false; "auto" or missing counts as false (DeepSpeed ignores "auto" values)."""
    value = config.get(section, {}).get("enabled", False)
    if value == AUTO:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{src}: {section}.enabled must be true or false, not {_show(value)}")
    return value


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype torch.autocast runs the forward in for a resolved precision, None for none."""
    return AUTOCAST_DTYPES.get(precision)


def _check_torch_autocast(config: dict, src: str) -> None:
    """The torch_autocast section: known keys, a bfloat16 dtype (written down when missing: DeepSpeed would pass
    dtype=None to torch.autocast and key its gradient buckets by None), a list of class names."""
    section = config["torch_autocast"]
    unknown = [k for k in section if k not in TORCH_AUTOCAST_KEYS]
    if unknown:
        raise ConfigError(f"{src}: unknown key{'s' if len(unknown) > 1 else ''} in torch_autocast: "
                          f"{_with_suggestions(unknown, TORCH_AUTOCAST_KEYS)} (expected enabled, dtype, "
                          f"lower_precision_safe_modules)")
    if not section.get("enabled"):
        return
    dtype = section.setdefault("dtype", "bfloat16")
    if dtype in ("bf16", "bfloat16", "torch.bfloat16"):
        section["dtype"] = "bfloat16"
    elif dtype in ("fp16", "float16", "half", "torch.float16"):
        raise ConfigError(f"{src}: torch_autocast.dtype {_show(dtype)} is not supported here (fp16 autocast needs "
                          f"a loss scaler and is refused on CPU); use \"bfloat16\" (--precision autocast-bf16)")
    else:
        raise ConfigError(f"{src}: torch_autocast.dtype must be \"bfloat16\", not {_show(dtype)}")
    modules = section.get("lower_precision_safe_modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        raise ConfigError(f"{src}: torch_autocast.lower_precision_safe_modules must be a list of class names "
                          f"like \"torch.nn.Linear\", not {_show(modules)}")
    if config.get("zero_optimization", {}).get("zero_quantized_weights"):
        raise ConfigError(f"{src}: torch_autocast cannot be combined with zero_optimization.zero_quantized_weights "
                          f"(DeepSpeed refuses it); disable one of them")


def _file_precision(config: dict) -> str | None:
    """The precision the file's own sections choose (None when they contradict: --precision settles it)."""
    on = [section for section in ("bf16", "fp16", "torch_autocast")
          if isinstance(config.get(section), dict) and config[section].get("enabled") is True]
    if len(on) > 1:
        return None
    return {"bf16": "bf16", "fp16": "fp16", "torch_autocast": "autocast-bf16"}[on[0]] if on else "fp32"


def deepspeed_has(module: str) -> bool:
    """Whether the installed DeepSpeed has `module` (a feature found by its module, not by a version number)."""
    return importlib.util.find_spec(module) is not None


def _precision_models() -> dict:
    """DeepSpeed's schemas of the bf16 and fp16 sections, by section name: none before DeepSpeed 0.17, which reads
    those sections key by key (an unknown key there is ignored by it, and not caught here either)."""
    if not deepspeed_has("deepspeed.runtime.precision_config"):
        return {}
    # DeepSpeed here, not at the top: start-up, and only a DeepSpeed that has the module
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    return {"bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}


def _resolve_precision(config: dict, src: str, precision: str | None, device_type: str) -> str:
    chosen_by = "--precision autocast-bf16" if precision is not None else f"{src} (torch_autocast.enabled)"
    if precision is not None:
        if precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        for section, wanted in (("bf16", precision == "bf16"), ("fp16", precision == "fp16"),
                                ("torch_autocast", precision == "autocast-bf16")):
            if wanted:
                config.setdefault(section, {})["enabled"] = True
                if section == "torch_autocast":
                    config[section]["dtype"] = "bfloat16"
            elif section in config:
                config[section]["enabled"] = False
        where = f"--precision {precision}"
    else:
        bf16, fp16 = _enabled(config, "bf16", src), _enabled(config, "fp16", src)
        autocast = _enabled(config, "torch_autocast", src)
        if bf16 and fp16:
            raise ConfigError(f"{src}: fp16.enabled and bf16.enabled are both true; enable one of them "
                              f"(or choose with --precision {'|'.join(PRECISIONS)})")
        if autocast and (bf16 or fp16):
            half = "bf16" if bf16 else "fp16"
            raise ConfigError(f"{src}: torch_autocast.enabled and {half}.enabled are both true (autocast keeps fp32 "
                              f"parameters, {half} mode converts them); enable one of them (or choose with "
                              f"--precision {'|'.join(PRECISIONS)})")
        # Write the decision down: "auto" (meaning off, see _enabled) must not be left for the final check.
        for section, on in (("bf16", bf16), ("fp16", fp16), ("torch_autocast", autocast)):
            if section in config:
                config[section]["enabled"] = on
        precision = "bf16" if bf16 else "fp16" if fp16 else "autocast-bf16" if autocast else "fp32"
        where = f"{src} (fp16.enabled)"

    if precision == "fp16" and device_type == "cpu":
        raise ConfigError(f"{where}: fp16 is not supported by DeepSpeed on CPU; use --precision bf16, "
                          f"autocast-bf16 or fp32 (e.g. ds_configs/zero2.json)")
    if precision == "autocast-bf16" and not deepspeed_has("deepspeed.runtime.torch_autocast"):
        # an older DeepSpeed ignores the section: the run would train in fp32 without a word
        # DeepSpeed here, not at the top (start-up)
        import deepspeed

        raise ConfigError(f"{chosen_by}: autocast-bf16 needs DeepSpeed's torch_autocast section (DeepSpeed >= 0.17), "
                          f"and this is DeepSpeed {deepspeed.__version__}; use --precision bf16 or fp32")
    if "torch_autocast" in config:
        _check_torch_autocast(config, src)
    for section, model in _precision_models().items():
        if section in config:
            _validate_model(model, config[section], section, src)
    return precision


# ----------------------------------------------------------------------------------------------------- 3. batch sizes

_BATCH_KEYS = {
    "micro": ("train_micro_batch_size_per_gpu", "--batch-size"),
    "accum": ("gradient_accumulation_steps", "--accum-steps"),
}


def _json_count(config: dict, key: str, src: str) -> int | None:
    """A batch-size entry of the JSON: a positive integer, or None for "auto"/missing."""
    value = config.get(key, AUTO)
    if value == AUTO or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{src}: {key} must be a positive integer or \"auto\", not {_show(value)}")
    return value


def _resolve_batch(config: dict, src: str, world: int, micro_cli: int | None, accum_cli: int | None) -> BatchSizes:
    values, origin = {}, {}
    for name, cli in (("micro", micro_cli), ("accum", accum_cli)):
        key, flag = _BATCH_KEYS[name]
        if cli is not None and (isinstance(cli, bool) or not isinstance(cli, int) or cli < 1):
            raise ConfigError(f"{flag} must be a positive integer, not {cli!r}")
        in_json = _json_count(config, key, src)
        if in_json is not None and cli is not None and in_json != cli:
            raise ConfigError(f"{src} sets {key}={in_json} but {flag} is {cli}; "
                              f"set it to \"auto\" or drop {flag}")
        values[name] = in_json if in_json is not None else cli
        origin[name] = key if in_json is not None else flag if cli is not None else "default"
    total = _json_count(config, "train_batch_size", src)
    micro, accum = values["micro"], values["accum"]

    if total is None:
        micro = micro or DEFAULT_MICRO_BATCH
        accum = accum or DEFAULT_ACCUM_STEPS
        return BatchSizes(micro, accum, world)

    if micro is not None and accum is not None:
        if micro * accum * world != total:
            others = " or ".join(origin[name] for name in ("micro", "accum"))
            raise ConfigError(
                f"{src}: train_batch_size={total} but micro batch {micro} ({origin['micro']}) "
                f"x accumulation {accum} ({origin['accum']}) x {world} ranks = {micro * accum * world}; "
                f"set train_batch_size to \"auto\" (or {micro * accum * world}), or change {others}")
        return BatchSizes(micro, accum, world)

    if micro is None and accum is None:
        accum = DEFAULT_ACCUM_STEPS  # like DeepSpeed: a global batch alone means no accumulation
    if micro is None:
        per_step = accum * world
        if total % per_step:
            raise ConfigError(
                f"{src}: train_batch_size={total} is not divisible by accumulation {accum} x {world} ranks = "
                f"{per_step}; set train_batch_size to a multiple of {per_step}, or to \"auto\" with --batch-size")
        return BatchSizes(total // per_step, accum, world)
    per_step = micro * world
    if total % per_step:
        raise ConfigError(
            f"{src}: train_batch_size={total} is not divisible by micro batch {micro} "
            f"({origin['micro']}) x {world} ranks = {per_step}; set train_batch_size to a "
            f"multiple of {per_step}, or to \"auto\"")
    return BatchSizes(micro, total // per_step, world)


# ----------------------------------------------------------------------------------------------------- 4. "auto"


def _fill_auto(config: dict, values: Mapping[str, Any]) -> frozenset:
    """Replace "auto" at each dotted path with its value; explicit numbers in the JSON are kept. Returns the paths
    filled."""
    filled = set()
    for path, value in values.items():
        node: Any = config
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == AUTO:
            node[leaf] = copy.deepcopy(value)
            filled.add(path)
    return frozenset(filled)


def _auto_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _auto_paths(value, f"{prefix}[{i}]")
    elif node == AUTO:
        yield prefix


# ----------------------------------------------------------------------------------------------------- 5. optimizer


def _adam_kind(optimizer: dict) -> str | None:
    """'adamw' or 'adam' (DeepSpeed's effective mode) for Adam-family optimizers, else None."""
    name = str(optimizer.get("type", "")).lower()
    if name not in ("adam", "adamw"):
        return None
    adam_w_mode = optimizer.get("params", {}).get("adam_w_mode", True)
    return "adamw" if name == "adamw" or adam_w_mode else "adam"


def _choose_cpu_adam(config: dict, device_type: str, offload_optimizer: bool) -> None:
    """On CPU without offload, let DeepSpeed run torch.optim.AdamW instead of JIT-building FusedAdam.

    DeepSpeed's "AdamW" on the CPU accelerator is FusedAdam backed by a C++ op (fused_adam) that is compiled
    with ninja the first time it is used (~60 s on 2 cores); torch's AdamW does the same update with no build.
    With offload DeepSpeed uses DeepSpeedCPUAdam (which is the point of offloading), and on GPUs its fused
    kernel is the fast path, so both are left alone. A user's explicit "torch_adam" always wins, and params
    that torch's AdamW would not accept keep FusedAdam.
    """
    optimizer = config.get("optimizer")
    if device_type != "cpu" or offload_optimizer or not optimizer or _adam_kind(optimizer) is None:
        return
    params = optimizer.setdefault("params", {})
    if "torch_adam" in params:
        return
    # DeepSpeed here, not at the top (start-up)
    from deepspeed.ops.adam import FusedAdam

    torch_keys = _signature_keys(_torch_adam_class(_adam_kind(optimizer)))
    fused_only = {k: v for k, v in params.items()
                  if k in _signature_keys(FusedAdam) and k not in torch_keys and k not in _DEEPSPEED_ADAM_KEYS}
    for key, value in fused_only.items():
        if key not in _TORCH_ADAM_EQUIVALENT or _TORCH_ADAM_EQUIVALENT[key] not in (None, value):
            return  # a FusedAdam setting torch cannot reproduce (e.g. bias_correction: false)
    for key in fused_only:
        del params[key]
    params["torch_adam"] = True


def _torch_adam_class(kind: str):
    return torch.optim.AdamW if kind == "adamw" else torch.optim.Adam


def _check_optimizer(config: dict, src: str, offload_optimizer: bool) -> None:
    """An Adam-family optimizer (the recipe, the --engine ddp/fsdp baselines and the exact-resume state reader are
    built on Adam's moments) with numbers where numbers go, and params the class DeepSpeed constructs accepts."""
    optimizer = config.get("optimizer")
    if not optimizer:
        return
    kind = _adam_kind(optimizer)
    if kind is None:
        given = f"{_show(optimizer['type'])} is not supported" if "type" in optimizer else "is missing"
        raise ConfigError(f"{src}: optimizer.type {given}; use \"AdamW\" (or \"Adam\"): vim_ds's recipe, its "
                          f"ddp/fsdp baselines and its resume checks are built on Adam's moments")
    params = optimizer.get("params", {})
    for key in ("lr", "weight_decay", "eps", "betas"):
        if key not in params:
            continue
        value = params[key]
        if key == "betas":
            ok, what = isinstance(value, list) and len(value) == 2 and all(map(_is_number, value)), \
                "a list of two numbers like [0.9, 0.999]"
        else:
            ok, what = _is_number(value), "a number"
        if not ok:
            raise ConfigError(f"{src}: optimizer.params.{key} must be {what} or \"auto\", not {_show(value)}")
    if "max_grad_norm" in params:
        raise ConfigError(f"{src}: optimizer.params.max_grad_norm is not supported by DeepSpeed; "
                          f"use the top-level gradient_clipping instead")
    if params.get("torch_adam"):
        cls, passed_by_deepspeed = _torch_adam_class(kind), set()
    elif offload_optimizer:
        # DeepSpeed here, not at the top (start-up)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cls, passed_by_deepspeed = DeepSpeedCPUAdam, {"adamw_mode", "fp32_optimizer_states"}
    else:
        from deepspeed.ops.adam import FusedAdam

        cls, passed_by_deepspeed = FusedAdam, {"adam_w_mode"}
    accepted = (_signature_keys(cls) - passed_by_deepspeed) | _DEEPSPEED_ADAM_KEYS
    unknown = [k for k in params if k not in accepted]
    if unknown:
        raise ConfigError(f"{src}: optimizer.params {_with_suggestions(unknown, accepted)} not accepted by "
                          f"{cls.__name__} (accepted: {', '.join(sorted(accepted))})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _signature_keys(cls) -> set[str]:
    parameters = inspect.signature(cls.__init__).parameters
    return {name for name in parameters if name not in ("self", "params", "model_params")}


# ----------------------------------------------------------------------------------------------------- helpers


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _show(value: Any) -> str:
    """A value as it would be written in the JSON file."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _quoted(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys)


def _suggest(key: str, names) -> str:
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _with_suggestions(keys: list[str], names) -> str:
    return ", ".join(f"{k!r}{_suggest(k, names)}" for k in keys)
