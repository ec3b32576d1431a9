"""The disk fills up while a checkpoint is written: a size-limited tmpfs is mounted over the checkpoint directory
(mounting needs root, which CI and this machine have; elsewhere the test is skipped and says why)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import STEPS, fault_args
from train_utils import error_line, rel_diff, run_train, step_losses

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """OUT/checkpoints on a 1 MiB filesystem: one checkpoint of the test model (about 0.7 MiB) fits, two do not."""
    mount_point = tmp_path / "run" / "checkpoints"
    mount_point.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {proc.stderr.strip()}")
    yield tmp_path / "run"
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_stops_the_run_with_a_clear_error_and_the_previous_checkpoint_intact(digits, tmp_path, small_disk,
                                                                                         reference):
    out = small_disk
    # run_train's default limit (600 s) only guards against a hang: the run itself takes about a minute. torchrun's
    # ranks forked from the preloaded server: what is checked is the rank's error and the folder, not the launcher.
    proc = run_train(fault_args(digits, out, "--max-steps", STEPS), nproc=2, check=False)
    assert proc.returncode != 0
    save_dir = os.path.join(out, "checkpoints")
    assert f"cannot save checkpoint {os.path.join(save_dir, 'global_step8')}: No space left on device; the previous " \
           f"checkpoint {os.path.join(save_dir, 'global_step4')} is intact" in error_line(proc), proc.stderr[-3000:]
    assert open(os.path.join(save_dir, "latest")).read().strip() == "global_step4"
    assert not os.path.exists(os.path.join(save_dir, "global_step8"))  # the partial save is freed

    # The checkpoint left behind is whole: moved to a disk with room, it resumes into the reference's losses.
    moved = tmp_path / "moved"
    shutil.copytree(save_dir, moved / "checkpoints")
    run_train(fault_args(digits, moved, "--max-steps", STEPS, "--resume", "auto"), nproc=2)
    expected = {k: v for k, v in step_losses(reference).items() if k > 4}
    assert rel_diff(expected, step_losses(moved)) <= 1e-6
