"""The Python example of docs/python_api.md runs as it is written (issue 53, item 1): a RunConfig made in code trains,
evaluates and saves, with no argv, and writes the record a command line with the same options writes."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

import preloaded
from train_utils import train_env

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "python_api.md"
HELPER = ROOT / "tests" / "doc_example.py"
# the example's options, as a command line gives them
SAME_OPTIONS = ["--model", "vim_tiny", "--input-size", "32", "--drop-path", "0", "--model-kwargs", "depth=2",
                "embed_dim=32", "patch_size=4", "stride=4", "--batch-size", "8", "--epochs", "1", "--max-steps", "3",
                "--lr", "1e-3", "--mixup", "0", "--cutmix", "0", "--reprob", "0", "--data-path", "data/digits",
                "--num_workers", "0", "--output_dir", "runs/digits"]


def test_the_helper_runs_only_the_python_blocks_at_their_lines():
    """The control of the helper: shell and output blocks are not run, and a python block keeps its page lines."""
    from doc_example import python_program

    page = "# t\n\n```bash\nexit 1\n```\n\n```python\nx = 1\n```\n```\nnot python\n```\n~~~python\ny = x\n~~~\n"
    program = python_program(page).split("\n")
    assert program[7] == "x = 1" and program[13] == "y = x"
    assert [line for line in program if line] == ["x = 1", "y = x"]


@pytest.mark.slow
def test_the_python_example_trains_evaluates_and_saves_as_written(digits, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    os.symlink(digits, tmp_path / "data" / "digits")  # what the page's `vim-ds data digits` writes
    proc = preloaded.run([sys.executable, str(HELPER), str(PAGE)], capture_output=True, text=True, cwd=tmp_path,
                         env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = tmp_path / "runs" / "digits"
    # trained 3 steps and evaluated them, then evaluated the saved checkpoint again
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert max(r["step"] for r in records if "loss" in r) == 3
    trained, again = [r for r in records if "eval_acc1" in r]
    assert trained["step"] == 3 and again["source"] == "runs/digits/checkpoints"
    assert again["eval_acc1"] == trained["eval_acc1"]
    assert again["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-3)
    assert (out / "checkpoints" / "global_step3").is_dir()
    # saved: the weights file vim_ds reads back, with the trained model's description
    from vim_ds.checkpoint.convert import read_vim_ds_meta

    meta = read_vim_ds_meta(str(out / "vim_digits.pth"))
    assert meta and meta["model"] == "vim_tiny" and meta["step"] == 3, meta
    # the record is the one the same options typed on the command line make
    from vim_ds.config import options_file
    from vim_ds.cli.run_options import parse_config

    monkeypatch.chdir(tmp_path)
    with open(out / "options.yaml") as f:
        assert yaml.safe_load(f) == options_file.record(parse_config(SAME_OPTIONS))
