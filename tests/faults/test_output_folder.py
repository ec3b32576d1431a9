"""An output folder belongs to one run (vim_ds/engine/output_dir.py): a new run does not write into, or prune, an
earlier run's folder; a second live run in the same folder is refused; a lock left by a killed run is taken over.
Real runs, real processes (one rank: the rules are rank 0's), real files."""
from __future__ import annotations

import os
import signal
import time

import pytest

from faults.conftest import finish, start_train, wait_for_step
from train_utils import QUIET_AUG, TINY, config, error_line, run_train, step_losses

pytestmark = pytest.mark.slow


def args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32",
            "--batch-size", "8", "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0", "--save-interval", "1",
            *extra]


def snapshot(save_dir) -> dict:
    """Every file under `save_dir` with its size and modification time."""
    out = {}
    for root, _, files in os.walk(save_dir):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), save_dir)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_and_loses_nothing(digits, tmp_path):
    out = tmp_path / "r1"
    run_train(args(digits, out, "--max-steps", "4", "--save-interval", "2"))
    before, metrics = snapshot(out / "checkpoints"), (out / "metrics.jsonl").read_text()
    proc = run_train(args(digits, out, "--max-steps", "6"), check=False)
    assert proc.returncode == 2
    line = error_line(proc)
    assert "holds the checkpoints of an earlier run (newest: global_step4)" in line and "--resume auto" in line, \
        proc.stderr[-2000:]
    assert snapshot(out / "checkpoints") == before and (out / "metrics.jsonl").read_text() == metrics
    # the control: continuing it is what the message says to do, and it works
    proc = run_train(args(digits, out, "--max-steps", "6", "--resume", "auto"))
    assert "at epoch 0, step 4" in proc.stdout and sorted(step_losses(out)) == list(range(1, 7))


def test_pruning_keeps_the_checkpoints_of_another_lineage(digits, tmp_path):
    """A run resumed from another folder's checkpoint into a folder holding an earlier run's checkpoints, with
    `--keep-checkpoints 1`: it prunes its own checkpoints only."""
    here, there = tmp_path / "here", tmp_path / "there"
    run_train(args(digits, here, "--max-steps", "2", "--keep-checkpoints", "0"))
    run_train(args(digits, there, "--max-steps", "2", "--keep-checkpoints", "0"))
    run_train(args(digits, here, "--max-steps", "5", "--keep-checkpoints", "1", "--resume",
                   str(there / "checkpoints" / "global_step2")))
    tags = sorted(p.name for p in (here / "checkpoints").iterdir() if p.name.startswith("global_step"))
    # here's own 1 and 2 stay; of the resumed lineage (3, 4, 5) the newest
    assert tags == ["global_step1", "global_step2", "global_step5"], tags


def test_a_second_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(digits, tmp_path):
    out = tmp_path / "run"
    first = start_train(args(digits, out, "--max-steps", "20"), nproc=1, launcher="torchrun",
                        env={"VIM_DS_INJECT": "hang@3:0"})  # alive, holding the folder, never finishing
    try:
        wait_for_step(first, out, 2)
        t0 = time.monotonic()
        proc = run_train(args(digits, out, "--max-steps", "20", "--resume", "auto"), check=False)
        assert proc.returncode == 2 and time.monotonic() - t0 < 120
        line = error_line(proc)
        assert "is in use by another run (process" in line and "--output_dir" in line, proc.stderr[-2000:]
        assert step_losses(out) and max(step_losses(out)) == 2  # the second run wrote no step
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # killed: no chance to release its lock file
        finish(first, 60)
    proc = run_train(args(digits, out, "--max-steps", "4", "--resume", "auto"))
    assert "was locked by process" in proc.stdout and "no longer running; taking it over" in proc.stdout
    assert sorted(step_losses(out)) == [1, 2, 3, 4]
    # a run that ended normally leaves no holder to report
    proc = run_train(args(digits, out, "--max-steps", "5", "--resume", "auto"))
    assert "was locked by process" not in proc.stdout
