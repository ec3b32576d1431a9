"""A run's configuration from its sources (issue 53, item 1): the fields' defaults, a --config file, what was typed,
or code; resolved as the RunConfig is made (run_config.resolution), checked by run_rules.validate with the command
line's one-line errors; and what today's code recorded before this change (an options.yaml, a checkpoint's `args`,
tests/fixtures/before_issue53/) read by it. In-process: no run is started."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vim_ds.cli.run_options import parse_args, parse_config
from vim_ds.config import options_file
from vim_ds.config.run_config import DataOptions, ModelOptions, OptimOptions, RunConfig, RunOptions, derived
from vim_ds.config.run_rules import validate

BEFORE = Path(__file__).resolve().parent / "fixtures" / "before_issue53"
# options vim-ds train gained after the fixture was written (none of them recorded in an options.yaml)
ADDED_SINCE = {"profile_steps"}
# the command line of the run that wrote BEFORE's files (its README)
BEFORE_ARGV = ["--data-path", "/tmp/c53/digits", "--model", "vim_tiny", "--input-size", "32", "--model-kwargs",
               "depth=2", "embed_dim=32", "patch_size=4", "stride=4", "--drop-path", "0", "--mixup", "0", "--cutmix",
               "0", "--reprob", "0", "--batch-size", "8", "--max-steps", "2", "--epochs", "1", "--lr", "1e-3",
               "--clip-grad", "5", "--deepspeed_config", "zero1", "--precision", "fp32", "--output_dir",
               "/tmp/c53/run_before", "--num_workers", "0", "--seed", "3"]


def test_a_config_made_in_code_is_the_command_lines_run():
    """`RunConfig()` with a model and a data path is what `vim-ds train --model M --data-path D` runs: --model-ema
    on (None before), the data timeout derived, the lr floor's defaults known, nothing refused."""
    config = RunConfig(model=ModelOptions(model="vim_small"), data=DataOptions(data_path="d"))
    assert config.model.model_ema is True and config.data.data_timeout == 120
    assert config.optim.lr_defaults == ("min_lr", "warmup_lr") and config.optim.given == ()
    assert validate(config) is None
    assert config == parse_config(["--model", "vim_small", "--data-path", "d"])
    assert config.to_dict() == vars(parse_args(["--model", "vim_small", "--data-path", "d"]))
    # variants: each derived value follows the options it derives from, as on the command line
    for argv, values in {("--engine", "ddp"): {"engine": "ddp"},
                         ("--dist-timeout", "60"): {"dist_timeout": 60.0},
                         ("--deepscale_config", "zero1"): {"deepscale_config": "zero1"},
                         ("--model-kwargs", "depth=2", "--opt-betas", "0.8", "0.9"):
                             {"model_kwargs": [("depth", 2)], "opt_betas": [0.8, 0.9]}}.items():
        assert RunConfig.from_dict(values) == parse_config(list(argv)), argv
    assert RunConfig(run=RunOptions(engine="ddp")).model.model_ema is False
    assert RunConfig.from_dict({"dist_timeout": 60}).data.data_timeout == 30
    assert RunConfig.from_dict({"deepscale_config": "zero1"}).deepspeed.deepspeed_config == "zero1"
    # a value given stays as given, and a copy resolves only what the change left to resolve
    assert RunConfig(model=ModelOptions(model_ema=False)).model.model_ema is False
    assert config.replace(engine="ddp").model.model_ema is True
    assert config.replace(engine="ddp", model_ema=None).model.model_ema is False


def test_what_was_given_is_recorded_where_the_sources_meet(tmp_path):
    """--min-lr typed as its default is given (a floor above the peak lr is then refused, not lowered); the same
    value in a --config file or set in code is the default (a run's options.yaml records every option), unless
    code marks it explicit. `given` (what a DeepSpeed config must agree with) follows the same rule."""
    assert parse_config(["--min-lr", "1e-5"]).optim.lr_defaults == ("warmup_lr",)
    assert parse_config(["--min-lr", "1e-5"]).optim.given == ()
    assert parse_config(["--clip-grad", "1", "--lr", "5e-4"]).optim.given == ("lr", "clip_grad")
    path = tmp_path / "mine.yaml"
    path.write_text("min_lr: 1.0e-05\nlr: 5.0e-4\nweight_decay: 0.1\n")
    from_file = parse_config(["--config", str(path)])
    assert from_file.optim.lr_defaults == ("min_lr", "warmup_lr") and from_file.optim.given == ("weight_decay",)
    # the command line wins over the file, and what it typed counts even where it repeats the default
    typed = parse_config(["--config", str(path), "--lr", "5e-4", "--warmup-lr", "1e-6"])
    assert typed.optim.lr_defaults == ("min_lr",) and typed.optim.given == ("lr", "weight_decay")
    in_code = RunConfig(optim=OptimOptions(min_lr=1e-5, weight_decay=0.1))
    assert in_code.optim.lr_defaults == ("min_lr", "warmup_lr") and in_code.optim.given == ("weight_decay",)
    marked = RunConfig(optim=OptimOptions(min_lr=1e-5), explicit={"min_lr", "lr"})
    assert marked.optim.lr_defaults == ("warmup_lr",) and marked.optim.given == ("lr",)


# (command line, the same options set in code): each breaks one rule, refused in the same words either way
BROKEN = [
    (["--lr", "0"], {"lr": 0.0}),
    (["--deepscale_config", "a", "--deepspeed_config", "b"], {"deepscale_config": "a", "deepspeed_config": "b"}),
    (["--dist-timeout", "0"], {"dist_timeout": 0.0}),
    (["--data-timeout", "700"], {"data_timeout": 700.0}),
    (["--dist-timeout", "100", "--data-timeout", "100"], {"dist_timeout": 100.0, "data_timeout": 100.0}),
    (["--finetune", "a", "--init-weights", "b"], {"finetune": "a", "init_weights": "b"}),
    (["--engine", "ddp", "--resume", "auto", "--model-ema"], {"engine": "ddp", "resume": "auto", "model_ema": True}),
    (["--sequence-parallel", "2", "--grad-checkpointing"], {"sequence_parallel": 2, "grad_checkpointing": True}),
    (["--engine", "fsdp", "--compile"], {"engine": "fsdp", "compile": True}),
    (["--input-size", "200"], {"input_size": 200}),
]


@pytest.mark.parametrize("argv,values", BROKEN, ids=[" ".join(case[0]) for case in BROKEN])
def test_a_rule_is_said_in_the_same_line_for_the_command_line_and_for_code(argv, values, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert said == [f"vim-ds train: error: {validate(RunConfig.from_dict(values))}"]


def test_a_config_made_in_code_is_refused_by_run_in_one_line(capsys, tmp_path):
    """engine/run.run checks a config made in code as the command line would have, before anything starts (no
    output folder); a choice the parser would have refused is said too. Control: the valid neighbour passes the
    same check."""
    from vim_ds.engine.run import run

    out = tmp_path / "out"
    assert run(RunConfig(run=RunOptions(engine="ddp", save_interval=5, output_dir=str(out)))) == 2
    assert capsys.readouterr().err == ("vim-ds train: error (rank 0): --engine ddp is a measurement baseline: it "
                                       "saves no checkpoints and keeps no EMA; drop --save-interval\n")
    assert not out.exists()
    assert validate(RunConfig(run=RunOptions(engine="dp"))) == "--engine 'dp' is not one of deepspeed, ddp, fsdp"
    assert validate(RunConfig(run=RunOptions(engine="ddp", save_interval=0))) is None


def test_an_options_yaml_written_before_the_change_reads_and_resumes_the_same(tmp_path):
    """The record of a run trained by the code before issue 53 (BEFORE_ARGV): the same command line records the
    same bytes now; `--config` of the record gives the very options its checkpoint recorded (model_ema and
    data_timeout derived again from its nulls, lr defaults and `given` as that run had them) and records the same
    values (a file's whole numbers read as the float options they are, `5.0`, as before), and a resume with them
    adds no segment to it. Its checkpoint's `args` read as a RunConfig too."""
    import yaml

    path = tmp_path / "options.yaml"
    options_file.write(str(path), options_file.record(parse_config(BEFORE_ARGV)))
    assert path.read_bytes() == (BEFORE / "options.yaml").read_bytes()
    recorded = torch.load(BEFORE / "checkpoint_args.pt", weights_only=True)["args"]
    config = parse_config(["--config", str(BEFORE / "options.yaml")])
    # what differs by construction: the file named (--config), and the DeepSpeed config, which the checked config
    # holds as the path it resolved (the record keeps the shipped name, `zero1`)
    others = ("config", "deepspeed_config")
    # options added since the record was written (ADDED_SINCE) take their defaults; every other one is the record's
    now, defaults = config.to_dict(), RunConfig().to_dict()
    assert set(now) - set(recorded) == ADDED_SINCE and all(now[k] == defaults[k] for k in ADDED_SINCE)
    assert {k: v for k, v in now.items() if k not in others and k not in ADDED_SINCE} == \
           {k: v for k, v in recorded.items() if k not in others}
    assert {k: v for k, v in RunConfig.from_dict(recorded).to_dict().items() if k not in ADDED_SINCE} == recorded
    assert options_file.record(config) == yaml.safe_load((BEFORE / "options.yaml").read_text())
    # a resume of that run: the same options leave its record as it is
    shutil.copy(BEFORE / "options.yaml", path)
    assert options_file.write_run(str(path), options_file.record(config), step=2) is None
    assert path.read_bytes() == (BEFORE / "options.yaml").read_bytes()


def test_the_record_nulls_what_the_config_derives():
    """options_file.record writes a derived option as null where it holds run_config.derived's value, so that
    `--config` of the record derives it again (another --engine: no EMA); a value given otherwise is kept."""
    config = RunConfig()
    assert derived(config) == {"model_ema": True, "data_timeout": 120}
    record = options_file.record(config)
    assert record["model_ema"] is None and record["data_timeout"] is None
    kept = options_file.record(RunConfig(model=ModelOptions(model_ema=False), data=DataOptions(data_timeout=30)))
    assert kept["model_ema"] is False and kept["data_timeout"] == 30
