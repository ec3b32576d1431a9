"""Broken training data in real single-process training runs: truncated JPEG/PNG files, non-images, an empty
class folder, files deleted while the run reads them, and too many of them. Each bad file is skipped, counted
(metrics.jsonl `bad_images`) and named in the log; past --max-bad-images the run stops with one line and exit 1.
(An empty class folder in train/ stops the run before training: tests/test_train_errors.py.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from PIL import Image

from data_options import dataset_config
from train_utils import QUIET_AUG, ROOT, TINY, config, error_line, records, run_train

PER_CLASS = {"train": 12, "val": 3}  # 120 training images: 15 steps of 8 per epoch, every image read each epoch


@pytest.fixture
def small(digits, tmp_path):
    """A copy of the first images of each digits class (a data set small enough for several runs)."""
    root = tmp_path / "data"
    for split, n in PER_CLASS.items():
        for cls in sorted(os.listdir(os.path.join(digits, split))):
            os.makedirs(root / split / cls)
            for name in sorted(os.listdir(os.path.join(digits, split, cls)))[:n]:
                shutil.copy(os.path.join(digits, split, cls, name), root / split / cls / name)
    return root


def train_args(data, out, *extra):
    return ["--data-set", "folder", "--data-path", data, "--output_dir", out, "--deepspeed_config", config("zero0"),
            "--precision", "fp32", "--batch-size", "8", "--no-repeated-aug", "--no-model-ema", "--warmup-epochs", "0",
            "--log-interval", "1", *TINY, *QUIET_AUG, *extra]


def bad_images(out) -> int:
    return [r for r in records(out) if "bad_images" in r][-1]["bad_images"]


def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow  # a real training run: 16 s on 2 busy cores (pytest --durations)
def test_broken_files_are_skipped_counted_and_named(small, tmp_path):
    # each broken file replaces a good one: 120 training images, all read in the one epoch
    jpeg = small / "train" / "1" / "photo.jpg"  # a real JPEG (a digit, enlarged so the scan data dominates)
    first_png = sorted((small / "train" / "1").glob("*.png"))[0]
    Image.open(first_png).convert("RGB").resize((64, 64)).save(jpeg, quality=95)
    first_png.unlink()
    cut_in_half(jpeg)
    png = sorted((small / "train" / "2").glob("*.png"))[0]
    cut_in_half(png)
    text_jpg = small / "train" / "3" / "scan.jpg"
    sorted((small / "train" / "3").glob("*.png"))[0].unlink()
    text_jpg.write_text("this is not an image\n")
    (small / "train" / "4" / "notes.txt").write_text("labelled by hand\n")
    for f in (small / "val" / "9").iterdir():  # an empty validation class folder
        f.unlink()

    out = tmp_path / "out"
    proc = run_train(train_args(small, out, "--epochs", "1", "--num_workers", "0", "--max-bad-images", "0.05"))
    for bad in (jpeg, png, text_jpg):
        assert f"cannot decode {bad}" in proc.stderr, proc.stderr[-3000:]
    assert bad_images(out) == 3  # one epoch: each file was read once
    ignored = [line for line in proc.stderr.splitlines() if "without an image extension" in line]
    assert len(ignored) == 1 and "ignored 1 file(s)" in ignored[0] and "notes.txt" in ignored[0], proc.stderr
    empty = [line for line in proc.stderr.splitlines() if "has no image files" in line]
    assert len(empty) == 1 and str(small / "val" / "9") in empty[0], proc.stderr
    assert "validation top-1" in proc.stdout
    # what train_args asks besides (tests/README.md, the option audit): no EMA (--no-model-ema), a log line for
    # every step (--log-interval 1; the default prints every 10th and the last)
    assert not any("ema_eval_acc1" in r for r in records(out)) and ", EMA " not in proc.stdout
    assert all(f" step {n}/15 " in proc.stdout for n in range(1, 16)), proc.stdout[-3000:]

    # the empty validation folder keeps its class index, and the classes after it theirs (no silent shift)
    from vim_ds.data import build_dataset

    val, num_classes = build_dataset(dataset_config(data_set="folder", data_path=str(small), input_size=32),
                                     is_train=False)
    assert num_classes == 10 and val.class_to_idx == {str(c): c for c in range(10)}
    assert sorted(set(val.targets)) == list(range(9))


@pytest.mark.slow
def test_files_deleted_during_the_run_are_skipped_with_two_workers(small, tmp_path):
    """A real run with 2 data-loader workers; 12 images are deleted once the first step is logged (the workers
    hold the file list already): the next epoch reads every one of them."""
    doomed = [sorted((small / "train" / str(c)).glob("*.png"))[i] for c in range(10) for i in (0, 5)][:12]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vim_ds.train", *map(str, train_args(small, out, "--epochs", "2", "--num_workers",
                                                                      "2", "--max-bad-images", "0.5"))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 240
        while not (os.path.exists(out / "metrics.jsonl") and '"loss"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        for f in doomed:
            f.unlink()
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    named = {line.split("cannot decode ")[1].split(" (")[0] for line in stderr.splitlines() if "cannot decode" in line}
    assert named and named <= {str(f) for f in doomed}, named
    assert "the file is gone" in stderr
    assert len(doomed) <= bad_images(out) <= 2 * len(doomed)  # all of them in epoch 2, some already in epoch 1
    assert any(r["step"] == 30 for r in records(out) if "loss" in r)


@pytest.mark.slow  # a real training run: 40 s on 2 busy cores (pytest --durations)
def test_too_many_bad_images_stop_the_run_with_one_line(small, tmp_path):
    for c in range(10):
        for f in sorted((small / "train" / str(c)).glob("*.png"))[:2]:  # 20 of 120: 17 %
            cut_in_half(f)
    out = tmp_path / "out"
    proc = run_train(train_args(small, out, "--epochs", "1", "--num_workers", "0", "--max-bad-images", "0.1"),
                     check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert "20 of 120 training images" in line and "--max-bad-images 0.1" in line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_rank_whose_validation_loader_stalls_ends_the_job_with_one_line(tmp_path):
    """Rank 1's validation worker blocks for good at its first sample (as a read from a hung file system does)
    while rank 0 waits for it in the evaluation's all-reduce: the job ends after --data-timeout with a line that
    names the loader, not after --dist-timeout (300 s here) and not never."""
    args = ["--data-set", "synthetic", "--synthetic-size", "64", "--nb-classes", "10", "--deepspeed_config",
            config("zero0"), "--precision", "fp32", "--batch-size", "8", "--max-steps", "2", "--num_workers", "1",
            "--no-model-ema", "--warmup-epochs", "0", *TINY, *QUIET_AUG, "--dist-timeout", "300",
            "--data-timeout", "20"]
    t0 = time.monotonic()
    proc = run_train(args, nproc=2, launcher="deepspeed", check=False, timeout=280,
                     env={"VIM_DS_INJECT": "stall_val@1:1"})
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert elapsed < 200, f"{elapsed:.0f} s"
    lines = [line for line in proc.stderr.splitlines() if "data loader delivered no batch" in line]
    assert lines and lines[0].startswith("vim-ds train: error (rank 1): the val data loader delivered no batch in "
                                         "20 s (--data-timeout)"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
