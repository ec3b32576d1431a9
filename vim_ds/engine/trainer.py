"""The training loop: a short class holding its parts (data, DeepSpeed engine, loss, EMA, checkpoints, metrics).

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
import signal
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from ..data.datasets import derive_seed
from ..models import param_groups
from . import distributed, faults, signals
from .ds_config import PRECISION_DTYPES, autocast_dtype
from .init_weights import first_line
from .components import model_config


class TrainingError(RuntimeError):
    """The run cannot go on (the loss diverged, too many unreadable images, ...)."""


def _declare_direct_weight_reads(model: torch.nn.Module):
    """ZeRO-3 gathers a module's parameters when the module is called; the Vim mixer reads its children's weights
    (in_proj, conv1d, x_proj, dt_proj, out_proj) without calling them. Eager DeepSpeed notices such a read when it
    happens and gathers then; a compiled graph reads the partitioned placeholder instead, so declare them."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    from ..models.vim import BiMambaMixer

    for module in model.modules():
        if isinstance(module, BiMambaMixer):
            for child in module.children():
                for param in child.parameters():
                    register_external_parameter(module, param)


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
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Trainer:
    def __init__(self, args, dist_info: distributed.DistInfo):
        from ..data import GlobalBatchSampler, ShardedEvalSampler, build_dataset
        from .components import dataset_config
        from .ds_config import prepare_ds_config
        from .ema import ShardedEMA
        from .checkpointing import Checkpointer
        from .optim import PerStepScheduler, ds_auto_values

        self.args, self.dist = args, dist_info
        self.device = dist_info.device

        # data: which images go into which optimizer step is fixed here, before the engine exists
        self.data_config = dataset_config(args)
        self.train_set, num_classes = build_dataset(self.data_config, is_train=True)
        self.val_set, _ = build_dataset(self.data_config, is_train=False)
        self.num_classes = num_classes
        self.model_config = model_config(args, num_classes)  # what the model is: built below, checked on resume
        # the class names in label order: part of what the run is (recorded in its checkpoints, compared on resume)
        self.classes = [str(name) for name in getattr(self.train_set, "classes", None) or []]

        def auto_values(batch):
            values = ds_auto_values(args, batch)
            self.lr = values["optimizer.params.lr"]
            return values

        if not args.deepspeed_config:
            raise ValueError("--deepspeed_config is required, e.g. --deepspeed_config ds_configs/zero2.json")
        self.ds = prepare_ds_config(args.deepspeed_config, world_size=dist_info.world_size,
                                    device_type=self.device.type, micro_batch=args.batch_size,
                                    accum_steps=args.accum_steps, precision=args.precision, auto_values=auto_values)
        self.resume_path = self._plan_resume(args)
        self.batch = self.ds.batch
        # a number written in the JSON wins over the command line; the optimizer starts from what is there
        self.lr = self.ds.config.get("optimizer", {}).get("params", {}).get("lr", self.lr)
        from .optim import check_lr_settings, peak_lr  # as the preflight did: floor and warmup start vs the peak

        for note in check_lr_settings(args, *peak_lr(args, self.ds)):
            if dist_info.is_main:
                print(note, flush=True)
        self.dtype = PRECISION_DTYPES[self.ds.precision]  # parameters and inputs (fp32 under autocast-bf16)
        self.autocast_dtype = autocast_dtype(self.ds.precision)  # the DeepSpeed engine enters it itself
        from ..data.mixup import build_mixup  # timm's Mixup, mixing a host batch pair by pair (same numbers)
        from .components import mixup_config

        self.mixup = build_mixup(mixup_config(args), self.batch.micro, num_classes)

        self.sampler = GlobalBatchSampler(len(self.train_set), micro_batch=self.batch.micro,
                                          accum_steps=self.batch.accum, rank=dist_info.rank,
                                          world_size=dist_info.world_size, seed=args.seed,
                                          repeats=3 if args.repeated_aug else 1)
        self.steps_per_epoch = self.sampler.steps_per_epoch
        self.total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.train_loader = self._loader(self.train_set, self.sampler, "train")
        eval_batch = max(1, int(1.5 * self.batch.micro))
        self.val_loader = self._loader(self.val_set, ShardedEvalSampler(
            len(self.val_set), batch_size=eval_batch, rank=dist_info.rank, world_size=dist_info.world_size), "val")

        # model and engine
        seed_everything(args.seed)  # identical initial weights on every rank
        model = self.model_config.build()
        if args.finetune:
            from ..checkpoint.class_names import data_source, load_finetune_weights  # refused: a head for other names

            note = load_finetune_weights(model, args.finetune, self.classes, data_source(self.data_config))
            if note and dist_info.is_main:
                print(note, flush=True)
        from . import init_weights  # --init-weights / --save-init-weights, before the engine copies the weights

        self.init_weights_info = init_weights.apply(args, model, {
            **self.model_config.description(), "step": 0, "epoch": 0, "zero_stage": self.ds.zero_stage,
            "precision": self.ds.precision, "tag": "init", "classes": self.classes}, dist_info)
        self.num_params = sum(p.numel() for p in model.parameters())
        warmup_steps = int(round(args.warmup_epochs * self.steps_per_epoch))

        def scheduler(optimizer):
            return PerStepScheduler(optimizer, total_steps=args.epochs * self.steps_per_epoch,
                                    warmup_steps=warmup_steps, warmup_lr=args.warmup_lr, min_lr=args.min_lr)

        self.engine_kind = getattr(args, "engine", "deepspeed")
        if self.engine_kind == "deepspeed":
            import deepspeed

            self.engine, _, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=param_groups(model, args.weight_decay), config=self.ds.config,
                lr_scheduler=scheduler)
            if args.compile:
                self._compile(args.compile_backend)
        else:  # a PyTorch DDP/FSDP baseline for `vim-ds zero-compare`: same model, groups, data, loss, schedule
            from .baselines import TorchEngine

            self.engine = TorchEngine(self.engine_kind, model, param_groups(model, args.weight_decay), self.ds,
                                      self.device, scheduler)
            self.scheduler = self.engine.scheduler
            self.dtype = torch.float32  # fp32 parameters (bf16: under autocast)
        self.criterion = self._build_criterion()
        # DeepSpeed reports no norm without ZeRO; the baselines report theirs
        self._own_grad_norm = self.ds.zero_stage == 0 and self.engine_kind == "deepspeed"
        self._grad_norm = None
        self._skipped_by_us = False  # the last optimizer step was made a no-op here (fp32 without ZeRO)
        self.ema = ShardedEMA(self.engine.module, args.model_ema_decay) if args.model_ema else None
        saves = args.output_dir and self.engine_kind == "deepspeed"  # baselines save nothing
        self.checkpointer = Checkpointer(self.engine, os.path.join(args.output_dir, "checkpoints"), dist_info.rank,
                                         args.keep_checkpoints) if saves else None

        # which run this is: a resumed run continues its checkpoint's lineage, and prunes only that lineage's
        # checkpoints (see Checkpointer._prune)
        import uuid

        self.run_id = distributed.broadcast_object(uuid.uuid4().hex[:16])
        # position in the run
        self.epoch = 0
        self.step = 0            # optimizer steps done
        self.step_in_epoch = 0
        self.images_seen = self.images_bad = 0.0
        self.best_acc1 = 0.0
        self.last_checkpoint = None
        self.bad_steps = 0       # consecutive steps whose update was skipped (non-finite loss or gradients)
        self._started_at = 0     # the step this process started from (stopping: was anything trained since?)
        self._stop_signal = None  # the signal the ranks agreed on during an evaluation, which it cut short
        # the epoch whose evaluation a stop signal cut short (recorded in the checkpoint saved then, so that the run
        # which resumes it evaluates those same weights first: a stop loses no evaluation, the final one included)
        self.evaluation_owed: int | None = None
        self._eval_batches = 0
        self.timing = {"data": 0.0, "compute": 0.0, "other": 0.0, "steps": 0, "seen_steps": 0}

    # -- construction helpers -----------------------------------------------------------------------------------

    def _compile(self, backend: str):
        """torch.compile through DeepSpeed (its hooks stay in place); what DeepSpeed refuses becomes one line."""
        deepcompile = bool(getattr(self.engine, "is_deepcompile_enabled", lambda: False)())
        self._compile_what = f"ZeRO-{self.ds.zero_stage}" + (" with DeepCompile" if deepcompile else "")
        if self.ds.zero_stage == 3:
            _declare_direct_weight_reads(self.engine.module)
        try:
            self.engine.compile(backend=backend)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed raises many types; the user needs the reason
            raise ValueError(f"--compile: DeepSpeed cannot compile the model under {self._compile_what} "
                             f"({first_line(exc)}); train without --compile") from exc

    def _loader(self, dataset, batch_sampler, name: str):
        from ..data.loader import build_loader  # workers from a fork server, --data-timeout: see its docstring
        from .components import loader_config

        return build_loader(dataset, batch_sampler, loader_config(self.args), name,
                            local_world_size=self.dist.local_world_size,
                            persistent=True, pin_memory=self.args.pin_mem and self.device.type != "cpu",
                            leave_signals_to_owner=True, stall_at=faults.number(f"stall_{name}", self.dist.rank),
                            signal_at=faults.signal_at(faults.number(f"signal_in_{name}", self.dist.rank)))

    def _build_criterion(self):
        from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

        if self.mixup is not None:
            return SoftTargetCrossEntropy()  # Mixup already smooths the targets
        if self.args.smoothing > 0:
            return LabelSmoothingCrossEntropy(smoothing=self.args.smoothing)
        return torch.nn.CrossEntropyLoss()

    # -- checkpoints --------------------------------------------------------------------------------------------

    def client_state(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "step_in_epoch": self.step_in_epoch,
                "images_seen": self.images_seen, "images_bad": self.images_bad, "best_acc1": self.best_acc1,
                "world_size": self.dist.world_size, "batch": asdict(self.batch), "precision": self.ds.precision,
                "zero_stage": self.ds.zero_stage, **self.model_config.description(), "classes": self.classes,
                "args": vars(self.args),
                "run_id": self.run_id, "evaluation_owed": self.evaluation_owed,
                # what DeepSpeed's ds_to_universal needs to re-partition this checkpoint for another rank count
                # (pure data parallelism: no tensor-parallel patterns to declare)
                "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}

    def save(self):
        if self.checkpointer is None:
            return
        self.last_checkpoint = self.checkpointer.save(self.client_state(), self.ema,
                                                      summary={"model": self.args.model,
                                                               "world_size": self.dist.world_size,
                                                               "zero_stage": self.ds.zero_stage, "run_id": self.run_id})
        signals.STOP.last_checkpoint = self.last_checkpoint

    def resume(self, path: str):
        from ..checkpoint.files import CheckpointError

        state = self.checkpointer_for(path).load(path, self.ema)
        if self.checkpointer is not None:
            self.checkpointer.protect(path)
        if state.get("batch") and state["batch"]["micro"] * state["batch"]["accum"] * state["batch"]["world"] \
                != self.batch.global_:
            raise CheckpointError(f"{path} was trained with a global batch of "
                                  f"{state['batch']['micro'] * state['batch']['accum'] * state['batch']['world']}, "
                                  f"this run has {self.batch.global_}; the data order would not continue")
        self.epoch, self.step, self.step_in_epoch = state["epoch"], state["step"], state["step_in_epoch"]
        self.images_seen, self.images_bad = state.get("images_seen", 0.0), state.get("images_bad", 0.0)
        self.best_acc1 = state.get("best_acc1", 0.0)
        self.run_id = state.get("run_id") or self.run_id  # checkpoints of vim_ds before run ids start a lineage
        self.evaluation_owed = state.get("evaluation_owed")
        self.last_checkpoint = signals.STOP.last_checkpoint = path
        if self.dist.is_main:
            print(f"resumed {path} at epoch {self.epoch}, step {self.step}", flush=True)

    def _plan_resume(self, args) -> str:
        """The checkpoint directory to resume ('' for none), decided before the engine exists: a ZeRO-1/2/3
        checkpoint saved by another number of ranks is first re-partitioned by DeepSpeed's universal checkpoint
        conversion, and the engine is configured to load it so."""
        from ..checkpoint import deepspeed_dir
        from ..checkpoint.files import CheckpointError, sniff  # sniff: a weights file by its content, any name
        from .checkpointing import universal_copy

        path = args.resume
        if not path or args.eval:
            return ""
        if path == "auto":
            path = _auto_resume_path(args)
        elif path.endswith((".pth", ".pt", ".bin", ".safetensors")) or (os.path.isfile(path) and sniff(path)[0]):
            raise CheckpointError(f"--resume {path}: a weights file has no optimizer state; use "
                                  f"--finetune {path} to start from it (or --eval to evaluate it)")
        if not path:
            return ""
        if deepspeed_dir.is_tag_dir(path) and not deepspeed_dir.is_complete(path):
            raise CheckpointError(f"--resume {path}: an interrupted save (no {deepspeed_dir.MARKER}), never "
                                  f"resumed; resume its save directory for the newest complete checkpoint")
        save_dir, tag = deepspeed_dir.resolve(path, fall_back=True)  # the newest intact one (checksums)
        if self.dist.is_main:
            for broken in deepspeed_dir.incomplete_tags(save_dir):
                if deepspeed_dir.tag_step(broken) > deepspeed_dir.tag_step(tag):
                    print(f"warning: {os.path.join(save_dir, broken)} is an interrupted save (no "
                          f"{deepspeed_dir.MARKER}); not resuming it", file=sys.stderr, flush=True)
        from ..checkpoint.class_names import data_source
        from .resume_check import check  # another stage, precision or model: one line now, not DeepSpeed's failure

        tag_dir = os.path.join(save_dir, tag)
        already_universal = os.path.isdir(os.path.join(tag_dir, "zero"))  # `vim-ds convert --universal`
        marker = deepspeed_dir.read_marker(tag_dir) if deepspeed_dir.is_complete(tag_dir) else {}
        saved_world, saved_stage = marker.get("world_size"), marker.get("zero_stage", 0)
        to_convert = not already_universal and saved_world not in (None, self.dist.world_size) and bool(saved_stage)
        note = check(tag_dir, self.model_config, data_source(self.data_config), self.ds,
                     universal=already_universal or to_convert,
                     classes=self.classes)  # and other class names: labels that would mean other classes
        if note and self.dist.is_main:
            print(note, flush=True)
        from .output_dir import resume_overwrite_error  # a branch from an older step: never over a newer one

        problem = resume_overwrite_error(args, tag_dir)
        if problem:
            raise CheckpointError(problem)
        if already_universal:
            self.ds.config.setdefault("checkpoint", {})["load_universal"] = True
            return tag_dir
        if not to_convert:
            return tag_dir
        if self.dist.is_main:
            print(f"{os.path.join(save_dir, tag)} was saved by {saved_world} ranks (ZeRO-{saved_stage}); "
                  f"converting it to a universal checkpoint for {self.dist.world_size}", flush=True)
            universal = universal_copy(save_dir, tag)
        else:
            universal = None
        universal = distributed.broadcast_object(universal)
        self.ds.config.setdefault("checkpoint", {})["load_universal"] = True
        return os.path.join(save_dir, universal)

    def checkpointer_for(self, path):
        from .checkpointing import Checkpointer

        return self.checkpointer or Checkpointer(self.engine, os.path.dirname(path), self.dist.rank, 0)

    # -- one optimizer step -------------------------------------------------------------------------------------

    def _micro_step(self, images, targets, micro: int) -> torch.Tensor:
        seed = derive_seed(self.args.seed, self.step, micro, self.dist.rank)
        seed_everything(seed)  # Mixup, drop path
        faults.record_batch(self.step + 1, micro, self.dist.rank, seed, images, targets)  # VIM_DS_RECORD_BATCHES
        if micro == 0 and faults.active("signal_in_step", self.step + 1, self.dist.rank):
            faults.send_signal()
        if micro == 0 and faults.active("hang", self.step + 1, self.dist.rank):
            faults.hang()
        if micro == 0 and faults.active("wait_for_signal", self.step + 1, self.dist.rank):
            faults.wait_for_signal()
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self._compile_errors():
            logits = self.engine(images.to(self.dtype))
            loss = self.criterion(logits.float(), targets)
            if faults.active("nan_loss", self.step + 1, self.dist.rank):
                loss = loss * float("nan")
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
            self.engine.step()  # DeepSpeed applies the update on the last micro step of the accumulation
        return loss.detach()

    @contextlib.contextmanager
    def _compile_errors(self):
        """With --compile, a failure of torch.compile itself (it compiles lazily, at the first steps) is reported
        as one line naming the configuration, not as the compiler's traceback."""
        if not self.args.compile:
            yield
            return
        from torch._dynamo.exc import TorchDynamoException

        try:
            yield
        except TorchDynamoException as exc:
            raise ValueError(f"--compile: torch.compile failed under {self._compile_what} "
                             f"({type(exc).__name__}: {first_line(exc)}); train without --compile") from exc

    @torch.no_grad()
    def _full_grad_norm(self) -> float:
        """The gradient norm where DeepSpeed reports none (ZeRO-0): the gradients are whole and already averaged
        over ranks when the last micro step's backward returns (before clipping, like DeepSpeed's)."""
        norms = [p.grad.float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0

    def train_epoch(self, metrics) -> bool:
        """Train from the current position to the end of the epoch; False when --max-steps stopped it early.

        Each step's time is split into waiting for data, the engine's forward/backward/step ("compute"), and the
        loop's own bookkeeping ("other": loss all-reduce, checks, EMA, metrics, checkpoints), so the summary can
        say what the loop itself costs.
        """
        self.sampler.set_epoch(self.epoch, self.step_in_epoch)
        self.engine.train()
        accum = self.batch.accum
        loss_sum, bad, seen = 0.0, 0.0, 0.0
        spent = {"data": 0.0, "compute": 0.0, "other": 0.0}
        t_step = t_mark = time.perf_counter()
        for i, (images, targets, ok) in enumerate(self.train_loader):
            t_data = time.perf_counter()
            spent["data"] += t_data - t_mark
            micro = i % accum
            if micro == 0:
                lr = self.engine.get_lr()[0]
            loss_sum = loss_sum + self._micro_step(images, targets, micro)  # stays on the device until the step ends
            bad += float((ok == 0).sum())
            seen += float(ok.numel())
            t_mark = time.perf_counter()
            spent["compute"] += t_mark - t_data
            if micro < accum - 1:
                continue
            loss_total, bad, seen, *votes = distributed.all_reduce_sum(
                [float(loss_sum), bad, seen, *signals.STOP.votes()], self.device)  # and agree on a stop signal
            stop = signals.STOP.agreed(votes)
            loss = loss_total / (accum * self.dist.world_size)  # mean over the global batch
            self.step += 1
            self.step_in_epoch += 1
            applied = self._check(loss, bad, seen)
            if self.ema is not None and applied:
                self.ema.update()
            grad_norm = self._grad_norm if self._own_grad_norm else self.engine.get_global_grad_norm()
            now = time.perf_counter()
            spent["other"] += now - t_mark
            metrics.step({"step": self.step, "epoch": self.epoch, "loss": loss, "lr": lr,
                          "grad_norm": None if grad_norm is None else float(grad_norm),
                          "samples_per_sec": self.batch.global_ / max(now - t_step, 1e-9),
                          "step_time": now - t_step, "data_time": spent["data"], "compute_time": spent["compute"],
                          "other_time": spent["other"], "bad_images": int(self.images_bad),
                          **({} if applied else {"skipped": True})})
            self._add_timing(spent)
            loss_sum, bad, seen = 0.0, 0.0, 0.0
            done = self.step >= self.total_steps
            at_epoch_end = self.step_in_epoch == self.steps_per_epoch
            if stop:
                self._stop(stop)
            if self.args.save_interval and self.step % self.args.save_interval == 0 and not (done or at_epoch_end):
                self.save()
            t_step = t_mark = time.perf_counter()
            spent = {"data": 0.0, "compute": 0.0, "other": t_mark - now}  # metrics and saving: this loop's cost
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
        self.images_bad += bad
        self.images_seen += seen
        floor = min(len(self.train_set), 1000)
        limit = self.args.max_bad_images
        if self.images_bad > limit * self.images_seen and self.images_seen >= floor:
            raise TrainingError(f"{int(self.images_bad)} of {int(self.images_seen)} training images read so far "
                                f"did not decode (more than --max-bad-images {limit:g}); check the dataset (each "
                                f"bad file is named in the log)")
        applied = self.engine.was_step_applied() and not self._skipped_by_us
        if self.ds.precision == "fp16":
            return applied  # DeepSpeed's loss scaler skips overflowing steps and lowers the scale: its decision
        if applied and math.isfinite(loss):
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            where = f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
                "no checkpoint was saved"
            what = f"loss is {loss}" if not math.isfinite(loss) else "the gradients are not finite"
            if applied:  # cannot happen with DeepSpeed 0.19's checks; stop rather than train on corrupted weights
                raise TrainingError(f"{what} at step {self.step} and the update was applied; stopping, {where}")
            if self.bad_steps >= self.args.max_bad_steps:
                raise TrainingError(f"{what} at step {self.step} (epoch {self.epoch}), {self.bad_steps} consecutive "
                                    f"bad step(s) (--max-bad-steps {self.args.max_bad_steps}); stopping, {where}")
            if self.dist.is_main:
                print(f"warning: {what} at step {self.step}; the update was skipped ({self.bad_steps} of at most "
                      f"{self.args.max_bad_steps - 1} consecutive bad steps)", file=sys.stderr, flush=True)
        return applied

    # -- stopping on a signal (see signals.py) -------------------------------------------------------------------

    def close(self):
        """Stop the data-loader workers now. They ignore SIGTERM and SIGINT (see `data/loader.py`), so they must be
        told to exit, not left to multiprocessing's exit handler, which would SIGTERM and then wait for good."""
        for loader in (self.train_loader, self.val_loader):
            loader.shutdown()

    def _agreed_stop(self) -> int | None:
        """The signal all ranks stop on, agreed now (a collective: every rank calls it at the same point)."""
        return signals.STOP.agreed(distributed.all_reduce_sum(signals.STOP.votes(), self.device))

    def _stop(self, signum: int, saved: bool = False):
        """The ranks agreed to stop on `signum`: save (unless this step was just saved) and stop, all together."""
        if not saved and self.step > self._started_at:
            self.save()
        if self.dist.is_main:
            name = signal.Signals(signum).name
            if self.checkpointer is None:
                where = "nothing saved (no --output_dir)"
            elif self.step == self._started_at and not saved:
                where = "no step taken yet, nothing to save" + \
                    ("; continue with --resume auto" if self.resume_path else "")
            else:
                where = f"saved {self.last_checkpoint}; continue with --resume auto"
            print(f"stopping on {name} after step {self.step} of {self.total_steps}: {where}", flush=True)
        raise signals.StopRequested(signum, self.last_checkpoint)

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _ema_replica(self) -> torch.nn.Module:
        """A plain copy of the model holding the EMA weights, for evaluation (built anew, freed after use)."""
        from ..models.vim import load_state_dict_into

        state = self.ema.full_state_dict()  # a collective under ZeRO-3
        with torch.random.fork_rng(devices=[]):
            replica = self.model_config.build()
        load_state_dict_into(replica, state, strict=True)
        return replica.to(self.device, self.dtype).eval()

    def _stop_during_evaluation(self) -> bool:
        """Asked by the evaluation at each batch: have the ranks agreed to stop on a signal? A full evaluation can
        outlast the 30 s a launcher leaves between SIGTERM and SIGKILL, so a stop cuts it short."""
        if faults.active("signal_in_eval", self.step, self.dist.rank) and self._eval_batches == 0:
            faults.send_signal()
        if faults.active("wait_for_signal_in_eval", self.step, self.dist.rank) and self._eval_batches == 0 \
                and self.step > self._started_at:  # not in the evaluation a resumed run owes: that one goes through
            faults.wait_for_signal()
        self._eval_batches += 1
        self._stop_signal = self._agreed_stop()
        return self._stop_signal is not None

    def evaluate(self, metrics, epoch: int) -> dict | None:
        """Evaluate (and log) the model and its EMA; None when a stop signal cut the evaluation short (see
        `_stop_signal`: nothing is logged then)."""
        from .evaluate import evaluate

        shape = (3, self.args.input_size, self.args.input_size)
        self._eval_batches, self._stop_signal = 0, None
        self.engine.eval()
        record = {"step": self.step, "epoch": epoch}
        result = evaluate(self.engine, self.val_loader, self.device, self.dtype, shape,  # autocasts itself
                          stop=self._stop_during_evaluation)
        record.update({f"eval_{k}": v for k, v in result.items()})
        if self.ema is not None and self._stop_signal is None:
            ema_result = evaluate(self._ema_replica(), self.val_loader, self.device, self.dtype, shape,
                                  self.autocast_dtype, stop=self._stop_during_evaluation)
            record.update({f"ema_eval_{k}": v for k, v in ema_result.items() if k in ("acc1", "acc5", "loss")})
        self.engine.train()
        self.evaluation_owed = epoch if self._stop_signal is not None else None
        if self._stop_signal is not None:
            return None
        if result["bad_images"] > self.args.max_bad_images * (result["images"] + result["bad_images"]):
            raise TrainingError(f"{result['bad_images']} validation images did not decode (more than "
                                f"--max-bad-images {self.args.max_bad_images:g}); check the dataset")
        self.best_acc1 = max(self.best_acc1, result["acc1"])
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
        from .memory import state_bytes  # grads: see its docstring (measured after the last step)

        t = self.timing
        total = t["data"] + t["compute"] + t["other"]
        held = state_bytes(self.engine)
        kinds = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")
        per_rank = self._per_rank([peak_memory_mb(self.device)] + [float(held[k]) for k in kinds])
        peaks = per_rank[0]
        state = {f"{kind}_per_rank": [int(v) for v in values] for kind, values in zip(kinds, per_rank[1:])}
        return {"summary": True, "step": self.step, "steps_timed": t["steps"], "world_size": self.dist.world_size,
                "zero_stage": self.ds.zero_stage, "precision": self.ds.precision, "engine": self.engine_kind,
                "engine_precision": getattr(self.engine, "precision", self.ds.precision),
                "global_batch": self.batch.global_,
                "data_time": t["data"], "compute_time": t["compute"], "other_time": t["other"],
                "loop_overhead": (t["data"] + t["other"]) / total if total else None,
                "peak_memory_mb_per_rank": peaks, "device": self.device.type, **state}

    def fit(self) -> dict | None:
        from .metrics import MetricsLog

        args = self.args
        metrics = MetricsLog(args.output_dir, self.dist.is_main, self.total_steps, self.step, args.log_interval,
                             args.tensorboard)
        from .run_info import header

        metrics.header(header(self))  # what `vim-ds compare-runs` checks and reports
        if self.dist.is_main:
            print(f"training {args.model} ({self.num_params / 1e6:.2f}M parameters) on {len(self.train_set)} images, "
                  f"{self.dist.world_size} rank(s) on {self.device.type}, ZeRO-{self.ds.zero_stage} "
                  f"{self.ds.precision}, global batch {self.batch.global_} = {self.batch.micro} x {self.batch.accum} "
                  f"accumulation x {self.dist.world_size} ranks, {self.steps_per_epoch} steps/epoch, lr {self.lr:.3e}",
                  flush=True)
        record = None
        self._started_at = self.step
        try:
            stop = self._agreed_stop()  # a signal while the run was being built
            if stop:
                self._stop(stop)
            if self.evaluation_owed is not None:  # the checkpoint's evaluation was cut short by a stop: do it now
                if self.dist.is_main:
                    print(f"evaluating step {self.step} first: a stop cut its evaluation short", flush=True)
                record = self.evaluate(metrics, self.evaluation_owed)
                if self._stop_signal:  # cut short again: the checkpoint resumed from still owes it
                    self._stop(self._stop_signal, saved=True)
            while self.epoch < args.epochs and self.step < self.total_steps:
                epoch = self.epoch
                if self.train_epoch(metrics):
                    self.epoch += 1
                    self.step_in_epoch = 0
                record = self.evaluate(metrics, epoch) or record
                self.save()
                stop = self._stop_signal or self._agreed_stop()  # a signal during the evaluation or the save
                finished = self.step >= self.total_steps or self.epoch >= args.epochs
                if stop and (self._stop_signal or not finished):  # a finished run whose evaluation is whole: done
                    self._stop(stop, saved=True)
            if record is None and self.dist.is_main:
                print(f"nothing to train: the run is already at step {self.step} of {self.total_steps}", flush=True)
            metrics.summary(self.run_summary())
        finally:
            metrics.close()
        return record


def _auto_resume_path(args) -> str:
    from ..checkpoint import deepspeed_dir

    if not args.output_dir:
        raise ValueError("--resume auto looks in --output_dir; none was given")
    save_dir = os.path.join(args.output_dir, "checkpoints")
    if os.path.isdir(save_dir) and deepspeed_dir.complete_tags(save_dir):
        return save_dir
    interrupted = deepspeed_dir.incomplete_tags(save_dir) if os.path.isdir(save_dir) else []
    if interrupted and os.environ.get("RANK", "0") == "0":
        print(f"warning: --resume auto: {save_dir} holds only interrupted saves ({', '.join(interrupted)}: no "
              f"{deepspeed_dir.MARKER}), which are never resumed; starting from step 0", file=sys.stderr, flush=True)
    return ""  # nothing saved yet: start from scratch
