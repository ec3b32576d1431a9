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
        # a new run (no --resume) is told the same, not to `--resume auto` the earlier run's checkpoints (issue 50)
        proc = run_train(args(digits, out, "--max-steps", "20"), check=False)
        assert proc.returncode == 2 and "is in use by another run (process" in error_line(proc), proc.stderr[-2000:]
        assert step_losses(out) and max(step_losses(out)) == 2  # the second runs wrote no step
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # killed: no chance to release its lock file
        finish(first, 60)
    proc = run_train(args(digits, out, "--max-steps", "4", "--resume", "auto"))
    assert "was locked by process" in proc.stdout and "no longer running; taking it over" in proc.stdout
    assert sorted(step_losses(out)) == [1, 2, 3, 4]
    # a run that ended normally leaves no holder to report
    proc = run_train(args(digits, out, "--max-steps", "5", "--resume", "auto"))
    assert "was locked by process" not in proc.stdout


# -- a resume never writes over a newer checkpoint ------------------------------------------------------------------

def _files(folder) -> dict:
    """Every file under `folder` with its bytes' checksum (a rewrite in place changes it)."""
    import zlib

    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = zlib.crc32(f.read())
    return out


def test_a_resume_of_an_older_step_never_writes_over_a_newer_checkpoint(digits, config_run, tmp_path):
    """The issue's probe: `--resume .../global_step1` while `global_step2` and `global_step3` exist re-saved them in
    place and pruned the older ones. Refused before anything is written (the folder's files keep their bytes),
    also when `latest` names the older step (`--resume auto`) and when the folder holding the newer checkpoint is
    another run's; the way the message gives (another --output_dir) branches from step 1 and leaves the origin
    whole, --keep-checkpoints 1 included."""
    import shutil

    from train_utils import config_run_args

    run = tmp_path / "run"
    shutil.copytree(config_run("zero0"), run)  # 2 ranks x 8, checkpoints at steps 1, 2, 3
    one_rank = ["--batch-size", "8", "--accum-steps", "2"]  # the same global batch of 16 on one rank
    step1 = run / "checkpoints" / "global_step1"
    before = _files(run)

    proc = run_train(config_run_args(digits, run, "zero0", *one_rank, "--resume", step1), check=False)
    line = error_line(proc)
    assert proc.returncode == 2 and f"--resume {step1} (step 1)" in line, proc.stderr[-2000:]
    assert "holds newer complete checkpoints (global_step2, global_step3)" in line and "another --output_dir" in line
    assert _files(run) == before

    (run / "checkpoints" / "latest").write_text("global_step1")  # a `latest` edited back by hand
    proc = run_train(config_run_args(digits, run, "zero0", *one_rank, "--resume", "auto"), check=False)
    assert proc.returncode == 2 and f"`latest` names {step1} (step 1)" in error_line(proc), proc.stderr[-2000:]
    (run / "checkpoints" / "latest").write_text("global_step3")
    assert _files(run) == before

    other = tmp_path / "other"  # another run's folder whose newest checkpoint is newer than the one resumed
    shutil.copytree(run / "checkpoints" / "global_step3", other / "checkpoints" / "global_step3")
    proc = run_train(config_run_args(digits, other, "zero0", *one_rank, "--resume", step1), check=False)
    assert proc.returncode == 2 and "(global_step3)" in error_line(proc), proc.stderr[-2000:]

    branch = tmp_path / "branch"  # the way the message gives
    proc = run_train(config_run_args(digits, branch, "zero0", *one_rank, "--resume", step1,
                                     "--keep-checkpoints", "1"))
    assert "at epoch 0, step 1" in proc.stdout and sorted(step_losses(branch)) == [2, 3]
    assert sorted(p.name for p in (branch / "checkpoints").iterdir() if p.is_dir()) == ["global_step3"]
    assert _files(run) == before  # the origin, global_step1 included, as it was


def test_resume_auto_with_only_interrupted_saves_says_so_and_starts_anew(digits, config_run, tmp_path):
    import shutil

    from train_utils import config_run_args

    run = tmp_path / "run"
    shutil.copytree(config_run("zero0"), run)
    for tag in ("global_step1", "global_step2", "global_step3"):
        os.remove(run / "checkpoints" / tag / "vim_ds_complete.json")  # every save interrupted
    os.remove(run / "metrics.jsonl")
    proc = run_train(config_run_args(digits, run, "zero0", "--batch-size", "8", "--accum-steps", "2",
                                     "--max-steps", "1", "--resume", "auto"))
    assert ("holds only interrupted saves (global_step1, global_step2, global_step3: no vim_ds_complete.json), "
            "which are never resumed; starting from step 0") in proc.stderr, proc.stderr[-2000:]
    assert sorted(step_losses(run)) == [1]
