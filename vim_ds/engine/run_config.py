"""What a training run is, typed: one frozen dataclass per group of `vim-ds train`'s options (model; optimisation;
augmentation and regularisation; data; run; DeepSpeed), composed by `RunConfig`. Each field is one option: its
name is the option's dest, its default the parser's, and its metadata (`Option`) what the command line needs (the
flags as typed, help, type, choices, nargs, metavar, a store_true flag and its `--no-X` partner) and what a value
must be (`rule`, one of RULES, with a hint for the error). The command line's parser is generated from these fields
(run_options.build_parser), and option files (engine/options_file.py) read the option definitions from them.

A field's default is what the parser gives an option that is not on the command line; run_options.parse_args then
derives a few (--model-ema, --data-timeout) and gives --model-kwargs as a dict, so `RunConfig()` is the parser's
defaults and `RunConfig.from_namespace(parse_args(argv))` the run's effective options.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from .distributed import DATA_TIMEOUT
from .ds_config import DEFAULT_MICRO_BATCH
from .shipped_configs import DEFAULT as DEFAULT_DEEPSPEED_CONFIG
from .training_engines import DEFAULT as DEFAULT_ENGINE
from .training_engines import ENGINES


def key_value(text: str):
    """A `K=V` entry of --model-kwargs (every command's): (K, the Python literal V, or V as a string); argparse
    reports a malformed one under the command's own name."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass  # a bare string such as a name
    return key, value


# What a numeric option's value must be, as the error says it, and the test of it.
RULES = {"> 0": lambda v: v > 0, "0 or more": lambda v: v >= 0, "at least 1": lambda v: v >= 1,
         "between 0 and 1": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1,
         "in (0, 1]": lambda v: 0 < v <= 1}
ACTIONS = ("store", "store_true")


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


def option(*flags: str, default=None, factory: Callable | None = None, **meta):
    """A field of a group: the option `flags` with its default (or a factory of a mutable one) and metadata."""
    if factory is not None:
        return field(default_factory=factory, metadata={"option": Option(flags, **meta)})
    return field(default=default, metadata={"option": Option(flags, **meta)})


# --model-kwargs, declared once for every command: `vim-ds train` and `eval` take it as a field of ModelOptions,
# the others through add_model_kwargs.
MODEL_KWARGS = Option(("--model-kwargs",), nargs="*", type=key_value, metavar="K=V",
                      help="extra model constructor arguments, e.g. depth=4 embed_dim=64 patch_size=4")


def add_model_kwargs(parser, default, help: str | None = MODEL_KWARGS.help, metavar: str = MODEL_KWARGS.metavar):
    """MODEL_KWARGS as an argument of a command's `parser`, with that command's default (None: the arguments a
    weights file records, unless given; [] none) and its own help and metavar, as its --help has shown them."""
    parser.add_argument(*MODEL_KWARGS.flags, nargs=MODEL_KWARGS.nargs, type=MODEL_KWARGS.type, default=default,
                        metavar=metavar, help=help)


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
    # not an option: which of --min-lr and --warmup-lr hold the built-in default (run_options._lr_defaults)
    lr_defaults: tuple[str, ...] = ()
    # not an option: which of the values a DeepSpeed config can set too (optim.SHARED) were given, on the command
    # line or in a --config file (run_options._given): a number in the JSON must agree with these, and wins over
    # the others
    given: tuple[str, ...] = ()


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
    deepscale: bool = option("--deepscale", action="store_true", default=False, help=argparse.SUPPRESS)
    deepscale_config: str | None = option("--deepscale_config", type=str, default=None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class RunConfig:
    """A run's options, by group, in the order of `vim-ds train --help`."""
    model: ModelOptions = field(default_factory=ModelOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    augment: AugmentOptions = field(default_factory=AugmentOptions)
    data: DataOptions = field(default_factory=DataOptions)
    run: RunOptions = field(default_factory=RunOptions)
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)

    @classmethod
    def from_namespace(cls, namespace) -> RunConfig:
        """The typed config of parse_args' result: each option's value (lists of values as tuples, --model-kwargs
        as a dict), and `lr_defaults` where parse_args set it. An option missing from `namespace` is a KeyError.
        The one place the command line's namespace becomes the config the engine reads (engine/run.py calls it)."""
        values = vars(namespace)
        groups = {}
        for part in dataclasses.fields(cls):
            group = part.default_factory  # the group's class
            groups[part.name] = group(**{f.name: _typed(f, values[f.name]) for f in dataclasses.fields(group)
                                         if "option" in f.metadata or f.name in values})
        return cls(**groups)

    def to_dict(self) -> dict:
        """dest -> value of every field, in --help order: what `vars()` of the namespace holds."""
        return {f.name: getattr(group, f.name) for group in self.groups() for f in dataclasses.fields(group)}

    def groups(self) -> tuple:
        return tuple(getattr(self, part.name) for part in dataclasses.fields(self))

    def replace(self, **changes) -> RunConfig:
        """A copy with the fields `changes` names (by dest, in whichever group holds it) set to new values: what a
        check resolves (the DeepSpeed config's file, an lr default lowered to the peak) without changing `self`."""
        groups = {}
        for part in dataclasses.fields(self):
            group = getattr(self, part.name)
            mine = {f.name: changes.pop(f.name) for f in dataclasses.fields(group) if f.name in changes}
            if mine:
                groups[part.name] = dataclasses.replace(group, **mine)
        if changes:
            raise TypeError(f"not fields of a RunConfig: {sorted(changes)}")
        return dataclasses.replace(self, **groups)


def _typed(f: dataclasses.Field, value):
    meta = f.metadata.get("option")
    if meta is None or meta.nargs is None or value is None:
        return tuple(value) if isinstance(value, list) else value
    return dict(value) if meta.type is key_value else tuple(value)


GROUPS = tuple(part.default_factory for part in dataclasses.fields(RunConfig))


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def group_options(group) -> list[Option]:
    """The options of one group class, in order, each with its dest and default."""
    return [dataclasses.replace(f.metadata["option"], dest=f.name, default=_default(f))
            for f in dataclasses.fields(group) if "option" in f.metadata]


# dest -> Option: every option of `vim-ds train`, in the order of --help
OPTIONS = {o.dest: o for group in GROUPS for o in group_options(group)}
