"""The training loop: a short class running its parts (data, DeepSpeed engine, loss, EMA, checkpoints, metrics),
which `vim_ds.engine.parts` builds from the options. What its checkpoints save is a `TrainState` (train_state.py);
a `Stopping` (stopping.py) decides where a signal stops it.

Determinism contract: which images form optimizer step s depends only on (seed, epoch) (see
`vim_ds/data/sampler.py`), each image's augmentation only on its sample seed, and the randomness of the step
itself (Mixup, drop path) only on (seed, step, micro step, rank). A resumed run therefore continues exactly as if
it had never stopped, and any rank count or accumulation split of one global batch trains on the same images.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import resource
import sys
import time

import numpy as np
import torch
from torch._dynamo.exc import TorchDynamoException

from ..data.datasets import derive_seed
from ..models.vim import load_state_dict_into
from ..runtime import distributed, write_journal
from ..runtime.deepspeed_engine import drop_stepped_gradients, is_bf16_optimizer, module_grad_norm
from ..runtime.errors import first_line
from .checkpointing import Checkpointer
from .evaluate import evaluate as evaluate_model
from .memory import state_bytes
from .metrics import MetricsLog
from .profiling import FOLDER as PROFILE_FOLDER
from .profiling import StepProfiler
from .run_info import header
from .stopping import Stopping
from .train_state import TrainState


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


class Trainer:
    """Runs the loop over parts built elsewhere: `parts` (a `parts.TrainerParts`: the data, the DeepSpeed config,
    the model's description, the engine, Mixup and the loss, the EMA, the checkpointer, the sequence groups, what
    the checkpoints record, the checkpoint to resume, the rank's fault injection) and `settings` (the
    `parts.LoopSettings` it reads of the options), both made by `parts.build_trainer`. What a checkpoint saves
    of the run is `state` (a `train_state.TrainState`, its position `state.progress`); a stop signal is `stopping`'s
    to decide (a `stopping.Stopping`)."""

    def __init__(self, settings, parts):
        self.settings, self.parts = settings, parts
        self.dist, self.engine, self.batch = parts.dist, parts.engine.engine, parts.ds.batch
        self.state = TrainState(parts.record, parts.run_id)
        self.stopping = Stopping(parts.dist, self.save, saves=parts.checkpointer is not None,
                                 resuming=bool(parts.resume_path), total_steps=parts.data.total_steps,
                                 fault_hook=parts.fault_hook)
        # DeepSpeed reports no norm without ZeRO (but through an optimizer that keeps the gradients itself, below);
        # the baselines report theirs
        self._own_grad_norm = (parts.ds.zero_stage == 0 and not parts.engine.kind.reports_grad_norm_without_zero
                               and not _keeps_its_own_gradients(getattr(self.engine, "optimizer", None)))
        self._grad_norm = None
        # the last optimizer step was made a no-op here (fp32 without ZeRO)
        self._skipped_by_us = False
        self.timing = {"data": 0.0, "compute": 0.0, "other": 0.0, "steps": 0, "seen_steps": 0}
        # --profile-steps: rank 0 profiles those optimizer steps of `fit`
        self.profiler = StepProfiler.idle()

    # -- checkpoints --------------------------------------------------------------------------------------------

    def save(self):
        if self.parts.checkpointer is None:
            return
        path = self.parts.checkpointer.save(self.state)
        self.state.progress.last_checkpoint = path
        self.stopping.checkpoint_saved(path)

    def resume(self, path: str):
        self.state = self._checkpointer_for(path).restore(path, self.state)
        self.stopping.checkpoint_saved(path)
        if self.dist.is_main:
            p = self.state.progress
            print(f"resumed {path} at epoch {p.epoch}, step {p.step}", flush=True)

    def _checkpointer_for(self, path):
        """The run's checkpointer, or (a run that saves nothing) one that reads the checkpoint `path` only."""
        parts = self.parts
        return parts.checkpointer or Checkpointer(self.engine, os.path.dirname(path), self.dist.rank, 0,
                                                  parts.fault_hook, ema=parts.ema)

    # -- one optimizer step -------------------------------------------------------------------------------------

    def _micro_step(self, images, targets, micro: int) -> torch.Tensor:
        parts, engine = self.parts, self.engine
        step = self.state.progress.step + 1  # the optimizer step this micro step belongs to
        # per data-parallel rank: the ranks of a sequence group draw the same Mixup and stochastic depth
        seed = derive_seed(self.settings.seed, step - 1, micro, parts.groups.data_rank)
        seed_everything(seed)  # Mixup, drop path
        # VIM_DS_INJECT, VIM_DS_RECORD_BATCHES
        parts.fault_hook.before_micro_step(step, micro, seed, images, targets)
        images = images.to(self.dist.device, non_blocking=True)
        targets = targets.to(self.dist.device, non_blocking=True)
        if parts.mixup is not None:
            images, targets = parts.mixup(images, targets)
        with self._compile_errors():
            logits = engine(images.to(parts.engine.dtype))
            loss = parts.fault_hook.on_loss(step, parts.criterion(logits.float(), targets))  # nan_loss
            # under --sequence-parallel too: DeepSpeed averages the group's shares (sequence_groups.py)
            engine.backward(loss)
        skip = self._skipped_by_us = False
        if self._own_grad_norm and micro == self.batch.accum - 1:
            self._grad_norm = self._full_grad_norm()
            # DeepSpeed skips a non-finite update itself everywhere but in fp32 without ZeRO; the norm is of the
            # all-reduced gradients, so every rank takes the same decision
            # (autocast-bf16 keeps fp32 parameters and a plain optimizer: the same case as fp32)
            skip = not math.isfinite(self._grad_norm) and parts.ds.precision in ("fp32", "autocast-bf16")
        if skip:
            with _optimizer_step_skipped(engine.optimizer):
                engine.step()
            self._skipped_by_us = True
        else:
            # DeepSpeed applies the update on the last micro step of the accumulation
            engine.step()
        if self._own_grad_norm and micro == self.batch.accum - 1:
            # the next step's gradients must not start from this one's (DeepSpeed 0.17 left them in bf16)
            drop_stepped_gradients(engine.module)
        return loss.detach()

    @contextlib.contextmanager
    def _compile_errors(self):
        """With --compile, a failure of torch.compile itself (it compiles lazily, at the first steps) is reported
        as one line naming the configuration, not as the compiler's traceback."""
        if not self.settings.compile:
            yield
            return
        try:
            yield
        except TorchDynamoException as exc:
            raise ValueError(f"--compile: torch.compile failed under {self.parts.engine.compile_what} "
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
        p, data, ema = self.state.progress, self.parts.data, self.parts.ema
        data.sampler.set_epoch(p.epoch, p.step_in_epoch)
        self.engine.train()
        accum = self.batch.accum
        loss_sum, bad, seen = 0.0, 0.0, 0.0
        spent = {"data": 0.0, "compute": 0.0, "other": 0.0}
        t_step = t_mark = time.perf_counter()
        for i, (images, targets, ok) in enumerate(data.train_loader):
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
                [float(loss_sum), bad, seen, *self.stopping.votes()], self.dist.device)
            # each image was read by every rank of its sequence group
            bad, seen = bad / self.parts.groups.size, seen / self.parts.groups.size
            loss = loss_total / (accum * self.dist.world_size)  # mean over the global batch
            p.step += 1
            p.step_in_epoch += 1
            self.profiler.after_step(p.step)
            applied = self._check(loss, bad, seen)
            if ema is not None and applied:
                ema.update()
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
            done = p.step >= data.total_steps
            at_epoch_end = p.step_in_epoch == data.steps_per_epoch
            self.stopping.after_step(votes, p)
            interval = self.settings.save_interval
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
        p = self.state.progress
        p.images_bad += bad
        p.images_seen += seen
        floor = min(len(self.parts.data.datasets.train_set), 1000)
        limit = self.settings.max_bad_images
        if p.images_bad > limit * p.images_seen and p.images_seen >= floor:
            raise TrainingError(f"{int(p.images_bad)} of {int(p.images_seen)} training images read so far "
                                f"did not decode (more than --max-bad-images {limit:g}); check the dataset (each "
                                f"bad file is named in the log)")
        applied = self.engine.was_step_applied() and not self._skipped_by_us
        if self.parts.ds.precision == "fp16":
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
            max_bad_steps = self.settings.max_bad_steps
            if p.bad_steps >= max_bad_steps:
                raise TrainingError(f"{what} at step {p.step} (epoch {p.epoch}), {p.bad_steps} consecutive "
                                    f"bad step(s) (--max-bad-steps {max_bad_steps}); stopping, {where}")
            if self.dist.is_main:
                print(f"warning: {what} at step {p.step}; the update was skipped ({p.bad_steps} of at most "
                      f"{max_bad_steps - 1} consecutive bad steps)", file=sys.stderr, flush=True)
        return applied

    def close(self):
        """Stop the data-loader workers now. They ignore SIGTERM and SIGINT (see `data/loader.py`), so they must be
        told to exit, not left to multiprocessing's exit handler, which would SIGTERM and then wait for good."""
        self.parts.data.close()

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _ema_replica(self) -> torch.nn.Module:
        """A plain copy of the model holding the EMA weights, for evaluation (built anew, freed after use)."""
        parts = self.parts
        state = parts.ema.full_state_dict()  # a collective under ZeRO-3
        with torch.random.fork_rng(devices=[]):
            replica = parts.model.config.build()
        load_state_dict_into(replica, state, strict=True)
        return parts.groups.split(replica).to(self.dist.device, parts.engine.dtype).eval()

    def evaluate(self, metrics, epoch: int) -> dict | None:
        """Evaluate (and log) the model and its EMA; None when a stop signal cut the evaluation short (see
        `Stopping.cut_evaluation`: nothing is logged then)."""
        parts, p, stopping = self.parts, self.state.progress, self.stopping
        size = self.settings.input_size
        shape = (3, size, size)
        stopping.evaluation_started()
        self.engine.eval()
        record = {"step": p.step, "epoch": epoch}
        read = dict(loader=parts.data.val_loader, device=self.dist.device, dtype=parts.engine.dtype, input_shape=shape,
                    stop=functools.partial(stopping.cuts_evaluation, p), counts=parts.groups.counts_images)
        # autocasts itself
        result = evaluate_model(self.engine, **read)
        record.update({f"eval_{k}": v for k, v in result.items()})
        if parts.ema is not None and stopping.cut_evaluation is None:
            ema_result = evaluate_model(self._ema_replica(), autocast_dtype=parts.engine.autocast_dtype, **read)
            record.update({f"ema_eval_{k}": v for k, v in ema_result.items() if k in ("acc1", "acc5", "loss")})
        self.engine.train()
        p.evaluation_owed = epoch if stopping.cut_evaluation is not None else None
        if stopping.cut_evaluation is not None:
            return None
        limit = self.settings.max_bad_images
        if result["bad_images"] > limit * (result["images"] + result["bad_images"]):
            raise TrainingError(f"{result['bad_images']} validation images did not decode (more than "
                                f"--max-bad-images {limit:g}); check the dataset")
        p.best_acc1 = max(p.best_acc1, result["acc1"])
        metrics.evaluation(record)
        return record

    # -- the run ------------------------------------------------------------------------------------------------

    def _per_rank(self, values: list[float]) -> list[list[float]]:
        """For each of this rank's values, the list of every rank's value (one collective)."""
        world, rank = self.dist.world_size, self.dist.rank
        slots = [0.0] * (len(values) * world)
        for i, v in enumerate(values):
            slots[i * world + rank] = v
        slots = distributed.all_reduce_sum(slots, self.dist.device)
        return [slots[i * world:(i + 1) * world] for i in range(len(values))]

    def run_summary(self) -> dict:
        """Where the time went (engine compute vs the loop's own data wait and bookkeeping) and peak memory per
        rank; `vim-ds bench train` and `vim-ds zero-compare` read it from metrics.jsonl."""
        t, ds, device = self.timing, self.parts.ds, self.dist.device
        total = t["data"] + t["compute"] + t["other"]
        held = state_bytes(self.engine)  # grads: see its docstring (measured after the last step)
        kinds = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")
        per_rank = self._per_rank([peak_memory_mb(device)] + [float(held[k]) for k in kinds])
        peaks = per_rank[0]
        state = {f"{kind}_per_rank": [int(v) for v in values] for kind, values in zip(kinds, per_rank[1:])}
        return {"summary": True, "step": self.state.progress.step, "steps_timed": t["steps"],
                "world_size": self.dist.world_size,
                "zero_stage": ds.zero_stage, "precision": ds.precision, "engine": self.parts.engine.kind.name,
                "engine_precision": getattr(self.engine, "precision", ds.precision),
                "global_batch": self.batch.global_,
                "data_time": t["data"], "compute_time": t["compute"], "other_time": t["other"],
                "loop_overhead": (t["data"] + t["other"]) / total if total else None,
                "peak_memory_mb_per_rank": peaks, "device": device.type, **state}

    def _announce(self):
        """The run's first line: what trains, on what, with which batch and lr."""
        parts, batch = self.parts, self.batch
        g = parts.groups
        groups = f" (groups of {g.size} ranks, each image's tokens split over its group)" if g.size > 1 else ""
        print(f"training {parts.model.config.name} ({parts.model.num_params / 1e6:.2f}M parameters) on "
              f"{len(parts.data.datasets.train_set)} images, {self.dist.world_size} rank(s) on "
              f"{self.dist.device.type}, ZeRO-{parts.ds.zero_stage} {parts.ds.precision}, global batch "
              f"{batch.global_} = {batch.micro} x {batch.accum} accumulation x {batch.world} ranks{groups}, "
              f"{parts.data.steps_per_epoch} steps/epoch, lr {parts.lr:.3e}", flush=True)

    def fit(self) -> dict | None:
        settings, p, stopping = self.settings, self.state.progress, self.stopping
        epochs, total_steps = settings.epochs, self.parts.data.total_steps
        metrics = MetricsLog(settings.output_dir, self.dist.is_main, total_steps, p.step, settings.log_interval,
                             settings.tensorboard)
        # what `vim-ds compare-runs` checks and reports
        metrics.header(header(settings, self.parts, start_step=p.step))
        if self.dist.is_main:
            self._announce()
        record = None
        p.started_at = p.step
        model = self.parts.model.config
        run = dict(model=model.name, model_kwargs=dict(model.kwargs), num_classes=model.num_classes,
                   input_size=settings.input_size, micro_batch=self.batch.micro, micro_steps=self.batch.accum)
        self.profiler = StepProfiler(settings.profile_steps, os.path.join(settings.output_dir, PROFILE_FOLDER),
                                     self.dist.device, self.dist.is_main, self.parts.ds.precision, run)
        self.profiler.after_step(p.step)  # --profile-steps from the run's first step: starts now
        try:
            stopping.before_training(p)  # a signal while the run was being built
            # the checkpoint's evaluation was cut short by a stop: do it now
            if p.evaluation_owed is not None:
                if self.dist.is_main:
                    print(f"evaluating step {p.step} first: a stop cut its evaluation short", flush=True)
                record = self.evaluate(metrics, p.evaluation_owed)
                stopping.after_owed_evaluation(p)
            while p.epoch < epochs and p.step < total_steps:
                epoch = p.epoch
                if self.train_epoch(metrics):
                    p.epoch += 1
                    p.step_in_epoch = 0
                record = self.evaluate(metrics, epoch) or record
                self.save()
                # a signal during the evaluation or the save; a finished run whose evaluation is whole: done
                stopping.after_epoch(p, finished=p.step >= total_steps or p.epoch >= epochs)
            if record is None and self.dist.is_main:
                print(f"nothing to train: the run is already at step {p.step} of {total_steps}", flush=True)
            metrics.summary(self.run_summary())
        finally:
            self.profiler.close()
            metrics.close()
        return record
