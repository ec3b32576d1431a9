"""Values that mean nothing are refused before anything runs, in one line with exit 2: `vim-ds train`'s numeric
options outside their range (--lr 0 trained, --max-steps 0 meant no limit), an --input-size its model's patches do
not tile (the border was dropped), and a --num-classes that `vim-ds predict`/`export` cannot honour (a random head
was built and predicted classes the file never learned)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, config, error_line, run_train


def tiny_at(size: int, patch: int = 4, stride: int = 4) -> list[str]:
    return ["--model", "vim_tiny", "--input-size", str(size), "--model-kwargs", "depth=2", "embed_dim=32",
            f"patch_size={patch}", f"stride={stride}"]


# (refused options, the error after "vim-ds train: error: ", a valid neighbour of the refused value)
REFUSED = [
    (["--lr", "0"], "--lr must be > 0, got 0", ["--lr", "1e-6"]),
    (["--lr", "-0.5"], "--lr must be > 0, got -0.5", ["--lr", "0.5"]),  # as typed, not batch-scaled
    (["--min-lr", "-0.00001"], "--min-lr must be 0 or more, got -1e-05", ["--min-lr", "0"]),
    (["--max-steps", "0"], "--max-steps must be at least 1, got 0 (omit --max-steps for no limit)",
     ["--max-steps", "1"]),
    (["--max-steps", "-3"], "--max-steps must be at least 1, got -3 (omit --max-steps for no limit)",
     ["--max-steps", "3"]),
    (["--epochs", "-1"], "--epochs must be at least 1, got -1", ["--epochs", "1"]),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0", ["--batch-size", "1"]),
    (["--accum-steps", "0"], "--accum-steps must be at least 1, got 0", ["--accum-steps", "1"]),
    (["--warmup-epochs", "-0.5"], "--warmup-epochs must be 0 or more, got -0.5", ["--warmup-epochs", "0"]),
    (["--weight-decay", "-0.05"], "--weight-decay must be 0 or more, got -0.05", ["--weight-decay", "0"]),
    (["--clip-grad", "-1"], "--clip-grad must be 0 or more, got -1 (0 or omitted: no clipping)",
     ["--clip-grad", "0"]),
    (["--opt-betas", "0.9", "1"], "--opt-betas must be in [0, 1), got 0.9 1", ["--opt-betas", "0.9", "0.999"]),
    (["--smoothing", "1"], "--smoothing must be in [0, 1), got 1", ["--smoothing", "0.99"]),
    (["--smoothing", "-0.1"], "--smoothing must be in [0, 1), got -0.1", ["--smoothing", "0"]),
    (["--model-ema-decay", "0"], "--model-ema-decay must be in (0, 1], got 0", ["--model-ema-decay", "1"]),
    (["--model-ema-decay", "1.5"], "--model-ema-decay must be in (0, 1], got 1.5", ["--model-ema-decay", "0.5"]),
    (["--hflip", "1.5"], "--hflip must be between 0 and 1, got 1.5", ["--hflip", "1"]),
    (["--eval-crop-ratio", "0"], "--eval-crop-ratio must be in (0, 1], got 0", ["--eval-crop-ratio", "1"]),
    (["--nb-classes", "0"], "--nb-classes must be at least 1, got 0", ["--nb-classes", "1"]),
    (["--save-interval", "-1"], "--save-interval must be 0 or more, got -1 (0: none between epoch ends)",
     ["--save-interval", "0"]),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be 0 or more, got -1 (0 keeps all)",
     ["--keep-checkpoints", "0"]),
    # the patch grid: (input - patch) % stride == 0, patch size and stride from --model-kwargs or the variant
    (tiny_at(30), "--input-size 30 does not fit vim_tiny's patches (patch size 4, stride 4): the last 2 pixel rows "
     "and columns would be dropped; the nearest valid sizes are 28 or 32", tiny_at(28)),
    (tiny_at(30, patch=8, stride=4), "--input-size 30 does not fit vim_tiny's patches (patch size 8, stride 4): "
     "the last 2 pixel rows and columns would be dropped; the nearest valid sizes are 28 or 32", tiny_at(32, 8, 4)),
    (["--input-size", "200"], "--input-size 200 does not fit vim_tiny's patches (patch size 16, stride 16): the "
     "last 8 pixel rows and columns would be dropped; the nearest valid sizes are 192 or 208", ["--input-size", "208"]),
    (["--model", "vim_small_s8", "--input-size", "230"], "--input-size 230 does not fit vim_small_s8's patches "
     "(patch size 16, stride 8): the last 6 pixel rows and columns would be dropped; the nearest valid sizes are 224 "
     "or 232", ["--model", "vim_small_s8", "--input-size", "232"]),
    (["--input-size", "8"], "--input-size 8 is smaller than vim_tiny's patches (patch size 16, stride 16); the "
     "nearest valid size is 16", ["--input-size", "16"]),
]


@pytest.mark.parametrize("argv,message,neighbour", REFUSED, ids=[" ".join(c[0]) for c in REFUSED])
def test_train_refuses_a_meaningless_value_in_one_line(argv, message, neighbour, capsys):
    from vim_ds.cli.run_options import build_parser, parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"vim-ds train: error: {message}"]
    # the control: the neighbouring valid value is accepted as argparse read it
    dest = ("--input-size" if "--input-size" in argv else argv[0]).lstrip("-").replace("-", "_")
    assert getattr(parse_args(neighbour), dest) == getattr(build_parser().parse_args(neighbour), dest)


def test_the_unknown_model_is_left_to_the_model_factory():
    """No patch size to check against: the factory's "unknown model" error is the one the user sees."""
    from vim_ds.cli.run_options import parse_args

    assert parse_args(["--model", "no_such_vim", "--input-size", "30"]).input_size == 30


@pytest.mark.parametrize("lr", ["0", "-0.5"])
def test_a_training_run_with_a_meaningless_lr_stops_before_it_starts(digits, tmp_path, lr):
    """Before: --lr 0 trained 1 epoch at lr 0 (warmup still moved the weights); --lr -0.5 stopped after building
    the engine with "Invalid learning rate: -0.015625", the batch-scaled value nobody typed."""
    out = tmp_path / "out"
    proc = run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
                      "--deepspeed_config", config("zero0"), "--precision", "fp32", "--batch-size", "16", *TINY,
                      *QUIET_AUG, "--max-steps", "1", "--lr", lr], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [error_line(proc)] == [f"vim-ds train: error: --lr must be > 0, got {lr}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()  # refused before anything was written


# -- vim-ds predict / export: the head's class count ---------------------------------------------------------------

ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]


@pytest.fixture(scope="module")
def five_class_file(tmp_path_factory):
    """A published-format file ({"model": state_dict}) whose head classifies 5 classes, with no description."""
    import timm
    import torch

    import vim_ds  # noqa: F401  (registers the Vim variants)

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=5, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)
    path = str(tmp_path_factory.mktemp("heads") / "five.pth")
    torch.save({"model": model.state_dict()}, path)
    return path


def command(module: str, *argv) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)


def images_of(digits) -> list[str]:
    return [sorted(glob.glob(os.path.join(digits, "val", c, "*.png")))[0] for c in ("3", "7")]


def test_predict_refuses_a_class_count_the_head_does_not_have(five_class_file, digits):
    images = images_of(digits)
    proc = command("vim_ds.predict", *images, "--weights", five_class_file, "--num-classes", 10, *ARCH)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"vim-ds predict: error: {five_class_file} classifies 5 classes, --num-classes is 10: omit --num-classes "
        f"(or give 5)"]
    assert proc.stdout == ""
    # the controls: the head's own count, given or not, predicts with the file's head (the same, every run)
    given = command("vim_ds.predict", *images, "--weights", five_class_file, "--num-classes", 5, *ARCH)
    omitted = command("vim_ds.predict", *images, "--weights", five_class_file, *ARCH)
    assert given.returncode == omitted.returncode == 0, given.stderr[-3000:] + omitted.stderr[-3000:]
    lines = given.stdout.strip().splitlines()
    assert lines == omitted.stdout.strip().splitlines() and len(lines) == 2
    for image, line in zip(images, lines):
        classes = [entry.split()[0] for entry in line.split(": ", 1)[1].split(", ")]
        assert line.startswith(f"{image}: ") and sorted(classes) == ["0", "1", "2", "3", "4"], line


def test_export_refuses_a_class_count_the_head_does_not_have(five_class_file, tmp_path):
    out = tmp_path / "model.pt2"
    proc = command("vim_ds.export", "--weights", five_class_file, "--out", out, "--num-classes", 10, *ARCH)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"vim-ds export: error: {five_class_file} classifies 5 classes, --num-classes is 10: omit --num-classes "
        f"(or give 5)"]
    assert not out.exists()
    # the control: the head's own count exports a program with 5 logits
    proc = command("vim_ds.export", "--weights", five_class_file, "--out", out, "--num-classes", 5, *ARCH)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
