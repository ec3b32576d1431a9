"""A training run's saved state: one `TrainState` (what the run is, its lineage and its position) that the
checkpointer writes as a checkpoint's client state (`Checkpointer.save`) and reads back on resume
(`Checkpointer.restore`). The client state's keys, their order and their values are those of every vim_ds
checkpoint so far (older ones lack the later keys: see `Progress.restore`)."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from ..checkpoint.files import CheckpointError


@dataclass
class Progress:
    """Where the run is: what a checkpoint records of it (`position`, restored by `restore`), and what this process
    counts on its own (the bad steps in a row, the last checkpoint, the step it started from)."""
    epoch: int = 0
    step: int = 0            # optimizer steps done
    step_in_epoch: int = 0
    images_seen: float = 0.0
    images_bad: float = 0.0
    best_acc1: float = 0.0
    # the epoch whose evaluation a stop signal cut short (recorded in the checkpoint saved then, so that the run
    # which resumes it evaluates those same weights first: a stop loses no evaluation, the final one included)
    evaluation_owed: int | None = None
    # consecutive steps whose update was skipped (non-finite loss or gradients)
    bad_steps: int = 0
    last_checkpoint: str | None = None
    # the step this process started from (stopping: was anything trained since?)
    started_at: int = 0

    def restore(self, state: dict):
        """Continue from a checkpoint's client state (checkpoints of older vim_ds lack the later keys)."""
        self.epoch, self.step, self.step_in_epoch = state["epoch"], state["step"], state["step_in_epoch"]
        self.images_seen, self.images_bad = state.get("images_seen", 0.0), state.get("images_bad", 0.0)
        self.best_acc1 = state.get("best_acc1", 0.0)
        self.evaluation_owed = state.get("evaluation_owed")


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of a run records of the run itself, besides its position: what a resume checks (the
    global batch, precision, ZeRO stage, model, class names), the options it trains with, and the rank count a
    universal conversion starts from (built by `parts.run_record`)."""
    world_size: int
    batch: object        # config.ds_config.BatchSizes
    precision: str
    zero_stage: int
    model: dict          # models.ModelConfig.description()
    classes: list[str]
    args: dict           # RunConfig.to_dict(): the options (`vim-ds convert`, `vim-ds eval` and a resume read them)

    def summary(self) -> dict:
        """What a checkpoint's completion marker says of the run (read without loading the checkpoint)."""
        return {"model": self.model["model"], "world_size": self.world_size, "zero_stage": self.zero_stage}


@dataclass
class TrainState:
    """The run's saved state: its record, its lineage (the run id, which pruning goes by) and its position."""
    record: RunRecord
    run_id: str
    progress: Progress = field(default_factory=Progress)

    def client_state(self) -> dict:
        """What a checkpoint stores of it (DeepSpeed's client state), in the order checkpoints always had."""
        p, r = self.progress, self.record
        return {"epoch": p.epoch, "step": p.step, "step_in_epoch": p.step_in_epoch,
                "images_seen": p.images_seen, "images_bad": p.images_bad, "best_acc1": p.best_acc1,
                "world_size": r.world_size, "batch": asdict(r.batch), "precision": r.precision,
                "zero_stage": r.zero_stage, **r.model, "classes": r.classes, "args": r.args,
                "run_id": self.run_id, "evaluation_owed": p.evaluation_owed,
                # what DeepSpeed's ds_to_universal needs to re-partition this checkpoint for another rank count
                # (pure data parallelism: no tensor-parallel patterns to declare)
                "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}

    def summary(self) -> dict:
        """The completion marker's account of the run (RunRecord.summary) and its lineage."""
        return {**self.record.summary(), "run_id": self.run_id}

    def resumed(self, saved: dict, path: str) -> TrainState:
        """The state that continues checkpoint `path`, whose client state is `saved`: its position, and its lineage
        (checkpoints of vim_ds before run ids start one). Refused: another global batch (the data order would not
        continue)."""
        batch = saved.get("batch")
        if batch and batch["micro"] * batch["accum"] * batch["world"] != self.record.batch.global_:
            raise CheckpointError(f"{path} was trained with a global batch of "
                                  f"{batch['micro'] * batch['accum'] * batch['world']}, "
                                  f"this run has {self.record.batch.global_}; the data order would not continue")
        progress = dataclasses.replace(self.progress, last_checkpoint=path)
        progress.restore(saved)
        return TrainState(self.record, saved.get("run_id") or self.run_id, progress)
