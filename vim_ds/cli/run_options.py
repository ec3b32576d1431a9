"""The command line of a training run (`vim-ds train`, and `vim-ds eval` = `vim-ds train --eval`): the parser,
generated from the typed options of config/run_config.py, and `parse_config`, which builds the run's RunConfig from
its sources in order (the fields' defaults, a `--config` recipe or file, what was typed) and refuses a config that
breaks a rule (config/run_rules.py) as a usage error. It is the command line's (vim_ds/cli/), as argparse is: the
engine takes the RunConfig. Option names follow the published Vim/DeiT `main.py`; `--batch-size` is the per-rank
micro batch."""
from __future__ import annotations

import argparse
import copy
import os
import sys

from ..config import options_file, run_config, shipped_configs
from ..config.run_config import GROUPS, OPTIONS, DeepSpeedOptions, RunConfig, group_options
from ..config.run_rules import range_error as _range_error
from ..config.run_rules import validate

DESCRIPTION = "`vim-ds train` = `python -m vim_ds.train`: train (or, with --eval, evaluate) Vim with DeepSpeed."


def key_value(text: str):
    """The argparse type of every command's --model-kwargs: a `K=V` entry (run_config.key_value), a malformed one
    reported by argparse under the command's own name."""
    try:
        return run_config.key_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def argument_type(option):
    """The type argparse is given for `option`: its own, but where the option's reads text that only says why it
    is wrong in its ValueError (run_config.key_value), the argparse type that shows it."""
    return key_value if option.type is run_config.key_value else option.type


def add_model_kwargs(parser, default, help: str | None = run_config.MODEL_KWARGS.help,
                     metavar: str = run_config.MODEL_KWARGS.metavar):
    """run_config.MODEL_KWARGS as an argument of a command's `parser`, with that command's default (None: the
    arguments a weights file records, unless given; [] none) and its own help and metavar, as its --help has shown
    them."""
    option = run_config.MODEL_KWARGS
    parser.add_argument(*option.flags, nargs=option.nargs, type=argument_type(option), default=default,
                        metavar=metavar, help=help)


def build_parser(prog: str = "vim-ds train") -> argparse.ArgumentParser:
    """The parser of `vim-ds train`, generated from run_config's fields: one argument group per group of options."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for group in GROUPS:
        add_group(p, group)
    return p


def add_deepspeed_arguments(p: argparse.ArgumentParser) -> None:
    """The options `deepspeed.add_config_arguments` adds (the same names, defaults and types:
    tests/test_configs.py holds them against DeepSpeed's), written here so that `vim-ds train` parses and checks
    its command line without importing DeepSpeed: a typo is reported in seconds."""
    add_group(p, DeepSpeedOptions)


def add_group(p: argparse.ArgumentParser, group) -> None:
    """One group of run_config's options as an argument group of `p`."""
    g = p.add_argument_group(group.TITLE, group.DESCRIPTION)
    for option in group_options(group):
        default = copy.copy(option.default)
        # argparse tells SUPPRESS by identity
        shown = argparse.SUPPRESS if option.help == run_config.HIDDEN else option.help
        if option.action == "store":
            g.add_argument(*option.flags, dest=option.dest, default=default, type=argument_type(option),
                           nargs=option.nargs, choices=None if option.choices is None else list(option.choices),
                           metavar=option.metavar, help=shown)
        else:
            g.add_argument(*option.flags, dest=option.dest, default=default, action=option.action, help=shown)
        if option.negative:
            g.add_argument(option.negative, action="store_false", dest=option.dest)


def range_error(args) -> str | None:
    """run_rules.range_error of a namespace of the run's options (`parse_args`)."""
    return _range_error(vars(args))


def _read_config_file(parser: argparse.ArgumentParser, argv) -> tuple[dict, dict]:
    """With --config: the file's `recipe:` description ({} without one) and its options, which --help then shows as
    the defaults; ({}, {}) without. A bad file is a parser error (one line, exit 2), said before anything else in
    argv is read."""
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


def parse_config(argv=None, prog: str = "vim-ds train") -> RunConfig:
    """The run's RunConfig from its sources, in order: the fields' defaults, the --config file (a shipped recipe or
    a run's options.yaml), the options typed in `argv` (sys.argv[1:] when None), each winning over the ones before.
    The RunConfig resolves itself as it is made (run_config.resolution; what was typed is recorded once, here, in
    its `explicit`). A bad file, a recipe's missing checkpoint or a broken rule (run_rules.validate) is a usage
    error: one line, exit 2."""
    return _parse(argv, prog)[0]


def parse_args(argv=None, prog: str = "vim-ds train") -> argparse.Namespace:
    """`parse_config`'s options as a namespace (dest -> value, as RunConfig.to_dict holds them; a list of values
    typed, as argparse read it), for what reads them by name on the command-line side (`vim-ds bench data
    --train-args`)."""
    config, typed = _parse(argv, prog)
    values = config.to_dict()
    as_read = {dest: value for dest, value in typed.items() if isinstance(value, list) and tuple(value) == values[dest]}
    return argparse.Namespace(**{**values, **as_read})


def _parse(argv, prog: str) -> tuple[RunConfig, dict]:
    """(parse_config's RunConfig, the options typed: dest -> value as argparse read it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    meta, from_file = _read_config_file(parser, argv)
    typed = _typed(parser, argv)
    config = RunConfig.from_dict({**from_file, **typed}, explicit=set(typed))
    values = config.to_dict()
    missing = [name for name in meta.get("requires") or () if not values.get(name)]
    if missing and not config.run.eval:
        parser.error(f"--config {config.run.config}: this recipe starts from a checkpoint: give "
                     f"{' '.join('--' + m.replace('_', '-') + ' FILE' for m in missing)}")
    problem = validate(config)
    if problem:
        parser.error(problem)
    return config, typed


# what a namespace holds for an option until argv names it (`_typed`)
_NOT_TYPED = object()


def _typed(parser: argparse.ArgumentParser, argv: list) -> dict:
    """dest -> value of each option typed in `argv` (in any spelling argparse accepts), as argparse reads it. One
    parse by the parser of --help and of every error message: the namespace it fills starts with a marker for every
    option, which argparse then neither replaces by a default nor converts; only a typed option replaces it."""
    namespace = argparse.Namespace(**{dest: _NOT_TYPED for dest in OPTIONS})
    parser.parse_args(argv, namespace)
    return {dest: value for dest, value in vars(namespace).items() if value is not _NOT_TYPED}
