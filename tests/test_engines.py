"""The training engines' registry (vim_ds/config/training_engines.py, issue 53 item 3): --engine's choices are its
names, each engine's capabilities are what a run does with it (the option rules, the recorded options, the output
folder's checks, the precision and the build), and no module but the registry compares engine names (an AST walk,
with a negative control on a source text that does). In-process, no training run."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from vim_ds.config.training_engines import DEFAULT, ENGINES, baseline_names, training_engine

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"
REGISTRY = PACKAGE_DIR / "config" / "training_engines.py"


def _parse(*argv):
    from vim_ds.cli.run_options import parse_args

    return parse_args(list(argv))


def _refusal(capsys, *argv) -> str:
    """The one-line error `vim-ds train ARGV` exits 2 with."""
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_engine_choices_are_the_registry(capsys):
    from vim_ds.cli.run_options import build_parser
    from vim_ds.cli.zero_compare import build_parser as zero_compare_parser
    from vim_ds.config.run_config import OPTIONS

    (action,) = [a for a in build_parser("vim-ds train")._actions if "--engine" in a.option_strings]
    assert tuple(action.choices) == tuple(ENGINES) == OPTIONS["engine"].choices == ("deepspeed", "ddp", "fsdp")
    assert action.default == DEFAULT == "deepspeed" and _parse().engine == DEFAULT
    (baselines,) = [a for a in zero_compare_parser()._actions if "--baselines" in a.option_strings]
    assert list(baselines.choices) == baseline_names() == ["ddp", "fsdp"]
    assert "invalid choice: 'zero'" in _refusal(capsys, "--engine", "zero")
    with pytest.raises(ValueError) as error:
        training_engine("zero")
    assert str(error.value) == "unknown training engine 'zero': choose deepspeed, ddp, fsdp"


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_option_rules_follow_the_capabilities(name, capsys):
    """--model-ema's default, and the refusals of --resume, --save-interval, --model-ema, --compile and
    --sequence-parallel, come from the engine's capabilities (each one both ways across the registry)."""
    engine = ENGINES[name]
    assert _parse("--engine", name).model_ema is engine.keeps_ema
    checkpoints = [["--resume", "auto"], ["--save-interval", "5"]]
    for argv, can in [*((a, engine.saves_checkpoints) for a in checkpoints), (["--model-ema"], engine.keeps_ema)]:
        if can:
            _parse("--engine", name, *argv)
        else:
            assert _refusal(capsys, "--engine", name, *argv) == (
                f"vim-ds train: error: --engine {name} is a measurement baseline: it saves no checkpoints and keeps "
                f"no EMA; drop {argv[0]}")
    if engine.compiles:
        assert _parse("--engine", name, "--compile").compile
    else:
        assert _refusal(capsys, "--engine", name, "--compile") == (
            f"vim-ds train: error: --compile goes through DeepSpeed's engine.compile(); --engine {name} does not "
            f"have it")
    if engine.splits_sequence:
        assert _parse("--engine", name, "--sequence-parallel", "2").sequence_parallel == 2
    else:
        assert f"drop --engine {name}" in _refusal(capsys, "--engine", name, "--sequence-parallel", "2")


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_record_and_the_output_folder_follow_the_capabilities(name, tmp_path):
    """options.yaml records --model-ema as derived (null) where it is the engine's default, and the output folder's
    checkpoints/ is checked only for an engine that saves checkpoints (here: a file in its place)."""
    from vim_ds.config import options_file
    from vim_ds.config.run_config import RunConfig
    from vim_ds.engine import output_dir

    engine = ENGINES[name]
    (tmp_path / "checkpoints").write_text("not a folder")
    config = RunConfig.from_dict(vars(_parse("--engine", name, "--output_dir", str(tmp_path))))
    assert options_file.record(config)["model_ema"] is None
    if engine.keeps_ema:
        off = RunConfig.from_dict(vars(_parse("--engine", name, "--no-model-ema")))
        assert options_file.record(off)["model_ema"] is False
    problem = output_dir.check(config)
    assert (problem == f"{tmp_path / 'checkpoints'} is a file, not a folder; move it away or give another "
                       f"--output_dir") if engine.saves_checkpoints else problem is None


def test_the_precision_rules_and_the_build():
    """DeepSpeed runs every --precision as asked, in its dtype; a baseline keeps fp32 parameters (bf16 as autocast)
    and refuses fp16. `build` gives the DDP baseline its engine: the bare model in a world of one."""
    from vim_ds.config.ds_config import prepare_ds_config
    from vim_ds.models import param_groups
    from vim_ds.runtime.baselines import DDPEngine

    deepspeed, ddp, fsdp = (ENGINES[n] for n in ("deepspeed", "ddp", "fsdp"))
    assert deepspeed.runs_precision("fp16") == "fp16" and deepspeed.param_dtype("bf16") == torch.bfloat16
    for baseline in (ddp, fsdp):
        assert baseline.runs_precision("bf16") == "fp32+autocast-bf16" and baseline.param_dtype("bf16") == torch.float32
        with pytest.raises(ValueError, match="fp16"):
            baseline.runs_precision("fp16")
    ds = prepare_ds_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=1, device_type="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    engine, scheduler, compiled = ddp.build(model, param_groups(model, 0.05), ds, torch.device("cpu"),
                                            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), None)
    assert type(engine) is DDPEngine and engine.wrapped is engine.module is model and compiled is None
    assert scheduler is engine.scheduler and engine.optimizer.param_groups[0]["weight_decay"] == 0.05


# -- no engine names compared outside the registry -----------------------------------------------------------------

NAMES = frozenset(ENGINES)


def _literal_names(node: ast.AST) -> set[str]:
    """The engine names `node` is, or (a tuple, list or set literal: an `in` test) holds."""
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and v.value in NAMES}


def _launcher(node: ast.AST) -> bool:
    """`launcher` (a variable or attribute): the `deepspeed` launcher script, which shares DeepSpeed's name."""
    return getattr(node, "id", getattr(node, "attr", None)) == "launcher"


def engine_name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, names) of every comparison in `source` of a string literal that is an engine name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set().union(*map(_literal_names, operands))
        if names and not any(map(_launcher, operands)):
            found.append((node.lineno, ", ".join(sorted(names))))
    return found


def test_the_check_finds_a_comparison_of_engine_names():
    """The negative control: each way of comparing a name is found; a launcher's name, a version lookup and a
    mapping's keys are not comparisons of engines."""
    source = '\n'.join([
        'if args.engine == "deepspeed": pass',
        'ok = kind in ("ddp", "fsdp")',
        'ok = "fsdp" != row.get("engine")',
        'ok = r.get("engine", "x") not in ["ddp"]',
        'if launcher == "deepspeed": pass',
        'v = _version("deepspeed")',
        'what = {"ddp": 1}',
    ])
    assert engine_name_comparisons(source) == [(1, "deepspeed"), (2, "ddp, fsdp"), (3, "fsdp"), (4, "ddp")]


def test_no_module_but_the_registry_compares_engine_names():
    found = {str(path.relative_to(PACKAGE_DIR.parent)): hits for path in sorted(PACKAGE_DIR.rglob("*.py"))
             if path != REGISTRY and (hits := engine_name_comparisons(path.read_text()))}
    assert found == {}, "ask the engine (vim_ds/config/training_engines.py) what it can do instead"
