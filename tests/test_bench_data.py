"""`vim-ds data photos` (real-photo JPEGs at ImageNet's sizes) and `vim-ds bench data` (the input pipeline alone,
ours against timm's loader)."""
from __future__ import annotations

import json
import os
import re
import sys
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from vim_ds.cli import main as cli

import preloaded

REPO = Path(__file__).resolve().parent.parent
SIZES = [(500, 375), (375, 500)]
LAST_LINE = re.compile(r"^training pipeline: vim_ds (\d+\.\d) images/s per core, timm (\d+\.\d) images/s per core, "
                       r"ratio (\d+\.\d\d)$")


def write(out, seed, classes=2, per_class=3, val_per_class=1):
    rc = cli(["data", "photos", "--out", str(out), "--classes", str(classes), "--per-class", str(per_class),
              "--val-per-class", str(val_per_class), "--seed", str(seed),
              "--sizes", *(f"{w}x{h}" for w, h in SIZES)])
    assert rc == 0
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


def quantization_at(quality: int):
    buffer = BytesIO()
    Image.new("RGB", (64, 64), (120, 60, 200)).save(buffer, format="JPEG", quality=quality, subsampling="4:2:0")
    return Image.open(BytesIO(buffer.getvalue())).quantization


def test_photos_are_real_jpegs_of_the_stated_sizes_and_quality_and_deterministic(tmp_path):
    files = write(tmp_path / "a", seed=0)
    assert sorted(files) == [f"{split}/c{k:03d}/{split}_{i:05d}.jpg" for split, n in (("train", 3), ("val", 1))
                             for k in range(2) for i in range(n)]
    q90 = quantization_at(90)
    assert q90 != quantization_at(75)  # the quality check below can tell qualities apart
    for name, data in files.items():
        image = Image.open(BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB" and image.size in SIZES, (name, image.size)
        assert image.quantization == q90, name  # written at quality 90
        assert JpegImagePlugin.get_sampling(image) == 2, name  # 4:2:0, as most ImageNet files
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64)  # decodes
        # a photograph: varied, and smooth at the pixel scale (neighbours correlate), which noise is not
        assert pixels.std() > 20, name
        left, right = pixels[:, :-1].ravel(), pixels[:, 1:].ravel()
        assert np.corrcoef(left, right)[0, 1] > 0.8, name
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.float64)  # control for that check
    assert abs(np.corrcoef(noise[:, :-1].ravel(), noise[:, 1:].ravel())[0, 1]) < 0.2
    # the same seed writes the same bytes; another seed other images (each file differs)
    assert write(tmp_path / "b", seed=0) == files
    other = write(tmp_path / "c", seed=1)
    assert sorted(other) == sorted(files)
    assert all(other[name] != files[name] for name in files)


def test_photos_refuses_a_non_empty_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "x").write_text("mine")
    assert cli(["data", "photos", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not empty" in err and (tmp_path / "x").read_text() == "mine"


def run_bench(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return preloaded.run([sys.executable, "-m", "vim_ds.bench", "data", *args], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    assert cli(["data", "photos", "--out", str(root), "--classes", "2", "--per-class", "6",
                "--val-per-class", "3"]) == 0
    return root


def test_bench_runs_both_loaders_and_splits_the_time(photos, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench("--data-path", str(photos), "--workers", "1", "--batch-size", "4", "--batches", "2",
                     "--warmup-batches", "1", "--rounds", "1", "--sample", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    result = json.loads(out.read_text())
    train = result["train"]
    ours, timm = train["vim_ds"], train["timm"]
    # the printed line is the JSON's per-core rates and their ratio
    assert float(match.group(1)) == pytest.approx(ours["images_per_sec_per_core"], abs=0.051)
    assert float(match.group(2)) == pytest.approx(timm["images_per_sec_per_core"], abs=0.051)
    assert float(match.group(3)) == pytest.approx(train["ratio"], abs=0.0051)
    assert train["ratio"] == pytest.approx(ours["images_per_sec_per_core"] / timm["images_per_sec_per_core"])
    for kind, batch in (("train", 4), ("eval", 6)):  # the evaluation batch is 1.5x, as the trainer's
        for name in ("vim_ds", "timm"):
            r = result[kind][name]
            # the real loaders ran, each with its one worker process, and delivered the timed batches
            (row,) = r["loader"]
            assert row["worker_processes"] == 1 and row["images"] == 2 * batch, row
            assert row["images_per_sec"] > 0 and row["cpu_seconds"] > 0
            assert r["by_workers"]["1"]["images_per_cpu_second"] > 0
            stages = r["stages_ms"]
            expected = {"decode", "resize_crop", "to_tensor_normalize", "collate"}
            if kind == "train":
                expected |= {"augment", "random_erasing", "mixup"} | ({"seeding"} if name == "vim_ds" else set())
            assert set(stages) == expected, (kind, name, stages)
            for stage in ("decode", "resize_crop", "to_tensor_normalize"):
                assert stages[stage] > 0, (kind, name, stage)
            # the stages add up to the same images run untimed, step by step
            assert r["stages_sum_ms"] == pytest.approx(sum(stages.values()))
            assert 0.6 < r["stages_sum_ms"] / r["whole_ms"] < 1.5, (kind, name, r["stages_sum_ms"], r["whole_ms"])
            assert r["transfer_ms"] is not None
    # the same transform arguments: both run the recipe's RandAugment in the workers, hand over uint8 and
    # normalise and erase in the training process (ours since the uint8 hand-over, timm's with its prefetcher)
    assert "RandAugment" in ours["transform"] and "RandAugment" in timm["transform"]
    for r in (ours, timm):
        assert "RandomErasing" not in r["transform"] and "Normalize" not in r["transform"]
        assert r["in_training_process"] == ["Normalize", "RandomErasing"]
    assert result["settings"]["recipe"]["aa"] == "rand-m9-mstd0.5-inc1"


def test_bench_follows_the_train_options(photos, tmp_path):
    """--train-args shapes both pipelines: no RandAugment, no erasing, no Mixup."""
    out = tmp_path / "bench.json"
    proc = run_bench("--data-path", str(photos), "--workers", "1", "--batch-size", "4", "--batches", "1",
                     "--warmup-batches", "1", "--rounds", "1", "--sample", "4", "--no-eval", "--json", str(out),
                     "--train-args", "--aa none --reprob 0 --mixup 0 --cutmix 0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LAST_LINE.match(proc.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert "eval" not in result
    for name in ("vim_ds", "timm"):
        r = result["train"][name]
        assert "RandAugment" not in r["transform"] and "RandomErasing" not in r["transform"]
        assert r["in_training_process"] == ["Normalize"]
        assert "mixup" not in r["stages_ms"] and "random_erasing" not in r["stages_ms"]
    assert "ColorJitter" in result["train"]["vim_ds"]["transform"]  # timm uses colour jitter when aa is off


@pytest.mark.parametrize("problem", ["missing", "no_val"])
def test_bad_data_path_is_one_line_and_non_zero(tmp_path, problem, capsys):
    path = tmp_path / "nothing_here"
    if problem == "no_val":
        (path / "train" / "c000").mkdir(parents=True)
    assert cli(["bench", "data", "--data-path", str(path)]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("vim-ds bench data: error:") and str(path) in lines[0], lines
    assert ("does not exist" if problem == "missing" else "val is missing") in lines[0]
    assert captured.out == ""


def test_an_odd_batch_with_mixup_is_one_line_and_non_zero(photos, capsys):
    """The trainer's own refusal (Mixup mixes pairs), reported as the bench's one line."""
    assert cli(["bench", "data", "--data-path", str(photos), "--batch-size", "5", "--no-eval"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and lines[0].startswith("vim-ds bench data: error: Mixup/CutMix"), lines
