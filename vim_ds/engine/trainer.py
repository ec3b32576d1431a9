"""The training loop: a short class running its parts (data, DeepSpeed engine, loss, EMA, checkpoints, metrics),
which `vim_ds.engine.parts` builds from the options; its position is a `Progress`.

Determinism contract: which images form optimizer step s depends only on (seed, epoch) (see
`vim_ds/data/sampler.py`), each image's augmentation only on its sample seed, and the randomness of the step
itself (Mixup, drop path) only on (seed, step, micro step, rank). A resumed run therefore continues exactly as if
it had never stopped, and any rank count or accumulation split of one global batch trains on the same images.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch._dynamo.exc import TorchDynamoException

from ..checkpoint.files import CheckpointError
from ..config.run_config import RunConfig
from ..data.datasets import derive_seed
from ..models.vim import load_state_dict_into
from ..runtime import distributed, faults, sequence_groups, signals, write_journal
from ..runtime.deepspeed_engine import drop_stepped_gradients, is_bf16_optimizer, module_grad_norm
from ..runtime.errors import first_line
from ..runtime.sequence_groups import SequenceGroups
from .checkpointing import Checkpointer
from .evaluate import evaluate as evaluate_model
from .memory import state_bytes
from .metrics import MetricsLog
from .run_info import header


class TrainingError(RuntimeError):
    """The run cannot go on (the loss diverged, too many unreadable images, ...)."""


def _keeps_its_own_gradients(optimizer) -> bool:
    """DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation: DeepSpeed 0.16's way without ZeRO, where
    newer releases accumulate in bf16 by default) moves each micro step's gradients into fp32 buffers of its own and
    averages them over the ranks there, so the module's `.grad` holds one rank's last micro step only: its norm
    was 25 % off the others' with 2 ranks, 44 % with accumulation 2. It reports the norm of its own gradients, before
    clipping, as ZeRO's optimizers do (get_global_grad_norm)."""
    return is_bf16_optimizer(optimizer)


@contextlib.contextmanager
def _optimizer_step_skipped(optimizer):
    """Make the engine's next `optimizer.step()` a no-op that DeepSpeed handles as it handles a step its own overflow
    check skips: it zeroes the gradients and counts a skipped step, but does not advance the lr schedule (reading
    the `overflow` flag its own optimizers set)."""
    had_flag, flag = hasattr(optimizer, "overflow"), getattr(optimizer, "overflow", None)
    optimizer.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
    optimizer.overflow = True
    try:
        yield
    finally:
        del optimizer.step
        if had_flag:
            optimizer.overflow = flag
        else:
            del optimizer.overflow


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process, or on CPU its peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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


class Trainer:
    """Runs the loop over parts built elsewhere (`vim_ds.engine.parts.build_trainer` builds them from the options):
    the data (`parts.Data`), the DeepSpeed config, the model's description (`parts.Model`), the engine
    (`parts.Engine`), Mixup and the loss, the EMA, the checkpointer, the run id, the checkpoint to resume, and the
    rank's fault injection (`faults.FaultHook`). Its position is `progress` (a `Progress`)."""

    def __init__(self, config: RunConfig, dist_info: distributed.DistInfo, *, data, ds, lr: float, model, engine, mixup,
                 criterion, ema, checkpointer, run_id: str, resume_path: str = "",
                 fault_hook: faults.FaultHook = faults.NO_FAULTS, groups: SequenceGroups | None = None):
        self.config, self.dist = config, dist_info
        self.data, self.ds, self.lr, self.model = data, ds, lr, model
        self.engine, self.engine_kind, self.dtype = engine.engine, engine.kind, engine.dtype
        self.autocast_dtype, self._compile_what = engine.autocast_dtype, engine.compile_what
        self.mixup, self.criterion, self.ema, self.checkpointer = mixup, criterion, ema, checkpointer
        self.run_id, self.resume_path, self.faults = run_id, resume_path, fault_hook
        self.progress = Progress()
        # --sequence-parallel: this rank's group (sequence_groups.py); one group per rank without it
        self.groups = groups or sequence_groups.build(1, dist_info.rank, dist_info.world_size)
        # DeepSpeed reports no norm without ZeRO (but through an optimizer that keeps the gradients itself, below);
        # the baselines report theirs
        self._own_grad_norm = (ds.zero_stage == 0 and not self.engine_kind.reports_grad_norm_without_zero
                               and not _keeps_its_own_gradients(getattr(self.engine, "optimizer", None)))
        self._grad_norm = None
        # the last optimizer step was made a no-op here (fp32 without ZeRO)
        self._skipped_by_us = False
        # the signal the ranks agreed on during an evaluation, which it cut short
        self._stop_signal = None
        self._eval_batches = 0
        self.timing = {"data": 0.0, "compute": 0.0, "other": 0.0, "steps": 0, "seen_steps": 0}

    # what the run header (run_info.header), `vim-ds train` and the tests' helpers read
    device = property(lambda self: self.dist.device)
    batch = property(lambda self: self.ds.batch)
    step = property(lambda self: self.progress.step)
    train_set = property(lambda self: self.data.datasets.train_set)
    train_loader = property(lambda self: self.data.train_loader)
    num_classes = property(lambda self: self.data.datasets.num_classes)
    total_steps = property(lambda self: self.data.total_steps)
    init_weights_info = property(lambda self: self.model.init_weights_info)

    # -- checkpoints --------------------------------------------------------------------------------------------

    def client_state(self) -> dict:
        p = self.progress
        return {"epoch": p.epoch, "step": p.step, "step_in_epoch": p.step_in_epoch,
                "images_seen": p.images_seen, "images_bad": p.images_bad, "best_acc1": p.best_acc1,
                "world_size": self.dist.world_size, "batch": asdict(self.batch), "precision": self.ds.precision,
                "zero_stage": self.ds.zero_stage, **self.model.config.description(),
                "classes": self.data.datasets.classes, "args": self.config.to_dict(),
                "run_id": self.run_id, "evaluation_owed": p.evaluation_owed,
                # what DeepSpeed's ds_to_universal needs to re-partition this checkpoint for another rank count
                # (pure data parallelism: no tensor-parallel patterns to declare)
                "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}

    def save(self):
        if self.checkpointer is None:
            return
        summary = {"model": self.config.model.model, "world_size": self.dist.world_size,
                   "zero_stage": self.ds.zero_stage, "run_id": self.run_id}
        self.progress.last_checkpoint = self.checkpointer.save(self.client_state(), self.ema, summary=summary)
        signals.STOP.last_checkpoint = self.progress.last_checkpoint

    def resume(self, path: str):
        state = self.checkpointer_for(path).load(path, self.ema)
        if self.checkpointer is not None:
            self.checkpointer.protect(path)
        if state.get("batch") and state["batch"]["micro"] * state["batch"]["accum"] * state["batch"]["world"] \
                != self.batch.global_:
            raise CheckpointError(f"{path} was trained with a global batch of "
                                  f"{state['batch']['micro'] * state['batch']['accum'] * state['batch']['world']}, "
                                  f"this run has {self.batch.global_}; the data order would not continue")
        self.progress.restore(state)
        # checkpoints of vim_ds before run ids start a lineage
        self.run_id = state.get("run_id") or self.run_id
        self.progress.last_checkpoint = signals.STOP.last_checkpoint = path
        if self.dist.is_main:
            print(f"resumed {path} at epoch {self.progress.epoch}, step {self.progress.step}", flush=True)

    def checkpointer_for(self, path):
        return self.checkpointer or Checkpointer(self.engine, os.path.dirname(path), self.dist.rank, 0, self.faults)

    # -- one optimizer step -------------------------------------------------------------------------------------

    def _micro_step(self, images, targets, micro: int) -> torch.Tensor:
        step = self.progress.step + 1  # the optimizer step this micro step belongs to
        # per data-parallel rank: the ranks of a sequence group draw the same Mixup and stochastic depth
        seed = derive_seed(self.config.run.seed, step - 1, micro, self.groups.data_rank)
        seed_everything(seed)  # Mixup, drop path
        # VIM_DS_INJECT, VIM_DS_RECORD_BATCHES
        self.faults.before_micro_step(step, micro, seed, images, targets)
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self._compile_errors():
            logits = self.engine(images.to(self.dtype))
            loss = self.faults.on_loss(step, self.criterion(logits.float(), targets))  # nan_loss
            # under --sequence-parallel too: DeepSpeed averages the group's shares (sequence_groups.py)
            self.engine.backward(loss)
        skip = self._skipped_by_us = False
        if self._own_grad_norm and micro == self.batch.accum - 1:
            self._grad_norm = self._full_grad_norm()
            # DeepSpeed skips a non-finite update itself everywhere but in fp32 without ZeRO; the norm is of the
            # all-reduced gradients, so every rank takes the same decision
            # (autocast-bf16 keeps fp32 parameters and a plain optimizer: the same case as fp32)
            skip = not math.isfinite(self._grad_norm) and self.ds.precision in ("fp32", "autocast-bf16")
        if skip:
            with _optimizer_step_skipped(self.engine.optimizer):
                self.engine.step()
            self._skipped_by_us = True
        else:
            # DeepSpeed applies the update on the last micro step of the accumulation
            self.engine.step()
        if self._own_grad_norm and micro == self.batch.accum - 1:
            # the next step's gradients must not start from this one's (DeepSpeed 0.17 left them in bf16)
            drop_stepped_gradients(self.engine.module)
        return loss.detach()

    @contextlib.contextmanager
    def _compile_errors(self):
        """With --compile, a failure of torch.compile itself (it compiles lazily, at the first steps) is reported
        as one line naming the configuration, not as the compiler's traceback."""
        if not self.config.model.compile:
            yield
            return
        try:
            yield
        except TorchDynamoException as exc:
            raise ValueError(f"--compile: torch.compile failed under {self._compile_what} "
                             f"({type(exc).__name__}: {first_line(exc)}); train without --compile") from exc

    @torch.no_grad()
    def _full_grad_norm(self) -> float:
        """The gradient norm where DeepSpeed reports none (ZeRO-0): the gradients are whole and already averaged
        over ranks when the last micro step's backward returns (before clipping, like DeepSpeed's), and unscaled."""
        return module_grad_norm(self.engine)

    def train_epoch(self, metrics) -> bool:
        """Train from the current position to the end of the epoch; False when --max-steps stopped it early.

        Each step's time is split into waiting for data, the engine's forward/backward/step ("compute"), and the
        loop's own bookkeeping ("other": loss all-reduce, checks, EMA, metrics, checkpoints), so the summary can
        say what the loop itself costs.
        """
        p = self.progress
        self.data.sampler.set_epoch(p.epoch, p.step_in_epoch)
        self.engine.train()
        accum = self.batch.accum
        loss_sum, bad, seen = 0.0, 0.0, 0.0
        spent = {"data": 0.0, "compute": 0.0, "other": 0.0}
        t_step = t_mark = time.perf_counter()
        for i, (images, targets, ok) in enumerate(self.data.train_loader):
            t_data = time.perf_counter()
            spent["data"] += t_data - t_mark
            micro = i % accum
            if micro == 0:
                lr = self.engine.get_lr()[0]
            # stays on the device until the step ends
            loss_sum = loss_sum + self._micro_step(images, targets, micro)
            bad += float((ok == 0).sum())
            seen += float(ok.numel())
            t_mark = time.perf_counter()
            spent["compute"] += t_mark - t_data
            if micro < accum - 1:
                continue
            loss_total, bad, seen, *votes = distributed.all_reduce_sum(
                # and agree on a stop signal
                [float(loss_sum), bad, seen, *signals.STOP.votes()], self.device)
            stop = signals.STOP.agreed(votes)
            # each image was read by every rank of its sequence group
            bad, seen = bad / self.groups.size, seen / self.groups.size
            loss = loss_total / (accum * self.dist.world_size)  # mean over the global batch
            p.step += 1
            p.step_in_epoch += 1
            applied = self._check(loss, bad, seen)
            if self.ema is not None and applied:
                self.ema.update()
            grad_norm = self._grad_norm if self._own_grad_norm else self.engine.get_global_grad_norm()
            now = time.perf_counter()
            spent["other"] += now - t_mark
            metrics.step({"step": p.step, "epoch": p.epoch, "loss": loss, "lr": lr,
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "samples_per_sec": self.batch.global_ / max(now - t_step, 1e-9),
                          "step_time": now - t_step, "data_time": spent["data"], "compute_time": spent["compute"],
                          "other_time": spent["other"], "bad_images": int(p.images_bad),
                          **({} if applied else {"skipped": True})})
            self._add_timing(spent)
            # it has trained: from now on what it wrote is its record, whatever ends it
            write_journal.sure()
            loss_sum, bad, seen = 0.0, 0.0, 0.0
            done = p.step >= self.data.total_steps
            at_epoch_end = p.step_in_epoch == self.data.steps_per_epoch
            if stop:
                self._stop(stop)
            interval = self.config.run.save_interval
            if interval and p.step % interval == 0 and not (done or at_epoch_end):
                self.save()
            t_step = t_mark = time.perf_counter()
            # metrics and saving: this loop's cost
            spent = {"data": 0.0, "compute": 0.0, "other": t_mark - now}
            if done and not at_epoch_end:
                return False
        return True

    def _add_timing(self, spent: dict):
        """Run totals for the summary, leaving out each process's first step (worker start-up, first-step setup)."""
        self.timing["seen_steps"] += 1
        if self.timing["seen_steps"] == 1:
            return
        for key, value in spent.items():
            self.timing[key] += value
        self.timing["steps"] += 1

    def _check(self, loss: float, bad: float, seen: float) -> bool:
        """Account for the step just taken; False when its update was skipped. Raises TrainingError to stop."""
        p = self.progress
        p.images_bad += bad
        p.images_seen += seen
        floor = min(len(self.train_set), 1000)
        limit = self.config.data.max_bad_images
        if p.images_bad > limit * p.images_seen and p.images_seen >= floor:
            raise TrainingError(f"{int(p.images_bad)} of {int(p.images_seen)} training images read so far "
                                f"did not decode (more than --max-bad-images {limit:g}); check the dataset (each "
                                f"bad file is named in the log)")
        applied = self.engine.was_step_applied() and not self._skipped_by_us
        if self.ds.precision == "fp16":
            # DeepSpeed's loss scaler skips overflowing steps and lowers the scale: its decision
            return applied
        if applied and math.isfinite(loss):
            p.bad_steps = 0
        else:
            p.bad_steps += 1
            where = f"the last good checkpoint is {p.last_checkpoint}" if p.last_checkpoint else \
                "no checkpoint was saved"
            what = f"loss is {loss}" if not math.isfinite(loss) else "the gradients are not finite"
            # cannot happen with DeepSpeed 0.19's checks; stop rather than train on corrupted weights
            if applied:
                raise TrainingError(f"{what} at step {p.step} and the update was applied; stopping, {where}")
            max_bad_steps = self.config.run.max_bad_steps
            if p.bad_steps >= max_bad_steps:
                raise TrainingError(f"{what} at step {p.step} (epoch {p.epoch}), {p.bad_steps} consecutive "
                                    f"bad step(s) (--max-bad-steps {max_bad_steps}); stopping, {where}")
            if self.dist.is_main:
                print(f"warning: {what} at step {p.step}; the update was skipped ({p.bad_steps} of at most "
                      f"{max_bad_steps - 1} consecutive bad steps)", file=sys.stderr, flush=True)
        return applied

    # -- stopping on a signal (see signals.py) -------------------------------------------------------------------

    def close(self):
        """Stop the data-loader workers now. They ignore SIGTERM and SIGINT (see `data/loader.py`), so they must be
        told to exit, not left to multiprocessing's exit handler, which would SIGTERM and then wait for good."""
        self.data.close()

    def _agreed_stop(self) -> int | None:
        """The signal all ranks stop on, agreed now (a collective: every rank calls it at the same point)."""
        return signals.STOP.agreed(distributed.all_reduce_sum(signals.STOP.votes(), self.device))

    def _stop(self, signum: int, saved: bool = False):
        """The ranks agreed to stop on `signum`: save (unless this step was just saved) and stop, all together."""
        p = self.progress
        if not saved and p.step > p.started_at:
            self.save()
        if self.dist.is_main:
            name = signal.Signals(signum).name
            if self.checkpointer is None:
                where = "nothing saved (no --output_dir)"
            elif p.step == p.started_at and not saved:
                where = "no step taken yet, nothing to save" + \
                    ("; continue with --resume auto" if self.resume_path else "")
            else:
                where = f"saved {p.last_checkpoint}; continue with --resume auto"
            print(f"stopping on {name} after step {p.step} of {self.total_steps}: {where}", flush=True)
        raise signals.StopRequested(signum, p.last_checkpoint)

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _ema_replica(self) -> torch.nn.Module:
        """A plain copy of the model holding the EMA weights, for evaluation (built anew, freed after use)."""
        state = self.ema.full_state_dict()  # a collective under ZeRO-3
        with torch.random.fork_rng(devices=[]):
            replica = self.model.config.build()
        load_state_dict_into(replica, state, strict=True)
        return self.groups.split(replica).to(self.device, self.dtype).eval()

    def _stop_during_evaluation(self) -> bool:
        """Asked by the evaluation at each batch: have the ranks agreed to stop on a signal? A full evaluation can
        outlast the 30 s a launcher leaves between SIGTERM and SIGKILL, so a stop cuts it short."""
        # trained: not the evaluation a resumed run owes (a wait_for_signal_in_eval lets it through)
        p = self.progress
        self.faults.in_evaluation(p.step, self._eval_batches, trained=p.step > p.started_at)
        self._eval_batches += 1
        self._stop_signal = self._agreed_stop()
        return self._stop_signal is not None

    def evaluate(self, metrics, epoch: int) -> dict | None:
        """Evaluate (and log) the model and its EMA; None when a stop signal cut the evaluation short (see
        `_stop_signal`: nothing is logged then)."""
        size = self.config.model.input_size
        shape = (3, size, size)
        self._eval_batches, self._stop_signal = 0, None
        self.engine.eval()
        record = {"step": self.progress.step, "epoch": epoch}
        # autocasts itself
        counts = self.groups.counts_images
        result = evaluate_model(self.engine, self.data.val_loader, self.device, self.dtype, shape,
                          stop=self._stop_during_evaluation, counts=counts)
        record.update({f"eval_{k}": v for k, v in result.items()})
        if self.ema is not None and self._stop_signal is None:
            ema_result = evaluate_model(self._ema_replica(), self.data.val_loader, self.device, self.dtype, shape,
                                  self.autocast_dtype, stop=self._stop_during_evaluation, counts=counts)
            record.update({f"ema_eval_{k}": v for k, v in ema_result.items() if k in ("acc1", "acc5", "loss")})
        self.engine.train()
        self.progress.evaluation_owed = epoch if self._stop_signal is not None else None
        if self._stop_signal is not None:
            return None
        limit = self.config.data.max_bad_images
        if result["bad_images"] > limit * (result["images"] + result["bad_images"]):
            raise TrainingError(f"{result['bad_images']} validation images did not decode (more than "
                                f"--max-bad-images {limit:g}); check the dataset")
        self.progress.best_acc1 = max(self.progress.best_acc1, result["acc1"])
        metrics.evaluation(record)
        return record

    # -- the run ------------------------------------------------------------------------------------------------

    def _per_rank(self, values: list[float]) -> list[list[float]]:
        """For each of this rank's values, the list of every rank's value (one collective)."""
        world, rank = self.dist.world_size, self.dist.rank
        slots = [0.0] * (len(values) * world)
        for i, v in enumerate(values):
            slots[i * world + rank] = v
        slots = distributed.all_reduce_sum(slots, self.device)
        return [slots[i * world:(i + 1) * world] for i in range(len(values))]

    def run_summary(self) -> dict:
        """Where the time went (engine compute vs the loop's own data wait and bookkeeping) and peak memory per
        rank; `vim-ds bench train` and `vim-ds zero-compare` read it from metrics.jsonl."""
        t = self.timing
        total = t["data"] + t["compute"] + t["other"]
        held = state_bytes(self.engine)  # grads: see its docstring (measured after the last step)
        kinds = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")
        per_rank = self._per_rank([peak_memory_mb(self.device)] + [float(held[k]) for k in kinds])
        peaks = per_rank[0]
        state = {f"{kind}_per_rank": [int(v) for v in values] for kind, values in zip(kinds, per_rank[1:])}
        return {"summary": True, "step": self.progress.step, "steps_timed": t["steps"],
                "world_size": self.dist.world_size,
                "zero_stage": self.ds.zero_stage, "precision": self.ds.precision, "engine": self.engine_kind.name,
                "engine_precision": getattr(self.engine, "precision", self.ds.precision),
                "global_batch": self.batch.global_,
                "data_time": t["data"], "compute_time": t["compute"], "other_time": t["other"],
                "loop_overhead": (t["data"] + t["other"]) / total if total else None,
                "peak_memory_mb_per_rank": peaks, "device": self.device.type, **state}

    def _sequence_note(self) -> str:
        g = self.groups
        return f" (groups of {g.size} ranks, each image's tokens split over its group)" if g.size > 1 else ""

    def fit(self) -> dict | None:
        run, p = self.config.run, self.progress
        epochs = self.config.optim.epochs
        metrics = MetricsLog(run.output_dir, self.dist.is_main, self.total_steps, p.step, run.log_interval,
                             run.tensorboard)
        metrics.header(header(self))  # what `vim-ds compare-runs` checks and reports
        if self.dist.is_main:
            name = self.config.model.model
            print(f"training {name} ({self.model.num_params / 1e6:.2f}M parameters) on {len(self.train_set)} "
                  f"images, {self.dist.world_size} rank(s) on {self.device.type}, ZeRO-{self.ds.zero_stage} "
                  f"{self.ds.precision}, global batch {self.batch.global_} = {self.batch.micro} x {self.batch.accum} "
                  f"accumulation x {self.batch.world} ranks{self._sequence_note()}, "
                  f"{self.data.steps_per_epoch} steps/epoch, "
                  f"lr {self.lr:.3e}", flush=True)
        record = None
        p.started_at = p.step
        try:
            stop = self._agreed_stop()  # a signal while the run was being built
            if stop:
                self._stop(stop)
            # the checkpoint's evaluation was cut short by a stop: do it now
            if p.evaluation_owed is not None:
                if self.dist.is_main:
                    print(f"evaluating step {p.step} first: a stop cut its evaluation short", flush=True)
                record = self.evaluate(metrics, p.evaluation_owed)
                if self._stop_signal:  # cut short again: the checkpoint resumed from still owes it
                    self._stop(self._stop_signal, saved=True)
            while p.epoch < epochs and p.step < self.total_steps:
                epoch = p.epoch
                if self.train_epoch(metrics):
                    p.epoch += 1
                    p.step_in_epoch = 0
                record = self.evaluate(metrics, epoch) or record
                self.save()
                # a signal during the evaluation or the save
                stop = self._stop_signal or self._agreed_stop()
                finished = p.step >= self.total_steps or p.epoch >= epochs
                # a finished run whose evaluation is whole: done
                if stop and (self._stop_signal or not finished):
                    self._stop(stop, saved=True)
            if record is None and self.dist.is_main:
                print(f"nothing to train: the run is already at step {p.step} of {self.total_steps}", flush=True)
            metrics.summary(self.run_summary())
        finally:
            metrics.close()
        return record
