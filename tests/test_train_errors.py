"""Bad input to `vim-ds train`: each is a one-line cause on stderr and a non-zero exit, and nothing is lost.
Single-process runs of the real trainer on real files."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from train_utils import QUIET_AUG, TINY, config, error_line, records, run_train

pytestmark = pytest.mark.slow




def train(data, out, *extra, check=False, cfg="zero0"):
    return run_train(["--data-set", "folder", "--data-path", data, "--output_dir", str(out), "--num_workers", "0",
                      "--deepspeed_config", config(cfg) if not str(cfg).endswith(".json") else cfg,
                      "--precision", "fp32", "--batch-size", "16", *TINY, *QUIET_AUG, *extra], check=check)


def assert_one_line_error(proc, *words, code=2):
    """docs/training.md's contract: bad input exits 2 (a run that failed while training exits 1)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    line = error_line(proc)
    assert line, proc.stderr[-3000:]
    for word in words:
        assert word in line, line
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_missing_data_path(tmp_path):
    proc = train(str(tmp_path / "nowhere"), tmp_path / "out", "--max-steps", "1")
    assert_one_line_error(proc, "nowhere")


def test_missing_split(digits, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    shutil.rmtree(data / "val")
    proc = train(str(data), tmp_path / "out", "--max-steps", "1")
    assert_one_line_error(proc, str(data / "val"), "is missing")
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # nothing started


def test_fp16_on_cpu_is_refused_in_one_line(digits, tmp_path):
    proc = train(digits, tmp_path / "out", "--max-steps", "1", "--precision", "fp16", cfg="zero2_fp16")
    assert_one_line_error(proc, "fp16 is not supported by DeepSpeed on CPU",
                          "use --precision bf16, autocast-bf16 or fp32")


def test_empty_class_folder(digits, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    os.makedirs(data / "train" / "zz_empty")
    proc = train(str(data), tmp_path / "out", "--max-steps", "1")
    assert_one_line_error(proc, "zz_empty")


def test_invalid_config_and_batch_sizes_fail_before_training(digits, tmp_path):
    base = json.load(open(config("zero0")))
    bad_key = tmp_path / "bad_key.json"
    json.dump({**base, "zero_optimisation": {"stage": 1}}, open(bad_key, "w"))
    proc = train(digits, tmp_path / "a", "--max-steps", "1", cfg=str(bad_key))
    assert_one_line_error(proc, "zero_optimisation")

    not_json = tmp_path / "broken.json"
    not_json.write_text('{"train_batch_size": 16,,}')
    assert_one_line_error(train(digits, tmp_path / "b", "--max-steps", "1", cfg=str(not_json)), "broken.json")

    batches = tmp_path / "batches.json"
    json.dump({**base, "train_batch_size": 100}, open(batches, "w"))
    proc = train(digits, tmp_path / "c", "--max-steps", "1", cfg=str(batches))
    assert_one_line_error(proc, "100")
    assert not os.path.exists(tmp_path / "c" / "metrics.jsonl")  # nothing started


def test_unreadable_images_are_skipped_below_one_percent_and_fail_above(digits, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    files = sorted((data / "train" / "3").iterdir())
    for f in files[:4]:  # 4 of 1437 training images: 0.3 %
        f.write_bytes(b"")
    proc = train(str(data), tmp_path / "ok", "--max-steps", "89", "--batch-size", "16", "--no-model-ema",
                 "--no-repeated-aug", check=True)  # one epoch without repeats: almost every image is read once
    assert "cannot decode" in proc.stderr and str(files[0]) in proc.stderr
    steps = [r for r in records(tmp_path / "ok") if "bad_images" in r]
    assert steps[-1]["step"] == 89
    assert 1 <= steps[-1]["bad_images"] <= 4

    for f in sorted((data / "train" / "5").iterdir())[:30]:  # now 34 bad: 2.4 %
        f.write_bytes(b"not an image")
    proc = train(str(data), tmp_path / "bad", "--max-steps", "89", "--batch-size", "16", "--no-model-ema",
                 "--no-repeated-aug")
    assert_one_line_error(proc, "did not decode", code=1)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(digits, tmp_path):
    out = tmp_path / "out"
    proc = train(digits, out, "--max-steps", "50", "--save-interval", "1", "--lr", "1e9", "--unscale-lr",
                 "--warmup-epochs", "0", "--keep-checkpoints", "0")
    assert_one_line_error(proc, "loss is", "at step", code=1)
    steps = [r["step"] for r in records(out) if "loss" in r]
    bad_step = int(error_line(proc).split(" at step ")[1].split()[0])
    save_dir = out / "checkpoints"
    latest = (save_dir / "latest").read_text().strip()
    assert latest == f"global_step{bad_step - 1}", (latest, bad_step, steps)
    assert (save_dir / latest / "vim_ds_complete.json").is_file()
    assert not (save_dir / f"global_step{bad_step}").exists()
    assert str(save_dir / latest) in error_line(proc)


def test_eval_refuses_weights_for_another_class_count(digits, tmp_path):
    """Loading would reset the head (right for --finetune); for --eval it would score a random classifier."""
    import timm
    import torch

    import vim_ds  # noqa: F401

    model = timm.create_model("vim_tiny", num_classes=1000, img_size=32, depth=2, embed_dim=32, patch_size=4,
                              stride=4)
    path = tmp_path / "imagenet_head.pth"
    torch.save({"model": model.state_dict()}, path)
    proc = run_train(["--data-set", "folder", "--data-path", digits, "--num_workers", "0", *TINY,
                      "--resume", str(path)], module="vim_ds.eval", check=False)
    assert_one_line_error(proc, "1000 classes", "10")
