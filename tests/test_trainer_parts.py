"""The trainer from parts (issue 37, item 3): `vim_ds.engine.parts` builds a run's parts with small functions and a
`Trainer` only runs the loop over them. A Trainer assembled in one process from those parts trains the same bits as
`python -m vim_ds.train`; its position is a `Progress` whose checkpoint keys are the ones checkpoints always had;
fault injection reaches the loop through one hook object."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, assert_same_state, config, digits80, run_train, train_env

from vim_ds.runtime import faults
from vim_ds.config.run_config import RunConfig
from vim_ds.engine.trainer import Progress, Trainer

# the client state of every vim_ds checkpoint, in this order (the order is part of the file's bytes)
CLIENT_STATE_KEYS = ["epoch", "step", "step_in_epoch", "images_seen", "images_bad", "best_acc1", "world_size", "batch",
                     "precision", "zero_stage", "model", "model_kwargs", "input_size", "num_classes", "classes", "args",
                     "run_id", "evaluation_owed", "universal_checkpoint_info"]


@dataclass
class _Batch:
    micro: int = 8
    accum: int = 1
    world: int = 1


def _assembled_trainer(**changes) -> Trainer:
    """A Trainer over stand-in parts: its constructor only assembles what it is given (no process group)."""
    description = {"model": "vim_tiny", "model_kwargs": {"depth": 2}, "input_size": 32, "num_classes": 10}
    parts = dict(data=SimpleNamespace(datasets=SimpleNamespace(classes=["a", "b"])),
                 ds=SimpleNamespace(batch=_Batch(), precision="fp32", zero_stage=2), lr=1e-3,
                 model=SimpleNamespace(config=SimpleNamespace(description=lambda: dict(description))),
                 engine=SimpleNamespace(engine=object(), kind="deepspeed", dtype=torch.float32, autocast_dtype=None,
                                        compile_what=None),
                 mixup=None, criterion=None, ema=None, checkpointer=None, run_id="abc")
    return Trainer(RunConfig(), SimpleNamespace(world_size=1, rank=0), **{**parts, **changes})


def test_progress_is_the_checkpoint_position_with_the_keys_checkpoints_always_had():
    trainer = _assembled_trainer()
    assert trainer.faults is faults.NO_FAULTS and trainer.progress == Progress()
    state = trainer.client_state()
    assert list(state) == CLIENT_STATE_KEYS
    assert (state["epoch"], state["step"], state["images_seen"], state["best_acc1"], state["evaluation_owed"]) == \
        (0, 0, 0.0, 0.0, None)
    saved = {**state, "epoch": 3, "step": 41, "step_in_epoch": 2, "images_seen": 656.0, "images_bad": 1.0,
             "best_acc1": 12.5, "evaluation_owed": 2}
    trainer.progress.bad_steps = 2  # this process's own count: not in the checkpoint
    trainer.progress.restore(saved)
    assert trainer.step == 41 and trainer.client_state() == saved
    older = Progress()  # a checkpoint of an older vim_ds: no images counts, best accuracy or owed evaluation
    older.restore({"epoch": 1, "step": 5, "step_in_epoch": 0})
    assert older == Progress(epoch=1, step=5)


def test_the_fault_hook_is_a_no_op_unless_a_fault_is_injected(monkeypatch):
    loss = torch.tensor(2.0)
    assert faults.for_rank(0) is faults.NO_FAULTS
    assert faults.NO_FAULTS.on_loss(1, loss) is loss
    assert faults.NO_FAULTS.loader("train") == {"stall_at": None, "signal_at": None}
    monkeypatch.setattr(faults, "_FAULTS", faults._parse("nan_loss@2:1,stall_train@7,signal_in_train@9:1"))
    rank0, rank1 = faults.for_rank(0), faults.for_rank(1)
    assert rank0 is not faults.NO_FAULTS
    assert torch.isnan(rank1.on_loss(2, loss)) and rank1.on_loss(1, loss) is loss and rank0.on_loss(2, loss) is loss
    assert rank0.loader("train") == {"stall_at": 7, "signal_at": None}
    monkeypatch.setenv("VIM_DS_INJECT_SIGNAL", "SIGINT:rank")
    assert rank1.loader("train") == {"stall_at": 7, "signal_at": (9, 2, os.getpid())}
    assert rank1.loader("val") == {"stall_at": None, "signal_at": None}


def _args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero2"), "--precision", "fp32",
            "--batch-size", "8", "--max-steps", "2", "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0",
            "--model-ema-decay", "0.8", "--save-interval", "2", *extra]


@pytest.mark.slow
def test_a_trainer_built_from_parts_trains_the_bits_of_vim_ds_train(digits, tmp_path):
    """tests/trainer_from_parts.py builds the parts one by one in one process (a world of one, gloo) and runs the
    Trainer; weights, Adam moments, EMA, groups, scheduler and position after 2 steps at lr 2e-3 equal those of
    `python -m vim_ds.train` with the same options bit for bit; the control (another lr) must differ. (80 images:
    the evaluation after the last step reads 30.)"""
    digits = digits80(digits, tmp_path / "digits")
    run_train(_args(digits, tmp_path / "train"))

    def from_parts(name, *extra):
        proc = preloaded.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              os.path.join(ROOT, "tests", "trainer_from_parts.py"),
                              *map(str, _args(digits, tmp_path / name, *extra))],
                             capture_output=True, text=True, cwd=ROOT, timeout=600,
                             env=train_env({"PYTHONPATH": ROOT}))
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "trained to step 2" in proc.stdout, proc.stdout[-2000:]
        return tmp_path / name / "checkpoints" / "global_step2"

    straight = tmp_path / "train" / "checkpoints" / "global_step2"
    assert_same_state(from_parts("parts"), straight)
    with pytest.raises(AssertionError):
        assert_same_state(from_parts("control", "--lr", "4e-3"), straight)
