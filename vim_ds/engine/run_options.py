"""The options of a training run (`vim-ds train`, and `vim-ds eval` = `vim-ds train --eval`): the parser, generated
from the typed options of engine/run_config.py, the checks of what the values mean together, and `--config` files.
Option names follow the published Vim/DeiT `main.py`; `--batch-size` is the per-rank micro batch."""
from __future__ import annotations

import argparse
import copy
import os
import sys

from .distributed import default_data_timeout
from .run_config import GROUPS, OPTIONS, RULES, DeepSpeedOptions, group_options
from .training_engines import training_engine

DESCRIPTION = "`vim-ds train` = `python -m vim_ds.train`: train (or, with --eval, evaluate) Vim with DeepSpeed."


def build_parser(prog: str = "vim-ds train", defaults: bool = True) -> argparse.ArgumentParser:
    """The parser of `vim-ds train`, generated from run_config's fields: one argument group per group of options.
    Without `defaults`, every option's default is argparse.SUPPRESS: what it parses is only what was typed."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for group in GROUPS:
        add_group(p, group, defaults)
    return p


def add_deepspeed_arguments(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The options `deepspeed.add_config_arguments` adds (the same names, defaults and types:
    tests/test_configs.py holds them against DeepSpeed's), written here so that `vim-ds train` parses and checks
    its command line without importing DeepSpeed: a typo is reported in seconds."""
    add_group(p, DeepSpeedOptions, defaults)


def add_group(p: argparse.ArgumentParser, group, defaults: bool = True) -> None:
    """One group of run_config's options as an argument group of `p`."""
    g = p.add_argument_group(group.TITLE, group.DESCRIPTION)
    for option in group_options(group):
        default = copy.copy(option.default) if defaults else argparse.SUPPRESS
        if option.action == "store":
            g.add_argument(*option.flags, dest=option.dest, default=default, type=option.type, nargs=option.nargs,
                           choices=None if option.choices is None else list(option.choices), metavar=option.metavar,
                           help=option.help)
        else:
            g.add_argument(*option.flags, dest=option.dest, default=default, action=option.action, help=option.help)
        if option.negative:
            g.add_argument(option.negative, action="store_false", dest=option.dest,
                           **({} if defaults else {"default": argparse.SUPPRESS}))


def range_error(args) -> str | None:
    """The first option (in --help order) whose value is outside its range rule (run_config.Option.rule), said in
    one line with the value as given."""
    for option in OPTIONS.values():
        value = getattr(args, option.dest)
        if not option.rule or value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(map(RULES[option.rule], values)):
            shown = " ".join(f"{v:g}" if isinstance(v, float) and float(f"{v:g}") == v else str(v) for v in values)
            return f"{option.flag} must be {option.rule}, got {shown}" + (f" ({option.hint})" if option.hint else "")
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


def _apply_config(parser: argparse.ArgumentParser, argv) -> tuple[dict, dict]:
    """With --config: the file's options become the parser's defaults (so the command line still wins); returns the
    file's `recipe:` description ({} without one) and its options. A bad file is a parser error (one line, exit
    2)."""
    from . import options_file, shipped_configs

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return {}, {}
    try:
        path = shipped_configs.resolve_recipe(known.config)
        options, meta = options_file.load(path)
    except ValueError as exc:
        parser.error(str(exc))
    parser.set_defaults(**options)
    # a run resumed with other options: the file's top level is how it started, which is what this run repeats
    if meta.get(options_file.SEGMENTS_KEY) and os.environ.get("RANK", "0") == "0":
        print(options_file.segments_note(known.config, options, meta[options_file.SEGMENTS_KEY]),
              flush=True)
    return meta, options


def parse_args(argv=None, prog: str = "vim-ds train") -> argparse.Namespace:
    parser = build_parser(prog)
    meta, from_file = _apply_config(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    missing = [name for name in meta.get("requires") or () if not getattr(args, name, None)]
    if missing and not args.eval:
        parser.error(f"--config {args.config}: this recipe starts from a checkpoint: give "
                     f"{' '.join('--' + m.replace('_', '-') + ' FILE' for m in missing)}")
    problem = range_error(args)
    if problem:
        parser.error(problem)
    # DeepSpeed's deprecated spelling, which its own scripts may still pass
    if args.deepscale_config:
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
    engine = training_engine(args.engine)  # what it can do
    refused = [name for name, on, can in (("--resume", args.resume, engine.saves_checkpoints),
                                          ("--save-interval", args.save_interval, engine.saves_checkpoints),
                                          ("--model-ema", args.model_ema, engine.keeps_ema)) if on and not can]
    if refused:
        parser.error(f"--engine {args.engine} is a measurement baseline: it saves no checkpoints and keeps no "
                     f"EMA; drop {', '.join(refused)}")
    if args.sequence_parallel > 1:
        # the split's collectives run inside the forward: a recomputation would repeat them
        refused = [name for name, on in (("--engine " + args.engine, not engine.splits_sequence),
                                         ("--compile", args.compile),
                                         ("--grad-checkpointing", args.grad_checkpointing)) if on]
        if refused:
            parser.error(f"--sequence-parallel {args.sequence_parallel} runs through DeepSpeed's engine, eagerly, "
                         f"without recomputing blocks: drop {', '.join(refused)}")
    if args.compile and not engine.compiles:
        parser.error(f"--compile goes through DeepSpeed's engine.compile(); --engine {args.engine} does not have it")
    if args.model_ema is None:
        args.model_ema = engine.keeps_ema
    args.model_kwargs = dict(args.model_kwargs)
    problem = patch_grid_error(args.model, args.model_kwargs, args.input_size)
    if problem:
        parser.error(problem)
    args.scale, args.ratio = tuple(args.scale), tuple(args.ratio)
    typed = _typed(argv, prog)
    args.lr_defaults = _lr_defaults(args, typed)
    args.given = _given(typed, from_file)
    return args


def _typed(argv, prog: str) -> set[str]:
    """The options typed on the command line (in any spelling argparse accepts), by dest."""
    typed, _ = build_parser(prog, defaults=False).parse_known_args(sys.argv[1:] if argv is None else argv)
    return set(vars(typed))


def _lr_defaults(args, typed: set[str]) -> tuple:
    """Of --min-lr and --warmup-lr, those holding the built-in default, not typed on the command line: a default
    above a small batch's scaled lr is lowered with a note, a given value refused (engine/optim.check_lr_settings).
    A --config file's value equal to the default counts as the default, since a run's options.yaml records every
    option."""
    # a tuple: vars(args) goes into the checkpoints
    return tuple(dest for dest in ("min_lr", "warmup_lr")
                 if dest not in typed and getattr(args, dest) == OPTIONS[dest].default)


def _given(typed: set[str], from_file: dict) -> tuple:
    """Of the values a DeepSpeed config can set too (optim.SHARED), those given: typed on the command line, or in
    the --config file with another value than the default (a run's options.yaml records every option: the values
    it holds that the JSON decided are the JSON's, and agree with it)."""
    from .optim import SHARED
    from .options_file import plain

    return tuple(dest for dest in SHARED.values()
                 if dest in typed or (dest in from_file and plain(from_file[dest]) != plain(OPTIONS[dest].default)))
