"""Checkpoints verified before use: each complete checkpoint records the size and CRC-32 of every file it wrote
(in `vim_ds_complete.json`); resume, `vim-ds eval` and `vim-ds convert` check them and name a damaged file in one
line; `--resume auto` falls back to the newest intact checkpoint with a warning; a tag whose save never completed
is refused even when named by hand. The damage is real: 64 bytes overwritten in the middle of a saved file."""
from __future__ import annotations

import json
import os
import sys

import pytest

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, config, error_line, run_train, step_losses

pytestmark = pytest.mark.slow


def args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero2"), "--precision", "fp32",
            "--batch-size", "8", "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0", "--save-interval", "1",
            "--keep-checkpoints", "0", *extra]


def overwrite_64_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)  # inside the tensor data that makes up most of the file
        f.write(bytes(range(64)))


@pytest.fixture(scope="module")
def damaged_run(digits, tmp_path_factory):
    """3 saved steps of a 1-rank ZeRO-2 run; step 3's model states file then damaged."""
    out = tmp_path_factory.mktemp("run")
    run_train(args(digits, out, "--max-steps", "3"))
    tag3 = out / "checkpoints" / "global_step3"
    recorded = json.loads((tag3 / "vim_ds_complete.json").read_text())["files"]
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "ema.pt",
            "rng_rank0.pt"} <= set(recorded)
    overwrite_64_bytes(tag3 / "mp_rank_00_model_states.pt")
    return out


def test_resume_of_a_damaged_tag_is_refused_naming_the_file(digits, damaged_run):
    tag3 = damaged_run / "checkpoints" / "global_step3"
    proc = run_train(args(digits, damaged_run, "--max-steps", "4", "--resume", str(tag3)), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{tag3 / 'mp_rank_00_model_states.pt'} is damaged" in error_line(proc)


def test_eval_and_convert_refuse_a_damaged_tag(digits, damaged_run, tmp_path):
    tag3 = damaged_run / "checkpoints" / "global_step3"
    proc = run_train(["--data-set", "folder", "--data-path", digits, "--num_workers", "0", *TINY, "--precision",
                      "fp32", "--batch-size", "32", "--resume", str(tag3)], module="vim_ds.eval", check=False)
    assert proc.returncode == 2 and "mp_rank_00_model_states.pt is damaged" in error_line(proc), proc.stderr[-2000:]
    proc = preloaded.run([sys.executable, "-m", "vim_ds.convert", str(tag3), str(tmp_path / "w.pth")],
                         capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "mp_rank_00_model_states.pt is damaged" in lines[0], \
        proc.stderr[-2000:]
    assert not (tmp_path / "w.pth").exists()
    # the control: the intact checkpoint before it converts
    proc = preloaded.run([sys.executable, "-m", "vim_ds.convert", str(damaged_run / "checkpoints" / "global_step2"),
                           str(tmp_path / "w.pth")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and (tmp_path / "w.pth").is_file(), proc.stderr[-2000:]


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(digits, damaged_run, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(damaged_run, out)
    (out / ".vim_ds.lock").unlink(missing_ok=True)
    proc = run_train(args(digits, out, "--max-steps", "4", "--resume", "auto"))
    assert "global_step3/mp_rank_00_model_states.pt is damaged" in proc.stderr and \
        "trying the checkpoint before it" in proc.stderr, proc.stderr[-2000:]
    assert "global_step2 at epoch 0, step 2" in proc.stdout
    assert sorted(step_losses(out)) == [1, 2, 3, 4]


def test_an_interrupted_save_named_by_hand_is_refused(digits, damaged_run, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(damaged_run, out)
    tag2 = out / "checkpoints" / "global_step2"
    os.remove(tag2 / "vim_ds_complete.json")
    os.remove(out / "checkpoints" / "latest")  # named by hand, with nothing else pointing at it
    proc = run_train(args(digits, out, "--max-steps", "4", "--resume", str(tag2)), check=False)
    assert proc.returncode == 2 and "an interrupted save" in error_line(proc), proc.stderr[-2000:]
