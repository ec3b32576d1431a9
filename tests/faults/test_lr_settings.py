"""Learning-rate settings that contradict each other (issue 36, item 2): a floor (--min-lr) or, with a warmup, a
warmup start (--warmup-lr) above the peak lr, after the batch scaling (or the DeepSpeed config's own number), made
the lr rise over the run. A value given is refused before the process group starts, in one line naming the values
and the fix, and nothing is written; the built-in default floor, which a small batch scales the lr below, is
lowered to the peak with a note. Real runs of the trainer (one rank) on synthetic images."""
from __future__ import annotations

import json

import pytest
import torch

from faults.test_one_line_causes import only_error_line
from train_utils import QUIET_AUG, TINY, config, records, run_train


def args(out, *extra) -> list:
    """32 synthetic images, micro batch 4: 8 steps per epoch, a global batch of 4 (the lr 5e-4 x 4 / 512)."""
    return ["--data-set", "synthetic", "--synthetic-size", 32, "--nb-classes", 4, *TINY, *QUIET_AUG,
            "--num_workers", 0, "--deepspeed_config", config("zero0"), "--precision", "fp32", "--batch-size", 4,
            "--epochs", 1, "--no-model-ema", "--output_dir", out, *extra]


PEAK = "--lr 0.0005 x global batch 4 / 512"


def _json_with_lr(path, lr: float) -> str:
    with open(config("zero0")) as f:
        data = json.load(f)
    data["optimizer"]["params"]["lr"] = lr
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("case", ["floor", "floor typed as the default", "warmup start", "JSON lr"])
def test_a_floor_or_warmup_start_above_the_peak_is_refused_before_anything_is_written(tmp_path, case):
    out = tmp_path / "run"
    if case == "floor":  # the issue's: the lr rose from the peak to 1 over the run
        extra, expected = ["--min-lr", 1], (
            f"--min-lr 1 is above the peak lr 3.90625e-06 ({PEAK}): the cosine schedule would raise the lr to it "
            f"over the run; give --min-lr at most 3.90625e-06 (e.g. --min-lr 0), or a larger --lr (or --unscale-lr "
            f"to use --lr as it is)")
    elif case == "floor typed as the default":  # typed, so chosen: refused (the default is lowered, see below)
        extra, expected = ["--min-lr=1e-5"], f"--min-lr 1e-05 is above the peak lr 3.90625e-06 ({PEAK})"
    elif case == "warmup start":
        extra, expected = ["--warmup-lr", 1e-4, "--warmup-epochs", 0.5, "--min-lr", 0], (
            f"--warmup-lr 0.0001 is above the peak lr 3.90625e-06 ({PEAK}): the warmup would lower the lr to the "
            f"peak instead of raising it; give --warmup-lr at most 3.90625e-06 (or --warmup-epochs 0 for no "
            f"warmup), or a larger --lr")
    else:  # the variant: a number in the DeepSpeed config wins over --lr's default (and its scaling); a --lr given
        # as well would have to agree with it (issue 50, item 7: tests/test_ds_config.py)
        json_file = _json_with_lr(tmp_path / "lr.json", 1e-4)
        extra, expected = ["--deepspeed_config", json_file, "--min-lr", 2e-4], (
            f"--min-lr 0.0002 is above the peak lr 0.0001 (optimizer.params.lr in {json_file}, which wins over "
            f"--lr): the cosine schedule would raise the lr to it over the run; give --min-lr at most 0.0001 (e.g. "
            f"--min-lr 0), or a larger optimizer.params.lr in {json_file}")
    proc = run_train(args(out, *extra), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = only_error_line(proc)
    assert line.startswith(f"vim-ds train: error (rank 0): {expected}"), line
    assert not out.exists()  # refused before anything was written


def test_the_default_floor_above_a_small_batch_lr_is_lowered_to_the_peak_and_the_lr_never_rises(tmp_path):
    """The control that a valid setting trains, too: the defaults (--min-lr 1e-5) with a global batch of 4 (the
    peak 3.9e-6) train 4 steps, with a note, at a constant lr (the floor is the peak) where the lr used to rise."""
    out = tmp_path / "run"
    proc = run_train(args(out, "--max-steps", 4, "--warmup-epochs", 0))
    assert (f"note: the default --min-lr 1e-05 is above this run's peak lr 3.90625e-06 ({PEAK}): the floor is "
            f"lowered to 3.90625e-06, so the lr never rises; give --min-lr to choose it (e.g. --min-lr 0)"
            in proc.stdout), proc.stdout[-2000:]
    lrs = [r["lr"] for r in records(out) if "loss" in r and "summary" not in r]
    assert len(lrs) == 4 and all(lr == pytest.approx(5e-4 * 4 / 512, rel=1e-12) for lr in lrs), lrs


def test_the_schedule_itself_refuses_a_floor_above_the_peak():
    """The last line of defence, for a caller that builds the schedule without the trainer's checks."""
    from vim_ds.engine.optim import PerStepScheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(ValueError, match=r"--min-lr 0.01 is above the peak lr 0.001"):
        PerStepScheduler(opt, total_steps=10, warmup_steps=0, warmup_lr=0, min_lr=1e-2)
    with pytest.raises(ValueError, match=r"--warmup-lr 0.01 is above the peak lr 0.001"):
        PerStepScheduler(opt, total_steps=10, warmup_steps=2, warmup_lr=1e-2, min_lr=0)
    PerStepScheduler(opt, total_steps=10, warmup_steps=0, warmup_lr=1e-2, min_lr=1e-3)  # no warmup; equal: constant
