"""What a training run is, typed: one frozen dataclass per group of `vim-ds train`'s options (model; optimisation;
augmentation and regularisation; data; run; DeepSpeed), composed by `RunConfig`. Each field is one option: its
name is the option's dest, its default the parser's, and its metadata (`Option`) what the command line needs (the
flags as typed, help, type, choices, nargs, metavar, a store_true flag and its `--no-X` partner) and what a value
must be (`rule`, one of RULES, with a hint for the error; `Option.coerce`, for a value a file gives). The command
line's parser is generated from these fields (run_options.build_parser), and option files
(config/options_file.py) read the option definitions from them.

A RunConfig is built from its sources in order: the fields' defaults, a recipe or config file, what was typed
(run_options.parse_config), or in code (`RunConfig(model=ModelOptions(...), ...)`, `RunConfig.from_dict`). It is
resolved as it is made (`RunConfig.__post_init__`): an option whose default depends on others and that was not
given (None) takes its value (`derived`: --model-ema from the engine, --data-timeout from --dist-timeout), DeepSpeed's
deprecated --deepscale_config names the DeepSpeed config, and what was given is recorded (`lr_defaults`, `given`).
So `RunConfig()` is a run (the command line's defaults), and config/run_rules.validate says which rule between
options a config breaks. No argparse here: the command line (cli/run_options.py) is the one module that parses
argv.
"""
from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ..runtime.distributed import DATA_TIMEOUT, default_data_timeout
from .ds_config import DEFAULT_MICRO_BATCH
from .shipped_configs import DEFAULT as DEFAULT_DEEPSPEED_CONFIG
from .training_engines import DEFAULT as DEFAULT_ENGINE
from .training_engines import ENGINES


def key_value(text: str):
    """A `K=V` entry of --model-kwargs: (K, the Python literal V, or V as a string); a ValueError saying what a
    malformed one should be (run_options.key_value, every command's argparse type, reports it under the command's
    name)."""
    if "=" not in text:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass  # a bare string such as a name
    return key, value


# What a DeepSpeed config and the command line can both set (besides the batch sizes, ds_config._resolve_batch, and
# the precision, which --precision overrides with a note): the JSON's dotted path -> the option (dest)
DEEPSPEED_SETS_TOO = {"optimizer.params.lr": "lr", "optimizer.params.weight_decay": "weight_decay",
                      "optimizer.params.betas": "opt_betas", "optimizer.params.eps": "opt_eps",
                      "gradient_clipping": "clip_grad"}

# What a numeric option's value must be, as the error says it, and the test of it.
RULES = {"> 0": lambda v: v > 0, "0 or more": lambda v: v >= 0, "at least 1": lambda v: v >= 1,
         "between 0 and 1": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1,
         "in (0, 1]": lambda v: 0 < v <= 1}
ACTIONS = ("store", "store_true")
# the help of an option that --help does not list: the value of argparse's SUPPRESS, for which run_options gives
# argparse that very object (tests/test_run_config.py holds the parser's help against the fields')
HIDDEN = "==SUPPRESS=="


@dataclass(frozen=True)
class Option:
    """One option of `vim-ds train`, as a field's metadata. `dest` and `default` are the field's name and default
    (filled in OPTIONS); the rest is what argparse is given, plus the range rule of a numeric option: a value
    outside it (None, the option not given, aside) is refused in one line, `--lr must be > 0, got 0 (hint)`."""
    flags: tuple[str, ...]
    help: str | None = None
    type: Callable | None = None
    choices: tuple | None = None
    nargs: int | str | None = None
    metavar: str | None = None
    action: str = "store"
    negative: str = ""  # the flag that stores False into the same dest: --no-model-ema
    rule: str = ""
    hint: str = ""
    dest: str = ""
    default: Any = None

    def __post_init__(self):
        assert self.action in ACTIONS and (not self.rule or self.rule in RULES), self
        assert not self.negative or self.action == "store_true", self

    @property
    def flag(self) -> str:
        """The option as one types it: `--lr`, `--num_workers`, `--drop-path`."""
        return self.flags[0]

    def coerce(self, value):
        """`value` as a file gives it (YAML's bool, int, float, str, list, mapping) made this option's value by its
        type, count and choices, or a ValueError saying in a few words why it is none. argparse reads typed text by
        the same `type` and `choices`; a file's values are typed already, so what text cannot say is refused here:
        a bool for a number, 1.5 for a whole number, a list for one value."""
        if value is None:
            return None
        if self.action == "store_true":  # a flag, or a flag pair such as --model-ema/--no-model-ema
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        nargs = self.nargs
        if nargs in ("*", "+") or isinstance(nargs, int):
            if self.type is key_value and isinstance(value, dict):
                return {str(k): v for k, v in value.items()}
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if isinstance(nargs, int) and len(items) != nargs:
                raise ValueError(f"expected {nargs} values, got {len(items)}")
            return [self._coerce_one(item) for item in items]
        return self._coerce_one(value)

    def _coerce_one(self, value):
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected one value, got {value!r}")
        try:
            if self.type in (int, float):
                if isinstance(value, bool) or (self.type is int and isinstance(value, float)):
                    raise ValueError(f"expected {'a whole number' if self.type is int else 'a number'}")
                value = self.type(value)
            elif self.type is not None:
                value = self.type(str(value))
            else:
                value = str(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{value!r} is not a valid value ({exc})") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, self.choices))}")
        return value


def option(*flags: str, default=None, factory: Callable | None = None, **meta):
    """A field of a group: the option `flags` with its default (or a factory of a mutable one) and metadata."""
    if factory is not None:
        return field(default_factory=factory, metadata={"option": Option(flags, **meta)})
    return field(default=default, metadata={"option": Option(flags, **meta)})


# --model-kwargs, declared once for every command: `vim-ds train` and `eval` take it as a field of ModelOptions,
# the others through run_options.add_model_kwargs.
MODEL_KWARGS = Option(("--model-kwargs",), nargs="*", type=key_value, metavar="K=V",
                      help="extra model constructor arguments, e.g. depth=4 embed_dim=64 patch_size=4")


@dataclass(frozen=True)
class ModelOptions:
    TITLE: ClassVar[str] = "model"
    DESCRIPTION: ClassVar[str | None] = None

    model: str = option("--model", default="vim_tiny",
                        help="a registered Vim name or alias (vim_tiny, vim_small_s8, ...)")
    input_size: int = option("--input-size", type=int, default=224)
    model_kwargs: dict = field(default_factory=list, metadata={"option": MODEL_KWARGS})
    drop: float = option("--drop", type=float, default=0.0, help="dropout rate")
    drop_path: float = option("--drop-path", type=float, default=0.1, help="stochastic depth rate")
    grad_checkpointing: bool = option(
        "--grad-checkpointing", action="store_true", default=False,
        help="recompute each block's activations in backward instead of keeping them (less memory, about one more "
             "forward of compute; same gradients)")
    model_ema: bool | None = option("--model-ema", action="store_true", default=None, negative="--no-model-ema",
                                    help="keep an EMA of the weights [on; not with --engine ddp/fsdp]")
    model_ema_decay: float = option("--model-ema-decay", type=float, default=0.99996, rule="in (0, 1]")
    finetune: str = option("--finetune", default="", help="start from a published or converted checkpoint file")
    init_weights: str = option(
        "--init-weights", default="", metavar="FILE",
        help="start from exactly these weights (a state dict as `vim-ds convert` or --save-init-weights write it; "
             "same model, strict), whatever this machine's RNG does with --seed")
    save_init_weights: str = option(
        "--save-init-weights", default="", metavar="FILE",
        help="write this run's initial weights to FILE (.pth or .safetensors), then train: other clusters start "
             "from them with --init-weights FILE")
    compile: bool = option(
        "--compile", action="store_true", default=False,
        help="torch.compile the model through DeepSpeed's engine.compile() (first steps are slower)")
    compile_backend: str = option(
        "--compile-backend", default="inductor", metavar="NAME",
        help="torch.compile backend for --compile (inductor; aot_eager compiles fast, runs eager kernels)")


@dataclass(frozen=True)
class OptimOptions:
    TITLE: ClassVar[str] = "optimisation (AdamW, cosine schedule with warmup, per optimizer step)"
    DESCRIPTION: ClassVar[str | None] = None

    batch_size: int | None = option("--batch-size", type=int, default=None, rule="at least 1",
                                    help=f"per-rank micro batch [{DEFAULT_MICRO_BATCH}, or the JSON's]")
    accum_steps: int | None = option("--accum-steps", type=int, default=None, rule="at least 1",
                                     help="gradient accumulation steps [1, or the JSON's]")
    epochs: int = option("--epochs", type=int, default=300, rule="at least 1")
    max_steps: int | None = option("--max-steps", type=int, default=None, rule="at least 1",
                                   hint="omit --max-steps for no limit",
                                   help="stop after this many optimizer steps")
    lr: float = option("--lr", type=float, default=5e-4, rule="> 0",
                       help="learning rate for a global batch of 512 (scaled)")
    unscale_lr: bool = option("--unscale-lr", action="store_true", default=False,
                              help="use --lr as it is, without batch scaling")
    min_lr: float = option("--min-lr", type=float, default=1e-5, rule="0 or more")
    warmup_lr: float = option("--warmup-lr", type=float, default=1e-6, rule="0 or more")
    warmup_epochs: float = option("--warmup-epochs", type=float, default=5, rule="0 or more")
    weight_decay: float = option("--weight-decay", type=float, default=0.05, rule="0 or more")
    clip_grad: float | None = option("--clip-grad", type=float, default=None, rule="0 or more",
                                     hint="0 or omitted: no clipping", help="gradient norm clipping (off by default)")
    opt_eps: float = option("--opt-eps", type=float, default=1e-8, rule="0 or more")
    opt_betas: tuple[float, float] = option("--opt-betas", type=float, nargs=2, default=(0.9, 0.999),
                                            rule="in [0, 1)")
    precision: str | None = option(
        "--precision", choices=("bf16", "fp16", "fp32", "autocast-bf16"), default=None,
        help="overrides the precision sections of the DeepSpeed config; autocast-bf16: fp32 parameters, forward "
             "under torch.autocast(bf16) (DeepSpeed's torch_autocast section)")
    # not an option: which of --min-lr and --warmup-lr hold the built-in default, not given (`given_options`): a
    # default above a small batch's scaled lr is lowered with a note, a given value refused
    # (engine/optim.check_lr_settings); None until the RunConfig resolves it
    lr_defaults: tuple[str, ...] | None = None
    # not an option: which of the values a DeepSpeed config can set too (DEEPSPEED_SETS_TOO) were given
    # (`given_options`): a number in the JSON must agree with these, and wins over the others
    # (engine/optim.settle_shared); None until the RunConfig resolves it
    given: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AugmentOptions:
    TITLE: ClassVar[str] = "augmentation and regularisation (timm)"
    DESCRIPTION: ClassVar[str | None] = None

    color_jitter: float = option("--color-jitter", type=float, default=0.3, rule="0 or more")
    aa: str = option("--aa", default="rand-m9-mstd0.5-inc1", help="timm auto-augment policy, or 'none'")
    train_interpolation: str = option("--train-interpolation", default="bicubic")
    scale: tuple[float, float] = option("--scale", type=float, nargs=2, default=(0.08, 1.0),
                                        help="random-resized-crop area range")
    ratio: tuple[float, float] = option("--ratio", type=float, nargs=2, default=(3 / 4, 4 / 3),
                                        help="random-resized-crop aspect range")
    hflip: float = option("--hflip", type=float, default=0.5, rule="between 0 and 1",
                          help="horizontal flip probability")
    reprob: float = option("--reprob", type=float, default=0.25, rule="between 0 and 1",
                           help="random erasing probability")
    remode: str = option("--remode", default="pixel")
    recount: int = option("--recount", type=int, default=1)
    smoothing: float = option("--smoothing", type=float, default=0.1, rule="in [0, 1)", help="label smoothing")
    mixup: float = option("--mixup", type=float, default=0.8, rule="0 or more")
    cutmix: float = option("--cutmix", type=float, default=1.0, rule="0 or more")
    cutmix_minmax: tuple[float, float] | None = option("--cutmix-minmax", type=float, nargs=2, default=None)
    mixup_prob: float = option("--mixup-prob", type=float, default=1.0, rule="between 0 and 1")
    mixup_switch_prob: float = option("--mixup-switch-prob", type=float, default=0.5, rule="between 0 and 1")
    mixup_mode: str = option("--mixup-mode", default="batch", choices=("batch", "pair", "elem"))
    repeated_aug: bool = option("--repeated-aug", action="store_true", default=True, negative="--no-repeated-aug")


@dataclass(frozen=True)
class DataOptions:
    TITLE: ClassVar[str] = "data"
    DESCRIPTION: ClassVar[str | None] = None

    data_path: str = option("--data-path", default="",
                            help="ImageNet-style root with train/ and val/ class folders")
    data_set: str = option(
        "--data-set", default="IMNET", choices=("IMNET", "folder", "shards", "synthetic"),
        help="IMNET/folder: --data-path holds train/<class>/* and val/<class>/*; shards: --data-path was written "
             "by `vim-ds data shard`; synthetic: generated noise")
    nb_classes: int = option("--nb-classes", type=int, default=1000, rule="at least 1",
                             help="classes of --data-set synthetic")
    synthetic_size: int = option("--synthetic-size", type=int, default=12800, rule="at least 1",
                                 help="training images of --data-set synthetic")
    eval_crop_ratio: float = option("--eval-crop-ratio", type=float, default=0.875, rule="in (0, 1]")
    num_workers: int | None = option(
        "--num_workers", "--num-workers", type=int, default=None, rule="0 or more",
        help="data-loader worker processes per rank [10, capped to this machine's cores divided by the ranks on the "
             "node, at least 1]; 0 reads data in the training process (no --data-timeout)")
    data_timeout: float | None = option(
        "--data-timeout", type=float, default=None, metavar="SECONDS",
        help=f"a rank whose data loader delivers no batch for this long stops the job with a one-line error naming "
             f"the loader (train/val) [{DATA_TIMEOUT:g}, at most half --dist-timeout; 0: wait forever]")
    max_bad_images: float = option(
        "--max-bad-images", type=float, default=0.01, metavar="FRACTION", rule="between 0 and 1",
        help="stop when more than this fraction of the images read so far did not decode (each one is skipped and "
             "logged with its path)")
    pin_mem: bool = option("--pin-mem", action="store_true", default=True, negative="--no-pin-mem")


@dataclass(frozen=True)
class RunOptions:
    TITLE: ClassVar[str] = "run"
    DESCRIPTION: ClassVar[str | None] = None

    config: str = option(
        "--config", default="", metavar="NAME|FILE",
        help="take the options from a YAML file: a shipped recipe of a published Vim run (`vim-ds configs` lists "
             "them, e.g. vim_small_pretrain) or a run's OUTPUT_DIR/options.yaml; options given on the command line "
             "win over the file's")
    output_dir: str = option("--output_dir", "--output-dir", default="",
                             help="checkpoints, metrics.jsonl, tensorboard/ (nothing is saved without it)")
    resume: str = option("--resume", default="",
                         help="checkpoint directory, 'auto' (latest in --output_dir), or a .pth with --eval")
    eval: bool = option("--eval", action="store_true", default=False,
                        help="only evaluate (--resume or --finetune gives the weights)")
    seed: int = option("--seed", type=int, default=0)
    save_interval: int = option("--save-interval", type=int, default=0, rule="0 or more",
                                hint="0: none between epoch ends", help="also checkpoint every N optimizer steps")
    keep_checkpoints: int = option("--keep-checkpoints", type=int, default=2, rule="0 or more", hint="0 keeps all",
                                   help="complete checkpoints kept (0 = all)")
    max_bad_steps: int = option(
        "--max-bad-steps", type=int, default=1, metavar="N", rule="at least 1",
        help="bf16/fp32: stop after N consecutive steps whose loss is NaN/inf (the step is not applied; fp16's loss "
             "scaler skips overflowing steps by itself)")
    dist_timeout: float = option(
        "--dist-timeout", type=float, default=600, metavar="SECONDS",
        help="process-group timeout: a collective waiting longer than this for a dead or stuck rank fails the job "
             "instead of hanging it")
    log_interval: int = option("--log-interval", type=int, default=10,
                               help="steps between log lines (without a terminal)")
    profile_steps: str = option(
        "--profile-steps", default="", metavar="FIRST:LAST",
        help="profile optimizer steps FIRST to LAST with torch.profiler: rank 0 writes a Chrome trace and the top "
             "kernels by device time to OUTPUT_DIR/profile/ (`vim-ds bench profile` puts them beside their "
             "rooflines)")
    tensorboard: bool = option("--tensorboard", action="store_true", default=False,
                               help="write TensorBoard scalars to OUTPUT_DIR/tensorboard")
    engine: str = option(
        "--engine", choices=tuple(ENGINES), default=DEFAULT_ENGINE,
        help="ddp / fsdp: PyTorch DistributedDataParallel / FSDP2 fully_shard (per block + root, full sharding) "
             "instead of DeepSpeed, with the same model, AdamW groups, lr schedule, data and metrics (the "
             "--deepspeed_config still gives batch, optimizer settings and precision; bf16 and autocast-bf16 run "
             "fp32 parameters under bf16 autocast): the baselines of `vim-ds zero-compare`. They save no "
             "checkpoints and keep no EMA: --resume, --save-interval and --model-ema are refused")
    sequence_parallel: int = option(
        "--sequence-parallel", type=int, default=1, metavar="N", rule="at least 1",
        help="split each image's token sequence over groups of N consecutive ranks (high resolution: activations "
             "per rank fall with N); data parallelism runs across the groups, ZeRO over all ranks; the number of "
             "ranks must be a multiple of N (docs/sequence-parallel.md)")
    local_rank: int = option("--local_rank", "--local-rank", type=int, default=-1,
                             help="set by the deepspeed launcher")


@dataclass(frozen=True)
class DeepSpeedOptions:
    """The options `deepspeed.add_config_arguments` adds, with the same names, defaults and types
    (tests/test_configs.py holds them against DeepSpeed's)."""
    TITLE: ClassVar[str] = "DeepSpeed"
    DESCRIPTION: ClassVar[str | None] = "DeepSpeed configurations"

    deepspeed: bool = option("--deepspeed", action="store_true", default=False,
                             help="accepted for DeepSpeed's launchers and scripts; vim_ds always runs DeepSpeed")
    deepspeed_config: str | None = option(
        "--deepspeed_config", type=str, default=None, metavar="NAME|FILE",
        help=f"a DeepSpeed JSON config file, or the name of one shipped with vim_ds (`vim-ds configs` lists them) "
             f"[{DEFAULT_DEEPSPEED_CONFIG}, said at the start of the run]")
    deepscale: bool = option("--deepscale", action="store_true", default=False, help=HIDDEN)
    deepscale_config: str | None = option("--deepscale_config", type=str, default=None, help=HIDDEN)


@dataclass(frozen=True)
class RunConfig:
    """A run's options, by group, in the order of `vim-ds train --help`; resolved as it is made (see the module's
    docstring), so that every RunConfig is a run's effective options."""
    model: ModelOptions = field(default_factory=ModelOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    augment: AugmentOptions = field(default_factory=AugmentOptions)
    data: DataOptions = field(default_factory=DataOptions)
    run: RunOptions = field(default_factory=RunOptions)
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)
    # the options given whatever their value, by dest: those typed on the command line (run_options records them as
    # it parses argv). A value other than the default counts as given anyway (from a file, or set in code); read
    # when the config is made (`given_options`), not part of what the config is
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "explicit", frozenset(self.explicit))
        for name, group in _regrouped(self, resolution(self)).items():
            object.__setattr__(self, name, group)

    @classmethod
    def from_dict(cls, values: dict, explicit=frozenset()) -> RunConfig:
        """The config of `values` (dest -> value; an option it leaves out keeps its default), resolved: the sources
        merged in order (`{**from_file, **typed}`), or what a checkpoint or `to_dict` recorded. A key that is no
        field is a TypeError."""
        unknown = sorted(set(values) - {f.name for group in GROUPS for f in dataclasses.fields(group)})
        if unknown:
            raise TypeError(f"not fields of a RunConfig: {unknown}")
        groups = {part.name: part.default_factory(**{f.name: values[f.name] for f in dataclasses.fields(
            part.default_factory) if f.name in values}) for part in _parts()}
        return cls(**groups, explicit=frozenset(explicit))

    def to_dict(self) -> dict:
        """dest -> value of every field, in --help order (what a checkpoint records as its `args`)."""
        return {f.name: getattr(group, f.name) for group in self.groups() for f in dataclasses.fields(group)}

    def groups(self) -> tuple:
        return tuple(getattr(self, part.name) for part in _parts())

    def replace(self, **changes) -> RunConfig:
        """A copy with the fields `changes` names (by dest, in whichever group holds it) set to new values: what a
        check resolves (the DeepSpeed config's file, an lr default lowered to the peak) without changing `self`."""
        return dataclasses.replace(self, **_regrouped(self, changes))


def _parts() -> list[dataclasses.Field]:
    """RunConfig's fields that are groups of options."""
    return [part for part in dataclasses.fields(RunConfig) if part.name != "explicit"]


def _regrouped(config: RunConfig, changes: dict) -> dict:
    """name -> `config`'s group with the fields `changes` names set, for each group that holds one of them."""
    changes, groups = dict(changes), {}
    for part in _parts():
        group = getattr(config, part.name)
        mine = {f.name: changes.pop(f.name) for f in dataclasses.fields(group) if f.name in changes}
        if mine:
            groups[part.name] = dataclasses.replace(group, **mine)
    if changes:
        raise TypeError(f"not fields of a RunConfig: {sorted(changes)}")
    return groups


def derived(config: RunConfig) -> dict:
    """The options whose default is derived from other options, each with the value `config`'s others give it:
    --model-ema is on where the engine keeps an EMA, --data-timeout at most half --dist-timeout. Such an option
    not given (None) takes this value when the config is made; a run's options.yaml records it as null when it
    holds it (options_file.record), so that a run started from the record with another --engine or --dist-timeout
    derives it again."""
    engine = ENGINES.get(config.run.engine) if isinstance(config.run.engine, str) else None
    dist_timeout = config.run.dist_timeout
    numeric = isinstance(dist_timeout, (int, float)) and not isinstance(dist_timeout, bool)
    # an unknown engine (run_rules.validate names it) or a timeout that is no number derives nothing
    return {"model_ema": None if engine is None else engine.keeps_ema,
            "data_timeout": default_data_timeout(dist_timeout) if numeric else None}


def given_options(config: RunConfig) -> set[str]:
    """The options given: named in `config.explicit` (typed, whatever the value), or holding another value than
    their default (from a --config file or set in code: a run's options.yaml records every option, so a value
    equal to the default counts as the default)."""
    values = config.to_dict()
    return {dest for dest, option in OPTIONS.items()
            if dest in config.explicit or _typed(option, values[dest]) != _typed(option, option.default)}


def resolution(config: RunConfig) -> dict:
    """dest -> value for each field of `config` that its sources left to resolve: values as the config holds them
    (lists of values as tuples, --model-kwargs as a dict); a derived option not given, its derived value
    (`derived`); --deepscale_config, DeepSpeed's deprecated spelling, as the DeepSpeed config when
    --deepspeed_config is not given (config/run_rules.validate refuses two that disagree); which of --min-lr and
    --warmup-lr hold the default, and which of DEEPSPEED_SETS_TOO were given (`given_options`). {} for a resolved
    config: a copy (`replace`) resolves only what the change left to resolve."""
    values = config.to_dict()
    changes = {dest: typed for dest, option in OPTIONS.items()
               if (typed := _typed(option, values[dest])) is not values[dest]}
    changes.update({dest: tuple(values[dest]) for dest in ("lr_defaults", "given")
                    if isinstance(values[dest], list)})
    changes.update({dest: value for dest, value in derived(config).items() if values[dest] is None})
    alias = config.deepspeed.deepscale_config
    if alias and not config.deepspeed.deepspeed_config:
        changes["deepspeed_config"] = alias
    if config.optim.lr_defaults is None or config.optim.given is None:
        given = given_options(config)
        if config.optim.lr_defaults is None:
            changes["lr_defaults"] = tuple(dest for dest in ("min_lr", "warmup_lr") if dest not in given)
        if config.optim.given is None:
            changes["given"] = tuple(dest for dest in DEEPSPEED_SETS_TOO.values() if dest in given)
    return changes


def _typed(option: Option, value):
    """`value` as a config holds it: a list of values as a tuple, --model-kwargs (a list of K=V pairs) as a dict;
    anything else as it is (the very object)."""
    if option.nargs is None or value is None:
        return tuple(value) if isinstance(value, list) else value
    if option.type is key_value:
        return value if isinstance(value, dict) else dict(value)
    return value if isinstance(value, tuple) else tuple(value)


GROUPS = tuple(part.default_factory for part in _parts())


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def group_options(group) -> list[Option]:
    """The options of one group class, in order, each with its dest and default."""
    return [dataclasses.replace(f.metadata["option"], dest=f.name, default=_default(f))
            for f in dataclasses.fields(group) if "option" in f.metadata]


# dest -> Option: every option of `vim-ds train`, in the order of --help
OPTIONS = {o.dest: o for group in GROUPS for o in group_options(group)}
