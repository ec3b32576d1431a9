"""`vim-ds train`'s options are config/run_config.py's typed fields (issue 37, item 1): the parser is generated from
them, so every option of `build_parser()` is one field's metadata and every field with an option is on the
parser (both ways, with a negative control: a hand-added option or a changed default is found); the range rules
that `range_error` applies are the fields'; and RunConfig.from_dict holds what parse_args returns."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from vim_ds.cli.run_options import argument_type, build_parser, parse_args, range_error
from vim_ds.config.run_config import GROUPS, OPTIONS, RULES, RunConfig

KIND = {"store": argparse._StoreAction, "store_true": argparse._StoreTrueAction}


def mismatches(parser: argparse.ArgumentParser) -> list[str]:
    """Everything on `parser` that is not exactly run_config's fields (and every field missing from it)."""
    problems, seen = [], set()
    groups = [g for g in parser._action_groups if g.title not in ("positional arguments", "options")]
    if [(g.title, g.description) for g in groups] != [(c.TITLE, c.DESCRIPTION) for c in GROUPS]:
        problems.append(f"groups {[g.title for g in groups]} are not run_config's")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        option = OPTIONS.get(action.dest)
        if option is None:
            problems.append(f"{action.option_strings}: no field named {action.dest}")
            continue
        if action.option_strings == [option.negative]:
            if not isinstance(action, argparse._StoreFalseAction):
                problems.append(f"{option.negative} does not store False")
            continue
        got = (tuple(action.option_strings), type(action), action.default, action.type, action.nargs,
               action.choices and tuple(action.choices), action.metavar, action.help)
        nargs = option.nargs if option.action == "store" else 0  # a flag takes no value
        # the type is the option's, as argparse reports its errors (run_options.argument_type: --model-kwargs')
        want = (option.flags, KIND[option.action], option.default, argument_type(option), nargs, option.choices,
                option.metavar, option.help)
        if got != want:
            problems.append(f"{option.flag}: the parser has {got}, the field {want}")
        if action.dest in seen:
            problems.append(f"{option.flag}: on the parser twice")
        seen.add(action.dest)
    problems += [f"{option.flag}: a field that is not on the parser" for dest, option in OPTIONS.items()
                 if dest not in seen]
    return problems


def test_the_parser_is_the_fields_both_ways():
    assert mismatches(build_parser()) == []
    assert mismatches(build_parser("vim-ds eval")) == []
    # the only fields that are not options: what parse_args derives from the command line
    fields = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert sorted(set(fields) - set(OPTIONS)) == ["given", "lr_defaults"] and len(fields) == len(set(fields))


def test_a_hand_made_option_or_a_changed_default_is_found():
    """The negative control: options added to the parser beside the fields, or changed there, are named."""
    extra = build_parser()
    extra.add_argument("--not-a-field", type=int, default=3)
    assert mismatches(extra) == ["['--not-a-field']: no field named not_a_field"]
    changed = build_parser()
    changed.set_defaults(lr=1e-3)
    assert [p.split(":")[0] for p in mismatches(changed)] == ["--lr"]
    missing = build_parser()
    missing._actions = [a for a in missing._actions if a.dest != "seed"]
    assert mismatches(missing) == ["--seed: a field that is not on the parser"]


FAILS = {"> 0": 0, "0 or more": -1, "at least 1": 0, "between 0 and 1": 2, "in [0, 1)": 1, "in (0, 1]": 0}


@pytest.mark.parametrize("dest", [d for d, o in OPTIONS.items() if o.rule])
def test_range_rules_come_from_the_fields(dest):
    option = OPTIONS[dest]
    assert option.rule in RULES
    value = FAILS[option.rule]
    bad = [value] * option.nargs if option.nargs else value
    shown = " ".join([str(value)] * (option.nargs or 1))
    hint = f" ({option.hint})" if option.hint else ""
    namespace = argparse.Namespace(**{**vars(parse_args([])), dest: bad})
    assert range_error(namespace) == f"{option.flag} must be {option.rule}, got {shown}{hint}"


def test_an_option_without_a_rule_is_not_checked():
    """The control: a value no rule covers (a negative --seed, --log-interval) is left alone."""
    assert not OPTIONS["seed"].rule and not OPTIONS["log_interval"].rule
    assert range_error(argparse.Namespace(**{**vars(parse_args([])), "seed": -1, "log_interval": -1})) is None


def test_the_typed_config_holds_what_parse_args_returns():
    args = parse_args(["--model-kwargs", "depth=2", "embed_dim=32", "--opt-betas", "0.8", "0.9", "--no-pin-mem",
                       "--cutmix-minmax", "0.2", "0.8", "--lr", "0.01", "--num-workers", "3"])
    config = RunConfig.from_dict(vars(args))
    assert config.model.model_kwargs == {"depth": 2, "embed_dim": 32} and config.optim.lr == 0.01
    assert config.optim.opt_betas == (0.8, 0.9) and config.augment.cutmix_minmax == (0.2, 0.8)
    assert config.data.pin_mem is False and config.data.num_workers == 3
    assert config.optim.lr_defaults == ("min_lr", "warmup_lr")
    # every value is the namespace's (lists as tuples), and the dict round trip gives the same config
    plain = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    assert config.to_dict() == plain
    assert RunConfig.from_dict(config.to_dict()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optim.lr = 1.0
    # the defaults of the fields are the parser's, resolved as the command line resolves them (issue 53: RunConfig()
    # is a run, its --model-ema on, not None)
    assert RunConfig().to_dict() == vars(parse_args([]))
    assert {**vars(build_parser().parse_args([])), "model_ema": True, "data_timeout": 120, "model_kwargs": {},
            "lr_defaults": ("min_lr", "warmup_lr"), "given": ()} == RunConfig().to_dict()


def test_replace_changes_the_named_fields_in_their_groups_and_nothing_else():
    """What preflight resolves (the DeepSpeed config file, an lr default lowered to the peak) comes back as a copy;
    the config it was made from is unchanged, and a name that is no field is refused."""
    config = RunConfig.from_dict(vars(parse_args(["--data-path", "d", "--min-lr", "1e-5"])))
    changed = config.replace(deepspeed_config="/shipped/zero2.json", min_lr=0.0)
    assert changed.deepspeed.deepspeed_config == "/shipped/zero2.json" and changed.optim.min_lr == 0.0
    assert config.deepspeed.deepspeed_config is None and config.optim.min_lr == 1e-5
    before, after = config.to_dict(), changed.to_dict()
    assert {k for k in before if before[k] != after[k]} == {"deepspeed_config", "min_lr"}
    # the groups not named are the very same objects
    assert changed.model is config.model and changed.data is config.data
    with pytest.raises(TypeError, match=r"not fields of a RunConfig: \['min_lrr'\]"):
        config.replace(min_lrr=0.0)
