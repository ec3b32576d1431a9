"""The trainer from parts (issue 37, item 3): `vim_ds.engine.parts` builds a run's parts with small functions and a
`Trainer` only runs the loop over them. A Trainer assembled in one process from those parts trains the same bits as
`python -m vim_ds.train`; what it saves is a `TrainState` whose checkpoint keys are the ones checkpoints always
had; fault injection reaches the loop through one hook object."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, assert_same_state, config, digits80, run_train, train_env

from vim_ds.checkpoint.files import CheckpointError
from vim_ds.config.ds_config import BatchSizes
from vim_ds.config.run_config import RunConfig
from vim_ds.engine.parts import TrainerParts
from vim_ds.engine.stopping import Stopping
from vim_ds.engine.train_state import Progress, RunRecord, TrainState
from vim_ds.engine.trainer import Trainer
from vim_ds.runtime import faults, signals

# the client state of every vim_ds checkpoint, in this order (the order is part of the file's bytes)
CLIENT_STATE_KEYS = ["epoch", "step", "step_in_epoch", "images_seen", "images_bad", "best_acc1", "world_size", "batch",
                     "precision", "zero_stage", "model", "model_kwargs", "input_size", "num_classes", "classes", "args",
                     "run_id", "evaluation_owed", "universal_checkpoint_info"]


def _stand_in_parts(**changes) -> TrainerParts:
    """TrainerParts of stand-ins: the Trainer's constructor only assembles what it is given (no process group)."""
    description = {"model": "vim_tiny", "model_kwargs": {"depth": 2}, "input_size": 32, "num_classes": 10}
    record = RunRecord(world_size=1, batch=BatchSizes(8, 1, 1), precision="fp32", zero_stage=2, model=description,
                       classes=["a", "b"], args=RunConfig().to_dict())
    parts = dict(dist=SimpleNamespace(world_size=1, rank=0, is_main=True, device=torch.device("cpu")),
                 data=SimpleNamespace(total_steps=10), ds=SimpleNamespace(batch=BatchSizes(8, 1, 1), precision="fp32",
                                                                          zero_stage=2),
                 lr=1e-3, model=SimpleNamespace(num_params=1),
                 engine=SimpleNamespace(engine=object(), kind="deepspeed", dtype=torch.float32, autocast_dtype=None,
                                        compile_what=None),
                 mixup=None, criterion=None, ema=None, checkpointer=None, groups=None, record=record, run_id="abc")
    return TrainerParts(**{**parts, **changes})


def _assembled_trainer(**changes) -> Trainer:
    return Trainer(None, _stand_in_parts(**changes))


def test_progress_is_the_checkpoint_position_with_the_keys_checkpoints_always_had():
    trainer = _assembled_trainer()
    assert trainer.parts.fault_hook is faults.NO_FAULTS and trainer.state.progress == Progress()
    state = trainer.state.client_state()
    assert list(state) == CLIENT_STATE_KEYS
    assert (state["epoch"], state["step"], state["images_seen"], state["best_acc1"], state["evaluation_owed"]) == \
        (0, 0, 0.0, 0.0, None)
    saved = {**state, "epoch": 3, "step": 41, "step_in_epoch": 2, "images_seen": 656.0, "images_bad": 1.0,
             "best_acc1": 12.5, "evaluation_owed": 2}
    trainer.state.progress.bad_steps = 2  # this process's own count: not in the checkpoint
    trainer.state.progress.restore(saved)
    assert trainer.state.progress.step == 41 and trainer.state.client_state() == saved
    older = Progress()  # a checkpoint of an older vim_ds: no images counts, best accuracy or owed evaluation
    older.restore({"epoch": 1, "step": 5, "step_in_epoch": 0})
    assert older == Progress(epoch=1, step=5)


def test_the_trainer_gets_frozen_parts_and_the_loop_settings_of_the_options():
    """One frozen TrainerParts; the loop reads the LoopSettings `loop_settings` picks from the options (each one
    given a value other than its default here), not the RunConfig."""
    from vim_ds.cli.run_options import parse_args
    from vim_ds.engine.parts import LoopSettings, loop_settings

    parts = _stand_in_parts()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.checkpointer = object()
    config = RunConfig.from_dict(vars(parse_args([
        "--epochs", "7", "--seed", "11", "--save-interval", "3", "--max-bad-steps", "4", "--max-bad-images", "0.25",
        "--input-size", "64", "--compile", "--output_dir", "/out", "--log-interval", "5", "--tensorboard"])))
    settings = loop_settings(config)
    assert settings == LoopSettings(epochs=7, seed=11, save_interval=3, max_bad_steps=4, max_bad_images=0.25,
                                    input_size=64, compile=True, output_dir="/out", log_interval=5, tensorboard=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.epochs = 1
    trainer = Trainer(settings, parts)
    assert trainer.settings is settings and trainer.parts is parts and not hasattr(trainer, "config")


def _two_ranks(first=None, second=None):
    """The stop signals two ranks received (their `runtime.signals.StopSignals`), and the sum of their votes (what
    the step's all-reduce makes of them)."""
    ranks = [signals.StopSignals(), signals.StopSignals()]
    for received, signum in zip(ranks, (first, second)):
        if signum is not None:
            received.request(signum)
    summed = [a + b for a, b in zip(*(r.votes() for r in ranks))]
    return ranks, summed


def _stopping(received, saves=True, resuming=False):
    """A Stopping of a world of one (its collectives sum this rank's votes alone) whose `save` records each call."""
    progress = Progress(step=5, started_at=3)

    def save():
        progress.last_checkpoint = f"/out/checkpoints/global_step{progress.step}"
        saved.append(progress.step)

    saved = []
    dist = SimpleNamespace(is_main=True, device=torch.device("cpu"))
    stopping = Stopping(dist, save, saves=saves, resuming=resuming, total_steps=10, received=received)
    return stopping, progress, saved


@pytest.mark.parametrize("first, second, agreed", [(signal.SIGTERM, None, signal.SIGTERM),
                                                   (None, signal.SIGINT, signal.SIGINT),
                                                   (signal.SIGTERM, signal.SIGINT, signal.SIGINT),
                                                   (None, None, None)])
def test_every_rank_stops_on_the_signal_one_rank_received_saving_once(first, second, agreed, capsys):
    """At a step's end each rank decides from the summed votes: the rank that got no signal stops as the one that
    did (SIGINT, a person at a terminal, wins over SIGTERM), saves the step and raises StopRequested; with no
    signal on any rank both go on."""
    ranks, summed = _two_ranks(first, second)
    for received in ranks:
        stopping, progress, saved = _stopping(received)
        if agreed is None:
            stopping.after_step(summed, progress)
            assert saved == []
            continue
        with pytest.raises(signals.StopRequested) as stop:
            stopping.after_step(summed, progress)
        assert (stop.value.signum, stop.value.checkpoint, saved) == (agreed, "/out/checkpoints/global_step5", [5])
        assert f"stopping on {signal.Signals(agreed).name} after step 5 of 10: saved /out/checkpoints/global_step5; " \
            "continue with --resume auto" in capsys.readouterr().out


def test_a_signal_cuts_the_evaluation_short_and_stops_after_it_without_saving_again(capsys):
    """A signal during an evaluation cuts it short (`cuts_evaluation` at the next batch) and the run stops after
    the epoch's save, even a finished run (its evaluation is owed); a signal that comes after a whole evaluation
    stops an unfinished run, and lets a finished one end. Before the first step nothing is saved."""
    received = signals.StopSignals()
    stopping, progress, saved = _stopping(received)
    stopping.evaluation_started()
    assert not stopping.cuts_evaluation(progress) and stopping.cut_evaluation is None
    stopping.after_epoch(progress, finished=True)
    received.request(signal.SIGTERM)  # after the evaluation, during the save
    stopping.after_epoch(progress, finished=True)  # finished, its evaluation whole: it ends
    with pytest.raises(signals.StopRequested):
        stopping.after_epoch(progress, finished=False)
    assert saved == []  # the epoch's save was made: the stop saves nothing more
    stopping.evaluation_started()
    assert stopping.cuts_evaluation(progress) and stopping.cut_evaluation == signal.SIGTERM
    with pytest.raises(signals.StopRequested):
        stopping.after_epoch(progress, finished=True)
    with pytest.raises(signals.StopRequested):
        stopping.after_owed_evaluation(progress)
    assert saved == []
    capsys.readouterr()
    before, progress, saved = _stopping(received, resuming=True)
    progress.step = progress.started_at
    with pytest.raises(signals.StopRequested):
        before.before_training(progress)
    assert saved == [] and "no step taken yet, nothing to save; continue with --resume auto" in \
        capsys.readouterr().out


def test_a_resumed_state_continues_the_checkpoint_and_its_lineage():
    """TrainState.resumed: the checkpoint's position and run id (an older checkpoint without one keeps the
    run's), the checkpoint as the last one; another global batch is refused."""
    record = _stand_in_parts().record
    saved = TrainState(record, "lineage", Progress(epoch=2, step=9, step_in_epoch=1, best_acc1=3.0)).client_state()
    fresh = TrainState(record, "new")
    resumed = fresh.resumed(saved, "/ckpt")
    assert resumed.client_state() == saved and resumed.progress.last_checkpoint == "/ckpt"
    assert fresh.progress == Progress()
    assert fresh.resumed({"epoch": 1, "step": 4, "step_in_epoch": 4}, "/old").run_id == "new"
    with pytest.raises(CheckpointError, match="global batch of 16, this run has 8"):
        fresh.resumed({**saved, "batch": {"micro": 8, "accum": 2, "world": 1}}, "/ckpt")


@pytest.mark.slow
def test_the_train_state_round_trips_through_a_real_checkpointer(tmp_path):
    """tests/train_state_roundtrip.py: a TrainState saved by a Checkpointer with a real DeepSpeed engine and its EMA,
    restored by another checkpointer into an engine with other weights: the same client state (keys in order),
    the lineage's run id, the weights and the EMA; the checkpoint is the one the run's pruning keeps; another
    global batch is refused in one line."""
    out = tmp_path / "run"
    proc = preloaded.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          os.path.join(ROOT, "tests", "train_state_roundtrip.py"), str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=train_env({"PYTHONPATH": ROOT}))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT "):])
    path = str(out / "checkpoints" / "global_step7")
    assert result["path"] == result["last_checkpoint"] == path
    assert result["same_client_state"] and sorted(result["client_state_keys"]) == sorted(CLIENT_STATE_KEYS), result
    assert result["client_state_keys"] == result["saved_keys"] == result["keys_on_disk"], result
    assert (result["run_id"], result["fresh_untouched"], result["weights"], result["ema"]) == \
        ("lineage1", True, True, True), result
    assert result["protected"] == "global_step7"
    assert result["refusal"] == f"{path} was trained with a global batch of 2, this run has 4; the data order " \
        "would not continue"


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
