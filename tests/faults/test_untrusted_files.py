"""Files users bring are unpickled weights-only: a pickle that would run code is refused, with one line naming the
file and a non-zero exit, and the code does not run. Covered: `--finetune`, `vim-ds predict --weights`,
`vim-ds eval --resume FILE`, and inside a real DeepSpeed checkpoint directory (`mp_rank_00_model_states.pt`,
`*optim_states.pt`, `rng_rank0.pt`, `ema.pt`) given to `vim-ds convert`, `vim-ds convert --universal` and `--resume`.

Genuine files still load: a ZeRO-1 bf16 checkpoint (DeepSpeed's loss scaler, stage enum and fragment addresses in
its optimizer states) resumes and converts here; published files with an `args` Namespace load in
tests/test_model.py and tests/test_train.py::test_finetune_from_a_published_format_checkpoint; ZeRO-0/2/3 fp32/bf16
checkpoints convert in tests/test_convert.py and resume in tests/test_train.py."""
from __future__ import annotations

import builtins
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, config, rerecord_checksums, run_train


class _RunsShell:
    """Unpickling this calls os.system (the classic malicious checkpoint)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


class _RunsPython:
    """Unpickling this calls builtins.exec on Python source."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').close()",)


def plant(path, marker, payload=_RunsShell):
    """Write (or overwrite) `path` with a checkpoint-shaped pickle that creates `marker` when unpickled."""
    torch.save({"model": {"pos_embed": torch.zeros(1)}, "module": payload(marker), "python": payload(marker)}, path)
    rerecord_checksums(os.path.dirname(str(path)))  # a checkpoint handed over whole: its marker matches its files
    return str(path)


def cli(*args):
    return preloaded.run([sys.executable, "-m", "vim_ds.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)


def assert_refused(proc, path, marker):
    assert proc.returncode != 0, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vim-ds") and "error" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert str(path) in errors[0] and "refusing" in errors[0] and "unsafe" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(marker), "the pickle's code ran"


def train_args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0",
            "--deepspeed_config", config("zero1"), "--precision", "bf16", "--batch-size", "16", "--no-repeated-aug",
            *TINY, *QUIET_AUG, *extra]


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """A real 2-step ZeRO-1 bf16 run with EMA: its checkpoints directory."""
    out = tmp_path_factory.mktemp("trained")
    run_train(train_args(digits, str(out), "--max-steps", "2"))
    return out / "checkpoints"


def copy_of(trained, tmp_path):
    dst = tmp_path / "checkpoints"
    shutil.copytree(trained, dst)
    return dst, dst / "global_step2"


def test_the_planted_files_do_run_code_when_unpickled_unsafely(tmp_path):
    for payload in (_RunsShell, _RunsPython):
        marker = tmp_path / f"{payload.__name__}.ran"
        torch.load(plant(tmp_path / "evil.pth", marker, payload), weights_only=False)
        assert marker.exists()


def test_finetune_file_is_refused(digits, tmp_path):
    marker, evil = tmp_path / "ran", tmp_path / "vim_t_midclstok_76p1acc.pth"
    plant(evil, marker)
    proc = run_train(train_args(digits, str(tmp_path / "out"), "--max-steps", "1", "--finetune", evil), check=False)
    assert_refused(proc, evil, marker)


@pytest.mark.slow
def test_predict_weights_and_eval_resume_files_are_refused(digits, tmp_path):
    marker, evil = tmp_path / "ran", tmp_path / "converted.pth"
    plant(evil, marker, _RunsPython)
    image = os.path.join(digits, "val", "3", sorted(os.listdir(os.path.join(digits, "val", "3")))[0])
    assert_refused(cli("predict", "--weights", evil, image), evil, marker)
    proc = run_train(["--data-set", "folder", "--data-path", digits, "--num_workers", "0", *TINY, "--resume", evil],
                     module="vim_ds.eval", check=False)
    assert_refused(proc, evil, marker)


@pytest.mark.slow
def test_model_states_in_a_checkpoint_directory_are_refused_by_convert_and_resume(trained, digits, tmp_path):
    save_dir, tag_dir = copy_of(trained, tmp_path)
    marker, evil = tmp_path / "ran", tag_dir / "mp_rank_00_model_states.pt"
    plant(evil, marker)
    assert_refused(cli("convert", save_dir, tmp_path / "out.pth"), evil, marker)
    assert not (tmp_path / "out.pth").exists()
    proc = run_train(train_args(digits, str(tmp_path / "resumed"), "--max-steps", "3", "--resume", save_dir),
                     check=False)
    assert_refused(proc, evil, marker)  # DeepSpeed's own torch.load(weights_only=False), forced weights-only


@pytest.mark.slow
def test_rng_file_is_refused_on_resume(trained, digits, tmp_path):
    save_dir, tag_dir = copy_of(trained, tmp_path)
    marker, evil = tmp_path / "ran", tag_dir / "rng_rank0.pt"
    plant(evil, marker, _RunsPython)
    proc = run_train(train_args(digits, str(tmp_path / "resumed"), "--max-steps", "3", "--resume", save_dir),
                     check=False)
    assert_refused(proc, evil, marker)


@pytest.mark.slow
def test_optimizer_states_in_a_checkpoint_directory_are_refused_by_convert_and_resume(trained, digits, tmp_path):
    save_dir, tag_dir = copy_of(trained, tmp_path)
    (name,) = [n for n in os.listdir(tag_dir) if n.endswith("optim_states.pt")]
    marker, evil = tmp_path / "ran", tag_dir / name
    plant(evil, marker, _RunsPython)
    assert_refused(cli("convert", save_dir, tmp_path / "out.pth"), evil, marker)  # zero_to_fp32 reads it
    assert not (tmp_path / "out.pth").exists()
    proc = run_train(train_args(digits, str(tmp_path / "resumed"), "--max-steps", "3", "--resume", save_dir),
                     check=False)
    assert_refused(proc, evil, marker)  # DeepSpeed's load_checkpoint reads it


@pytest.mark.slow
def test_ema_file_is_refused_by_convert_and_resume(trained, digits, tmp_path):
    save_dir, tag_dir = copy_of(trained, tmp_path)
    marker, evil = tmp_path / "ran", tag_dir / "ema.pt"
    assert evil.is_file()  # the run has an EMA, so a genuine ema.pt is what gets replaced
    plant(evil, marker)
    assert_refused(cli("convert", save_dir, tmp_path / "out.pth"), evil, marker)
    assert not (tmp_path / "out.pth").exists()
    proc = run_train(train_args(digits, str(tmp_path / "resumed"), "--max-steps", "3", "--resume", save_dir),
                     check=False)
    assert_refused(proc, evil, marker)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["model_states", "optim_states"])
def test_convert_universal_refuses_unsafe_rank_files(trained, tmp_path, kind):
    # ds_to_universal unpickles every rank file (in a subprocess under the allow-list)
    save_dir, tag_dir = copy_of(trained, tmp_path)
    (name,) = [n for n in os.listdir(tag_dir) if n.endswith(f"{kind}.pt")]
    marker, evil = tmp_path / "ran", tag_dir / name
    plant(evil, marker)
    assert_refused(cli("convert", "--universal", save_dir), evil, marker)
    assert not (save_dir / "global_step2_universal" / "vim_ds_complete.json").exists()


@pytest.mark.slow
def test_a_genuine_zero1_bf16_checkpoint_still_resumes_and_converts(trained, digits, tmp_path):
    save_dir, tag_dir = copy_of(trained, tmp_path)
    for name in os.listdir(tag_dir):  # nothing in it needs more than the allow-list
        if name.endswith(".pt") and not name.startswith(("mp_rank", "bf16_zero")):
            assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tag_dir / name)) == [], name
    proc = run_train(train_args(digits, str(tmp_path / "resumed"), "--max-steps", "3", "--resume", save_dir))
    assert "at epoch 0, step 2" in proc.stdout
    proc = cli("convert", save_dir, tmp_path / "out.pth")
    assert proc.returncode == 0 and proc.stdout.startswith("wrote "), proc.stderr[-3000:]
    # control for the --universal refusals: the genuine rank files go through ds_to_universal
    proc = cli("convert", "--universal", save_dir)
    assert proc.returncode == 0 and proc.stdout.startswith("wrote "), proc.stderr[-3000:]
    assert (save_dir / "global_step2_universal" / "vim_ds_complete.json").is_file()


def test_rng_state_file_is_weights_only_and_old_files_still_load(tmp_path):
    from vim_ds.checkpoint import safe_load
    from vim_ds.engine.checkpointing import rng_state, set_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # a cached Gaussian is part of NumPy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = random.random(), np.random.normal(), torch.rand(1)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "rng.pt")) == []
    set_rng_state(safe_load.load(str(tmp_path / "rng.pt")))
    assert (random.random(), np.random.normal(), torch.rand(1).item()) == expected

    # written before this format: NumPy's state as a tuple holding an ndarray (loads with the NumPy allow-list)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / "old.pt")
    expected = random.random(), np.random.normal(), torch.rand(1)
    set_rng_state(safe_load.load(str(tmp_path / "old.pt"), extra_globals=safe_load.numpy_rng_globals()))
    assert (random.random(), np.random.normal(), torch.rand(1).item()) == expected


class _EnumByName:
    """Pickles as getattr(cls, name): how Debian 12's Python 3.11.2 pickles members of int-mixin enums such as
    DeepSpeed's ZeroStageEnum in every ZeRO optimizer-state file (3.11.7 pickles them by value)."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return getattr, (self.cls, self.name)


def test_enum_members_pickled_by_name_load_and_nothing_else_through_getattr(tmp_path):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from vim_ds.checkpoint import safe_load

    genuine = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": _EnumByName(ZeroStageEnum, "gradients"), "x": torch.ones(2)}, genuine)
    state = safe_load.load(str(genuine))
    assert state["zero_stage"] is ZeroStageEnum.gradients and torch.equal(state["x"], torch.ones(2))
    # the same getattr reaching for anything but a member of the allowed enum is refused as unsafe
    for cls, name in ((torch.Tensor, "add_"), (ZeroStageEnum, "__class__"), (subprocess.Popen, "kill")):
        path = tmp_path / f"{name}.pt"
        torch.save({"zero_stage": _EnumByName(cls, name)}, path)
        with pytest.raises(Exception, match="unsafe") as exc:
            safe_load.load(str(path))
        assert str(path) in str(exc.value)
