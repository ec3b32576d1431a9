"""The options of a training run (`vim-ds train`, and `vim-ds eval` = `vim-ds train --eval`): the parser, the
checks of what the values mean together, `--config` files, and the one `KEY=VALUE` parser of every command's
--model-kwargs. Option names follow the published Vim/DeiT `main.py`; `--batch-size` is the per-rank micro batch."""
from __future__ import annotations

import argparse
import ast
import os
import sys

from .distributed import DATA_TIMEOUT, default_data_timeout

DESCRIPTION = "`vim-ds train` = `python -m vim_ds.train`: train (or, with --eval, evaluate) Vim with DeepSpeed."


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


def build_parser(prog: str = "vim-ds train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default="vim_tiny", help="a registered Vim name or alias (vim_tiny, vim_small_s8, ...)")
    g.add_argument("--input-size", type=int, default=224)
    g.add_argument("--model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V",
                   help="extra model constructor arguments, e.g. depth=4 embed_dim=64 patch_size=4")
    g.add_argument("--drop", type=float, default=0.0, help="dropout rate")
    g.add_argument("--drop-path", type=float, default=0.1, help="stochastic depth rate")
    g.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute each block's activations in backward instead of keeping them (less memory, "
                        "about one more forward of compute; same gradients)")
    g.add_argument("--model-ema", action="store_true", default=None,
                   help="keep an EMA of the weights [on; not with --engine ddp/fsdp]")
    g.add_argument("--no-model-ema", action="store_false", dest="model_ema")
    g.add_argument("--model-ema-decay", type=float, default=0.99996)
    g.add_argument("--finetune", default="", help="start from a published or converted checkpoint file")
    g.add_argument("--init-weights", default="", metavar="FILE",
                   help="start from exactly these weights (a state dict as `vim-ds convert` or --save-init-weights "
                        "write it; same model, strict), whatever this machine's RNG does with --seed")
    g.add_argument("--save-init-weights", default="", metavar="FILE",
                   help="write this run's initial weights to FILE (.pth or .safetensors), then train: other "
                        "clusters start from them with --init-weights FILE")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model through DeepSpeed's engine.compile() (first steps are slower)")
    g.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="torch.compile backend for --compile (inductor; aot_eager compiles fast, runs eager kernels)")

    g = p.add_argument_group("optimisation (AdamW, cosine schedule with warmup, per optimizer step)")
    g.add_argument("--batch-size", type=int, default=None, help="per-rank micro batch [64, or the JSON's]")
    g.add_argument("--accum-steps", type=int, default=None, help="gradient accumulation steps [1, or the JSON's]")
    g.add_argument("--epochs", type=int, default=300)
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--lr", type=float, default=5e-4, help="learning rate for a global batch of 512 (scaled)")
    g.add_argument("--unscale-lr", action="store_true", help="use --lr as it is, without batch scaling")
    g.add_argument("--min-lr", type=float, default=1e-5)
    g.add_argument("--warmup-lr", type=float, default=1e-6)
    g.add_argument("--warmup-epochs", type=float, default=5)
    g.add_argument("--weight-decay", type=float, default=0.05)
    g.add_argument("--clip-grad", type=float, default=None, help="gradient norm clipping (off by default)")
    g.add_argument("--opt-eps", type=float, default=1e-8)
    g.add_argument("--opt-betas", type=float, nargs=2, default=(0.9, 0.999))
    g.add_argument("--precision", choices=["bf16", "fp16", "fp32", "autocast-bf16"], default=None,
                   help="overrides the precision sections of the DeepSpeed config; autocast-bf16: fp32 parameters, "
                        "forward under torch.autocast(bf16) (DeepSpeed's torch_autocast section)")

    g = p.add_argument_group("augmentation and regularisation (timm)")
    g.add_argument("--color-jitter", type=float, default=0.3)
    g.add_argument("--aa", default="rand-m9-mstd0.5-inc1", help="timm auto-augment policy, or 'none'")
    g.add_argument("--train-interpolation", default="bicubic")
    g.add_argument("--scale", type=float, nargs=2, default=(0.08, 1.0), help="random-resized-crop area range")
    g.add_argument("--ratio", type=float, nargs=2, default=(3 / 4, 4 / 3), help="random-resized-crop aspect range")
    g.add_argument("--hflip", type=float, default=0.5, help="horizontal flip probability")
    g.add_argument("--reprob", type=float, default=0.25, help="random erasing probability")
    g.add_argument("--remode", default="pixel")
    g.add_argument("--recount", type=int, default=1)
    g.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    g.add_argument("--mixup", type=float, default=0.8)
    g.add_argument("--cutmix", type=float, default=1.0)
    g.add_argument("--cutmix-minmax", type=float, nargs=2, default=None)
    g.add_argument("--mixup-prob", type=float, default=1.0)
    g.add_argument("--mixup-switch-prob", type=float, default=0.5)
    g.add_argument("--mixup-mode", default="batch", choices=["batch", "pair", "elem"])
    g.add_argument("--repeated-aug", action="store_true", default=True)
    g.add_argument("--no-repeated-aug", action="store_false", dest="repeated_aug")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default="", help="ImageNet-style root with train/ and val/ class folders")
    g.add_argument("--data-set", default="IMNET", choices=["IMNET", "folder", "shards", "synthetic"],
                   help="IMNET/folder: --data-path holds train/<class>/* and val/<class>/*; shards: --data-path was "
                        "written by `vim-ds data shard`; synthetic: generated noise")
    g.add_argument("--nb-classes", type=int, default=1000, help="classes of --data-set synthetic")
    g.add_argument("--synthetic-size", type=int, default=12800, help="training images of --data-set synthetic")
    g.add_argument("--eval-crop-ratio", type=float, default=0.875)
    g.add_argument("--num_workers", "--num-workers", type=int, default=None, dest="num_workers",
                   help="data-loader worker processes per rank [10, capped to this machine's cores divided by the "
                        "ranks on the node, at least 1]; 0 reads data in the training process (no --data-timeout)")
    g.add_argument("--data-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"a rank whose data loader delivers no batch for this long stops the job with a one-line "
                        f"error naming the loader (train/val) [{DATA_TIMEOUT:g}, at most half --dist-timeout; "
                        f"0: wait forever]")
    g.add_argument("--max-bad-images", type=float, default=0.01, metavar="FRACTION",
                   help="stop when more than this fraction of the images read so far did not decode (each one is "
                        "skipped and logged with its path)")
    g.add_argument("--pin-mem", action="store_true", default=True)
    g.add_argument("--no-pin-mem", action="store_false", dest="pin_mem")

    g = p.add_argument_group("run")
    g.add_argument("--config", default="", metavar="NAME|FILE",
                   help="take the options from a YAML file: a shipped recipe of a published Vim run (`vim-ds configs` "
                        "lists them, e.g. vim_small_pretrain) or a run's OUTPUT_DIR/options.yaml; options given on "
                        "the command line win over the file's")
    g.add_argument("--output_dir", "--output-dir", default="", dest="output_dir",
                   help="checkpoints, metrics.jsonl, tensorboard/ (nothing is saved without it)")
    g.add_argument("--resume", default="", help="checkpoint directory, 'auto' (latest in --output_dir), or a .pth "
                   "with --eval")
    g.add_argument("--eval", action="store_true", help="only evaluate (--resume or --finetune gives the weights)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-interval", type=int, default=0, help="also checkpoint every N optimizer steps")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (0 = all)")
    g.add_argument("--max-bad-steps", type=int, default=1, metavar="N",
                   help="bf16/fp32: stop after N consecutive steps whose loss is NaN/inf (the step is not applied; "
                        "fp16's loss scaler skips overflowing steps by itself)")
    g.add_argument("--dist-timeout", type=float, default=600, metavar="SECONDS",
                   help="process-group timeout: a collective waiting longer than this for a dead or stuck rank "
                        "fails the job instead of hanging it")
    g.add_argument("--log-interval", type=int, default=10, help="steps between log lines (without a terminal)")
    g.add_argument("--tensorboard", action="store_true", help="write TensorBoard scalars to OUTPUT_DIR/tensorboard")
    g.add_argument("--engine", choices=["deepspeed", "ddp", "fsdp"], default="deepspeed",
                   help="ddp / fsdp: PyTorch DistributedDataParallel / FSDP2 fully_shard (per block + root, full "
                        "sharding) instead of DeepSpeed, with the same model, AdamW groups, lr schedule, data and "
                        "metrics (the --deepspeed_config still gives batch, optimizer settings and precision; bf16 "
                        "and autocast-bf16 run fp32 parameters under bf16 autocast): the baselines of "
                        "`vim-ds zero-compare`. They "
                        "save no checkpoints and keep no EMA: --resume, --save-interval and --model-ema are refused")
    g.add_argument("--local_rank", "--local-rank", type=int, default=-1, dest="local_rank",
                   help="set by the deepspeed launcher")
    add_deepspeed_arguments(p)
    return p


def add_deepspeed_arguments(p: argparse.ArgumentParser) -> None:
    """The options `deepspeed.add_config_arguments` adds (the same names, defaults and types:
    tests/test_configs.py holds them against DeepSpeed's), written here so that `vim-ds train` parses and checks
    its command line without importing DeepSpeed: a typo is reported in seconds."""
    from .shipped_configs import DEFAULT

    g = p.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", default=False, action="store_true",
                   help="accepted for DeepSpeed's launchers and scripts; vim_ds always runs DeepSpeed")
    g.add_argument("--deepspeed_config", default=None, type=str, metavar="NAME|FILE",
                   help=f"a DeepSpeed JSON config file, or the name of one shipped with vim_ds (`vim-ds configs` "
                        f"lists them) [{DEFAULT}, said at the start of the run]")
    g.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)


# What a numeric option's value must be, as the error says it, and the test of it.
RULES = {"> 0": lambda v: v > 0, "0 or more": lambda v: v >= 0, "at least 1": lambda v: v >= 1,
         "between 0 and 1": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1,
         "in (0, 1]": lambda v: 0 < v <= 1}
# The options whose other values mean nothing (an option not given, None, is not checked): (option, rule, hint).
RANGES = (
    ("--lr", "> 0", ""), ("--min-lr", "0 or more", ""), ("--warmup-lr", "0 or more", ""),
    ("--epochs", "at least 1", ""), ("--max-steps", "at least 1", "omit --max-steps for no limit"),
    ("--batch-size", "at least 1", ""), ("--accum-steps", "at least 1", ""),
    ("--warmup-epochs", "0 or more", ""), ("--weight-decay", "0 or more", ""),
    ("--clip-grad", "0 or more", "0 or omitted: no clipping"), ("--opt-eps", "0 or more", ""),
    ("--opt-betas", "in [0, 1)", ""), ("--model-ema-decay", "in (0, 1]", ""),
    ("--color-jitter", "0 or more", ""), ("--hflip", "between 0 and 1", ""), ("--reprob", "between 0 and 1", ""),
    ("--smoothing", "in [0, 1)", ""), ("--mixup", "0 or more", ""), ("--cutmix", "0 or more", ""),
    ("--mixup-prob", "between 0 and 1", ""), ("--mixup-switch-prob", "between 0 and 1", ""),
    ("--nb-classes", "at least 1", ""), ("--synthetic-size", "at least 1", ""),
    ("--eval-crop-ratio", "in (0, 1]", ""), ("--num_workers", "0 or more", ""),
    ("--max-bad-images", "between 0 and 1", ""), ("--save-interval", "0 or more", "0: none between epoch ends"),
    ("--keep-checkpoints", "0 or more", "0 keeps all"), ("--max-bad-steps", "at least 1", ""),
)


def range_error(args) -> str | None:
    """The first option of RANGES whose value means nothing, said in one line with the value as given."""
    for option, rule, hint in RANGES:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        values = value if isinstance(value, (list, tuple)) else [value]
        if value is not None and not all(map(RULES[rule], values)):
            shown = " ".join(f"{v:g}" if isinstance(v, float) and float(f"{v:g}") == v else str(v) for v in values)
            return f"{option} must be {rule}, got {shown}" + (f" ({hint})" if hint else "")
    return None


def patch_grid_error(model: str, model_kwargs: dict, input_size: int) -> str | None:
    """Why `input_size` is no whole grid of `model`'s patches (which start every `stride` pixels, so
    (input_size - patch_size) must be a multiple of the stride, and the patch must fit), or None. Patch size and
    stride are the registered variant's unless --model-kwargs sets them; an unknown model is left to the factory."""
    from ..models import ALIASES, VARIANTS

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


def _apply_config(parser: argparse.ArgumentParser, argv) -> dict:
    """With --config: the file's options become the parser's defaults (so the command line still wins); returns the
    file's `recipe:` description ({} without one). A bad file is a parser error (one line, exit 2)."""
    from . import options_file, shipped_configs

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return {}
    try:
        path = shipped_configs.resolve_recipe(known.config)
        options, meta = options_file.load(path, parser)
    except ValueError as exc:
        parser.error(str(exc))
    parser.set_defaults(**options)
    if meta.get(options_file.SEGMENTS_KEY) and os.environ.get("RANK", "0") == "0":  # a run resumed with other
        # options: the file's top level is how it started, which is what this run repeats
        print(options_file.segments_note(known.config, parser, options, meta[options_file.SEGMENTS_KEY]),
              flush=True)
    return meta


def parse_args(argv=None, prog: str = "vim-ds train") -> argparse.Namespace:
    parser = build_parser(prog)
    meta = _apply_config(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    missing = [name for name in meta.get("requires") or () if not getattr(args, name, None)]
    if missing and not args.eval:
        parser.error(f"--config {args.config}: this recipe starts from a checkpoint: give "
                     f"{' '.join('--' + m.replace('_', '-') + ' FILE' for m in missing)}")
    problem = range_error(args)
    if problem:
        parser.error(problem)
    if args.deepscale_config:  # DeepSpeed's deprecated spelling, which its own scripts may still pass
        if args.deepspeed_config and args.deepspeed_config != args.deepscale_config:
            parser.error(f"--deepscale_config {args.deepscale_config} and --deepspeed_config {args.deepspeed_config} "
                         f"disagree: pass --deepspeed_config alone")
        args.deepspeed_config = args.deepscale_config
    if args.dist_timeout <= 0:
        parser.error(f"--dist-timeout must be a positive number of seconds, got {args.dist_timeout}")
    if args.data_timeout is None:
        args.data_timeout = default_data_timeout(args.dist_timeout)
    elif args.data_timeout < 0 or args.data_timeout >= args.dist_timeout:
        parser.error(f"--data-timeout must be 0 (no limit) or below --dist-timeout ({args.dist_timeout:g} s), so "
                     f"that a stalled rank stops the job before its peers' collectives time out; got "
                     f"{args.data_timeout:g}")
    if sum(map(bool, (args.finetune, args.init_weights, args.save_init_weights))) > 1:
        parser.error("--finetune, --init-weights and --save-init-weights each set the initial weights: pass one")
    if args.engine != "deepspeed":
        refused = [name for name, on in (("--resume", args.resume), ("--save-interval", args.save_interval),
                                         ("--model-ema", args.model_ema)) if on]
        if refused:
            parser.error(f"--engine {args.engine} is a measurement baseline: it saves no checkpoints and keeps no "
                         f"EMA; drop {', '.join(refused)}")
    if args.compile and args.engine != "deepspeed":
        parser.error(f"--compile goes through DeepSpeed's engine.compile(); --engine {args.engine} does not have it")
    if args.model_ema is None:
        args.model_ema = args.engine == "deepspeed"
    args.model_kwargs = dict(args.model_kwargs)
    problem = patch_grid_error(args.model, args.model_kwargs, args.input_size)
    if problem:
        parser.error(problem)
    args.scale, args.ratio = tuple(args.scale), tuple(args.ratio)
    args.lr_defaults = _lr_defaults(args, argv, prog)
    return args


def _lr_defaults(args, argv, prog: str) -> tuple:
    """Of --min-lr and --warmup-lr, those holding the built-in default, not typed on the command line (in any
    spelling argparse accepts): a default above a small batch's scaled lr is lowered with a note, a given value
    refused (engine/optim.check_lr_settings). A --config file's value equal to the default counts as the default,
    since a run's options.yaml records every option."""
    probe = build_parser(prog)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    typed, _ = probe.parse_known_args(sys.argv[1:] if argv is None else argv)
    defaults = build_parser(prog)
    return tuple(dest for dest in ("min_lr", "warmup_lr")  # a tuple: vars(args) goes into the checkpoints
                 if not hasattr(typed, dest) and getattr(args, dest) == defaults.get_default(dest))
