"""What several commands share is defined once (issue 53, item 4): every model is built by the model description
(`models.ModelConfig.build`, the one caller of `timm.create_model` in vim_ds), every command's `--model-kwargs` is
the one declaration `config.run_config.MODEL_KWARGS`, and the evaluation batch (1.5 x the micro batch) and the
default micro batch (64) are `config.ds_config.eval_batch_size` and `DEFAULT_MICRO_BATCH`.

The checks read vim_ds's source (every function's body included); each is also run on a small fabricated package
that breaks it, so that a checker which finds nothing cannot pass."""
from __future__ import annotations

import ast
import pathlib

import pytest

from vim_ds.cli.run_options import argument_type
from vim_ds.config.ds_config import DEFAULT_MICRO_BATCH, eval_batch_size
from vim_ds.config.run_config import MODEL_KWARGS

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"
MODEL_DESCRIPTION = "models/factory.py"
EVAL_BATCH_RULE = "config/ds_config.py"


def sources(root: pathlib.Path = PACKAGE_DIR):
    """(path relative to root, its parsed module) of every module under `root`."""
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text(), str(path))


def create_model_calls(root: pathlib.Path = PACKAGE_DIR) -> list[str]:
    """`file:line` of every call of timm's `create_model` (as `timm.create_model(...)`, or imported by name)."""
    found = []
    for name, tree in sources(root):
        for node in ast.walk(tree):
            by_name = isinstance(node, ast.ImportFrom) and any(a.name == "create_model" for a in node.names)
            called = isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "create_model")
                or (isinstance(node.func, ast.Name) and node.func.id == "create_model"))
            if by_name or called:
                found.append(f"{name}:{node.lineno}")
    return found


def option_declarations(flag: str, root: pathlib.Path = PACKAGE_DIR) -> list[str]:
    """`file:line` of every call given the option `flag` as an argument, alone or in a tuple of flags
    (`add_argument("--x", ...)`, `run_config.option("--x", ...)`, `Option(("--x",), ...)`); an argv that passes the
    option on (a list built for a launcher) is not a call's argument."""
    def names_flag(arg) -> bool:
        items = arg.elts if isinstance(arg, (ast.Tuple, ast.List)) else [arg]
        return any(isinstance(item, ast.Constant) and item.value == flag for item in items)

    return [f"{name}:{node.lineno}" for name, tree in sources(root) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and any(map(names_flag, node.args))]


def eval_batch_rules(root: pathlib.Path = PACKAGE_DIR) -> list[str]:
    """`file:line` of every product with 1.5 (the evaluation batch rule) and of the micro batch default written
    out: `x or 64`, a `--batch-size` option with `default=64`."""
    found = []
    for name, tree in sources(root):
        for node in ast.walk(tree):
            times_1_5 = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and any(
                isinstance(side, ast.Constant) and side.value == 1.5 for side in (node.left, node.right))
            or_64 = isinstance(node, ast.BoolOp) and isinstance(node.values[-1], ast.Constant) and \
                node.values[-1].value == 64
            default_64 = isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and a.value == "--batch-size" for a in node.args) and any(
                k.arg == "default" and isinstance(k.value, ast.Constant) and k.value.value == 64 for k in node.keywords)
            if times_1_5 or or_64 or default_64:
                found.append(f"{name}:{node.lineno}")
    return found


def fabricated(tmp_path: pathlib.Path, files: dict) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_only_the_model_description_calls_timm_create_model(tmp_path):
    calls = create_model_calls()
    assert calls and all(call.startswith(MODEL_DESCRIPTION + ":") for call in calls), calls
    # negative control: a command building its model by itself, both spellings
    root = fabricated(tmp_path, {
        "demo.py": "def main():\n    import timm\n    return timm.create_model('vim_tiny')\n",
        "bench/model.py": "from timm import create_model\n\n\ndef child():\n    return create_model('vim_tiny')\n"})
    assert create_model_calls(root) == ["bench/model.py:1", "bench/model.py:5", "demo.py:3"]


def test_model_kwargs_is_declared_once_and_every_command_parses_it_so(capsys):
    declarations = option_declarations("--model-kwargs")
    assert len(declarations) == 1 and declarations[0].startswith("config/run_config.py:"), declarations
    from vim_ds.cli import bench, export, predict, run_options, zero_compare

    bench_parser = bench.build_parser()
    sub = next(a for a in bench_parser._actions if a.dest == "what").choices
    # each with the arguments it requires
    parsers = {"train": (run_options.build_parser(), []), "eval": (run_options.build_parser("vim-ds eval"), []),
               "predict": (predict.build_parser(), ["a.jpg", "--weights", "w.pth"]),
               "export": (export.build_parser(), ["--weights", "w.pth", "--out", "p.pt2"]),
               "zero-compare": (zero_compare.build_parser(), ["--model", "vim_tiny", "--out", "o"]),
               "bench train": (sub["train"], []), "bench split": (sub["split"], [])}
    for command, (parser, required) in parsers.items():
        action = next(a for a in parser._actions if "--model-kwargs" in a.option_strings)
        assert (action.type, action.nargs) == (argument_type(MODEL_KWARGS), MODEL_KWARGS.nargs), command
        # the same values from the same words
        args = parser.parse_args(required + ["--model-kwargs", "depth=2", "ssm_cfg={'d_conv': 3}", "name=x"])
        assert dict(args.model_kwargs) == {"depth": 2, "ssm_cfg": {"d_conv": 3}, "name": "x"}, command
        # and a malformed entry said in the same words by every command (argparse's own line, the cause in it)
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(required + ["--model-kwargs", "depth"])
        assert exit_info.value.code == 2, command
    assert "argument --model-kwargs: expected KEY=VALUE, got 'depth'" in capsys.readouterr().err


def test_a_second_model_kwargs_declaration_is_found(tmp_path):
    """Negative control of the count above: a command that declares the option itself."""
    root = fabricated(tmp_path, {
        "config/run_config.py": "MODEL_KWARGS = Option(('--model-kwargs',), nargs='*')\n",
        "predict.py": "def build_parser(p):\n    p.add_argument('--model-kwargs', nargs='*', default=None)\n"})
    assert option_declarations("--model-kwargs", root) == ["config/run_config.py:1", "predict.py:2"]


def test_the_eval_batch_rule_and_the_micro_batch_default_are_written_once(tmp_path):
    found = eval_batch_rules()
    assert len(found) == 1 and found[0] in [f"{EVAL_BATCH_RULE}:{line}" for line in _rule_lines()], found
    assert DEFAULT_MICRO_BATCH == 64
    # 1.5 x the micro batch, at least 1; no micro batch: the default's
    assert [eval_batch_size(m) for m in (1, 2, 4, 5, 64, None)] == [1, 3, 6, 7, 96, 96]
    # negative control: the rule and the default written out again
    root = fabricated(tmp_path, {"engine/evaluate.py": "batch = max(1, int(1.5 * (micro or 64)))\n",
                                 "bench/data.py": "p.add_argument('--batch-size', type=int, default=64)\n"})
    assert eval_batch_rules(root) == ["bench/data.py:1", "engine/evaluate.py:1", "engine/evaluate.py:1"]
    other = fabricated(tmp_path / "other", {"bench/x.py": "p.add_argument('--input-size', default=64)\n"})
    assert eval_batch_rules(other) == []  # a 64 of another option


def _rule_lines() -> range:
    """The lines of ds_config.eval_batch_size (the one place the rule is written)."""
    tree = ast.parse((PACKAGE_DIR / EVAL_BATCH_RULE).read_text())
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "eval_batch_size")
    return range(function.lineno, function.end_lineno + 1)


@pytest.mark.parametrize("name", ["vim_tiny", "deit_tiny_patch16_224"])
def test_none_rates_build_the_architectures_own_model(name):
    """drop/drop_path None (the benchmarks' and the demo's models): the model timm builds with no rates given,
    the same modules and the same initial weights."""
    import timm
    import torch

    from vim_ds.models import ModelConfig

    kwargs = dict(depth=2, embed_dim=32, patch_size=4) if name == "vim_tiny" else dict(depth=1, patch_size=8)
    torch.manual_seed(0)
    theirs = timm.create_model(name, img_size=32, num_classes=10, **kwargs)
    torch.manual_seed(0)
    ours = ModelConfig(name, 10, 32, kwargs, drop=None, drop_path=None).build()
    assert repr(ours) == repr(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    # a run's own rates still reach the model (a Vim's published stochastic depth is 0.1)
    if name == "vim_tiny":
        assert "DropPath" in repr(theirs) and "DropPath" not in repr(ModelConfig(name, 10, 32, kwargs).build())
