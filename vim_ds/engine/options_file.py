"""`vim-ds train` options as YAML: the recipes shipped with vim_ds (`--config NAME`), a file of one's own
(`--config FILE`), and the record every run writes of its effective options (OUTPUT_DIR/options.yaml), which
`--config OUTPUT_DIR/options.yaml` starts again.

A file maps option names (the dest names: `drop_path`, `num_workers`; `drop-path` is read as the same) to values;
the optional `recipe:` mapping describes a shipped recipe (stage, gpus, source, requires) and sets no option.
The command line wins over the file: train.parse_args makes the file's values the parser's defaults, then parses
the command line. Every value goes through its option's own type and choices, so `lr: 1e-3` (a string to YAML 1.1)
is the float 0.001, and a wrong value is a one-line error naming the file and the key.
"""
from __future__ import annotations

import argparse
import difflib

OPTIONS_FILE = "options.yaml"  # in the run's --output_dir
META_KEY = "recipe"
META_FIELDS = {"stage", "gpus", "source", "requires", "description"}
# not options of a run: the file itself, what the launcher sets, DeepSpeed's flags that change nothing here
NOT_RECORDED = ("config", "local_rank", "deepspeed", "deepscale", "deepscale_config")


def _derived_data_timeout(args) -> float:
    from .distributed import default_data_timeout

    return default_data_timeout(args.dist_timeout)


# options that train.parse_args derives from others when not given: recorded as null (not given) when they hold
# the derived value, so that a run started from the record with, say, another --dist-timeout or --engine derives
# them again instead of being refused for a value nobody gave
DERIVED = {"data_timeout": _derived_data_timeout, "model_ema": lambda args: args.engine == "deepspeed"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action that sets it with a value (for a flag pair such as --model-ema/--no-model-ema, either)."""
    actions = {}
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            actions.setdefault(action.dest, action)
    return actions


def option_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """The option as one types it: `--lr`, `--num_workers`, `--drop-path`."""
    action = _actions(parser).get(dest)
    if action is None:
        return dest
    return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])


def _convert(action: argparse.Action, value, where: str):
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    nargs = action.nargs
    if nargs in ("*", "+") or isinstance(nargs, int):
        if action.dest == "model_kwargs" and isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if isinstance(nargs, int) and len(items) != nargs:
            raise ValueError(f"{where}: expected {nargs} values, got {len(items)}")
        return [_one(action, item, where) for item in items]
    return _one(action, value, where)


def _one(action: argparse.Action, value, where: str):
    if isinstance(value, (dict, list)):
        raise ValueError(f"{where}: expected one value, got {value!r}")
    try:
        if action.type in (int, float):
            if isinstance(value, bool) or (action.type is int and isinstance(value, float)):
                raise ValueError(f"expected {'a whole number' if action.type is int else 'a number'}")
            value = action.type(value)
        elif action.type is not None:
            value = action.type(str(value))
        else:
            value = str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{where}: {value!r} is not a valid value ({exc})") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def read(path: str) -> dict:
    """The mapping a YAML option file holds, or a one-line ValueError."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}: not valid YAML{at} ({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got a "
                         f"{type(data).__name__}")
    return data


def load(path: str, parser: argparse.ArgumentParser) -> tuple[dict, dict]:
    """(option dest -> value, the `recipe:` description) from the file; a ValueError names the first bad key."""
    data = read(path)
    actions = _actions(parser)
    settable = sorted(d for d in actions if d not in NOT_RECORDED)
    options, meta = {}, {}
    for key, value in data.items():
        key = str(key)
        if key == META_KEY:
            if not isinstance(value, dict) or not set(map(str, value)) <= META_FIELDS:
                raise ValueError(f"--config {path}: `{META_KEY}:` describes a recipe with the keys "
                                 f"{', '.join(sorted(META_FIELDS))}")
            meta = dict(value)
            continue
        dest = key.lstrip("-").replace("-", "_")
        if dest not in settable:
            close = difflib.get_close_matches(dest, settable, n=1, cutoff=0.6)
            hint = f" (did you mean {option_name(parser, close[0])}, `{close[0]}:`?)" if close else ""
            raise ValueError(f"--config {path}: unknown option {key!r}{hint}")
        if dest in options:
            raise ValueError(f"--config {path}: {key!r} is given twice")
        options[dest] = _convert(actions[dest], value, f"--config {path}: {key}")
    return options, meta


def record(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The effective options of a run as a YAML-ready mapping (tuples as lists), in the parser's order."""
    from . import shipped_configs

    out = {}
    for dest in _actions(parser):
        if dest in NOT_RECORDED or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if dest == "deepspeed_config" and not value:
            value = shipped_configs.DEFAULT  # what the run used, said as the trainer says it
        elif dest in DERIVED and value == DERIVED[dest](args):
            value = None  # derived from other options by train.parse_args: derived again from the file's
        out[dest] = _plain(value)
    return out


def _plain(value):
    """A value YAML's safe dumper writes: tuples as lists, anything else unusual (a Path set by a caller) as text."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def write(path: str, options: dict) -> None:
    import yaml

    text = yaml.safe_dump(options, sort_keys=False, default_flow_style=None)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("# vim-ds train: this run's effective options, written at its start. Start the same run again with\n"
                "#   vim-ds train --config THIS_FILE --output_dir ANOTHER_DIR   (the command line wins over the file)\n")
        f.write(text)
    import os

    os.replace(path + ".tmp", path)
