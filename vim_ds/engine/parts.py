"""The parts of a training run, each built by a small function from the run's options (its `config`, a
`run_config.RunConfig`) and the rank's `DistInfo`: the data, the DeepSpeed config, the resume plan, the
model, the engine (DeepSpeed, or a DDP/FSDP baseline) with its schedule, the loss, the EMA, the checkpointer and
what the checkpoints record of the run. `build_trainer` builds them in the order a run needs and hands them to
`Trainer` as one frozen `TrainerParts`, with the `LoopSettings` the loop reads of the options; the Trainer only
runs the loop.

The order is part of the contract (see `build_trainer`): the resume plan is decided before the engine exists (a
universal checkpoint changes the engine's config), the initial weights are drawn right after `seed_everything` so that
every rank draws the same ones, and collectives (the resume plan's conversion, the run id) come at the same point on
every rank.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from dataclasses import dataclass

import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from ..checkpoint import deepspeed_dir
from ..checkpoint.class_names import data_source, load_finetune_weights
from ..checkpoint.files import CheckpointError, sniff
from ..config.components import dataset_config, loader_config, mixup_config, model_config
from ..config.ds_config import autocast_dtype, prepare_ds_config
from ..config.run_config import RunConfig
from ..config.run_rules import profile_steps
from ..config.training_engines import TrainingEngine, training_engine
from ..data import GlobalBatchSampler, build_dataset
from ..data import loader as data_loader
from ..data import mixup as data_mixup
from ..models import param_groups
from ..runtime import distributed, faults, sequence_groups, write_journal
from ..runtime.sequence_groups import SequenceGroups
from . import init_weights, resume_check
from .checkpointing import UNIVERSAL_SUFFIX, Checkpointer, universal_copy
from .ema import ShardedEMA
from .evaluate import eval_sampler
from .optim import PerStepScheduler, check_lr_settings, ds_auto_values, peak_lr, settle_shared
from .output_dir import latest_gone, resume_overwrite_error
from .train_state import RunRecord
from .trainer import Trainer, seed_everything


@dataclass
class Datasets:
    """The training and validation sets, and the class names in label order (part of what the run is: recorded in
    its checkpoints, compared on resume)."""
    config: object  # data.datasets.DatasetConfig
    train_set: object
    val_set: object
    num_classes: int
    classes: list[str]


@dataclass
class Data:
    """The datasets and how they are read: which images go into which optimizer step is fixed by the sampler."""
    datasets: Datasets
    sampler: object  # data.GlobalBatchSampler
    train_loader: object
    val_loader: object
    steps_per_epoch: int
    total_steps: int

    def close(self):
        """Stop the loaders' workers (see Trainer.close)."""
        for loader in (self.train_loader, self.val_loader):
            loader.shutdown()


@dataclass
class Model:
    """What the model is (built from `config`, checked on resume) and where its initial weights came from."""
    config: object  # models.ModelConfig
    num_params: int
    init_weights_info: dict


@dataclass
class Engine:
    """The engine that trains the model (a DeepSpeed engine, or a baseline's `baselines.TorchEngine`), its lr
    schedule, and the dtypes of the parameters and of autocast."""
    engine: object
    scheduler: object
    kind: TrainingEngine      # what it can do (training_engines.ENGINES)
    dtype: torch.dtype        # parameters and inputs (fp32 under autocast-bf16)
    autocast_dtype: torch.dtype | None  # the DeepSpeed engine enters it itself
    # with --compile: what was compiled ("ZeRO-2", ...), for its error messages
    compile_what: str | None


@dataclass(frozen=True)
class TrainerParts:
    """Everything the Trainer runs, built by `build_trainer` (frozen: the loop replaces none of them)."""
    dist: distributed.DistInfo
    data: Data
    ds: object                    # config.ds_config.PreparedConfig: the batch, precision and ZeRO stage
    lr: float                     # the peak lr the optimizer starts from (build_ds_config)
    model: Model
    engine: Engine
    mixup: object | None          # data.mixup's Mixup (None without --mixup/--cutmix)
    criterion: torch.nn.Module
    ema: ShardedEMA | None
    checkpointer: Checkpointer | None  # None: the run saves nothing (no --output_dir, or a baseline engine)
    groups: SequenceGroups        # --sequence-parallel: this rank's group (one group per rank without it)
    record: RunRecord             # what its checkpoints record of the run
    run_id: str                   # new_run_id (a resume continues its checkpoint's lineage instead)
    resume_path: str = ""         # the checkpoint to resume (plan_resume), '' for none
    fault_hook: faults.FaultHook = faults.NO_FAULTS  # VIM_DS_INJECT (faults.for_rank)


@dataclass(frozen=True)
class LoopSettings:
    """What the training loop reads of the run's options (`loop_settings` picks them from the RunConfig)."""
    epochs: int
    seed: int                     # each step's Mixup and drop path (data.datasets.derive_seed)
    save_interval: int            # --save-interval: a checkpoint every N steps as well (0: at epoch ends only)
    max_bad_steps: int            # consecutive skipped updates that stop the run
    max_bad_images: float         # the fraction of undecodable images that stops it
    input_size: int               # the evaluation's image shape
    compile: bool                 # --compile: its failures are said in one line
    output_dir: str               # metrics.jsonl (and TensorBoard's events) go there
    log_interval: int
    tensorboard: bool
    profile_steps: tuple | None = None  # --profile-steps: (first, last) optimizer steps profiled (profiling.py)


def loop_settings(config: RunConfig) -> LoopSettings:
    run = config.run
    return LoopSettings(epochs=config.optim.epochs, seed=run.seed, save_interval=run.save_interval,
                        max_bad_steps=run.max_bad_steps, max_bad_images=config.data.max_bad_images,
                        input_size=config.model.input_size, compile=config.model.compile,
                        output_dir=run.output_dir, log_interval=run.log_interval, tensorboard=run.tensorboard,
                        profile_steps=profile_steps(run.profile_steps))


def build_datasets(config: RunConfig, train: bool = True) -> Datasets:
    """The training and validation sets; without `train` (`vim-ds eval`) the validation set alone, whose classes
    are then the run's (its `train_set` is None)."""
    data = dataset_config(config)
    train_set, num_classes = build_dataset(data, is_train=True) if train else (None, None)
    val_set, val_classes = build_dataset(data, is_train=False)
    named = train_set if train else val_set
    return Datasets(data, train_set, val_set, num_classes if train else val_classes,
                    [str(name) for name in getattr(named, "classes", None) or []])


def build_ds_config(config: RunConfig, dist_info: distributed.DistInfo, data_world: int | None = None):
    """The DeepSpeed config, its "auto" values filled from the command line, and the peak lr the optimizer starts
    from (a number written in the JSON wins over the command line). `data_world`: the data-parallel ranks, which the
    global batch counts (default the world size; under --sequence-parallel N the number of groups)."""
    optim = config.optim
    if not config.deepspeed.deepspeed_config:
        raise ValueError("--deepspeed_config is required, e.g. --deepspeed_config ds_configs/zero2.json")
    ds = prepare_ds_config(config.deepspeed.deepspeed_config, world_size=data_world or dist_info.world_size,
                           device_type=dist_info.device.type, micro_batch=optim.batch_size,
                           accum_steps=optim.accum_steps, precision=optim.precision,
                           auto_values=lambda batch: ds_auto_values(optim, batch))
    return ds, peak_lr(optim, ds)[0]


def settle_lr(config: RunConfig, ds, dist_info: distributed.DistInfo) -> RunConfig:
    """As the preflight did: the values the DeepSpeed config sets too (optim.settle_shared: the file's numbers the
    command line did not give, so that the parameter groups' weight decay is the one that runs), and the lr floor and
    the warmup start against the peak (notes on the first rank). Returns the config the engine and the schedule are
    built from, with a default floor or start lowered to the peak."""
    optim, shared_note = settle_shared(config.optim, ds)
    optim, notes = check_lr_settings(optim, *peak_lr(optim, ds))
    for note in ([shared_note] if shared_note else []) + notes:
        if dist_info.is_main:
            print(note, flush=True)
    return dataclasses.replace(config, optim=optim)


def auto_resume_path(output_dir: str) -> str:
    """The save directory `--resume auto` resumes, or '' to start from step 0 (nothing saved yet; only interrupted
    saves, with a warning). Refused: a `latest` naming a checkpoint that is gone, with nothing else to resume."""
    if not output_dir:
        raise ValueError("--resume auto looks in --output_dir; none was given")
    save_dir = os.path.join(output_dir, "checkpoints")
    if os.path.isdir(save_dir) and deepspeed_dir.complete_tags(save_dir):
        return save_dir
    problem = latest_gone(output_dir)
    if problem:
        raise CheckpointError(problem)
    interrupted = deepspeed_dir.incomplete_tags(save_dir) if os.path.isdir(save_dir) else []
    if interrupted and os.environ.get("RANK", "0") == "0":
        print(f"warning: --resume auto: {save_dir} holds only interrupted saves ({', '.join(interrupted)}: no "
              f"{deepspeed_dir.MARKER}), which are never resumed; starting from step 0", file=sys.stderr, flush=True)
    return ""  # nothing saved yet: start from scratch


def plan_resume(config: RunConfig, dist_info: distributed.DistInfo, ds, model_cfg, datasets: Datasets) -> str:
    """The checkpoint directory to resume ('' for none), decided before the engine exists: a ZeRO-1/2/3
    checkpoint saved by another number of ranks is first re-partitioned by DeepSpeed's universal checkpoint
    conversion, and the engine is configured (in `ds`) to load it so."""
    path = config.run.resume
    if not path or config.run.eval:
        return ""
    # a weights file, by its name or (sniff) by its content, any name: refused
    if path == "auto":
        path = auto_resume_path(config.run.output_dir)
    elif path.endswith((".pth", ".pt", ".bin", ".safetensors")) or (os.path.isfile(path) and sniff(path)[0]):
        raise CheckpointError(f"--resume {path}: a weights file has no optimizer state; use "
                              f"--finetune {path} to start from it (or --eval to evaluate it)")
    if not path:
        return ""
    if deepspeed_dir.is_tag_dir(path) and not deepspeed_dir.is_complete(path):
        raise CheckpointError(f"--resume {path}: an interrupted save (no {deepspeed_dir.MARKER}), never "
                              f"resumed; resume its save directory for the newest complete checkpoint")
    save_dir, tag = deepspeed_dir.resolve(path, fall_back=True)  # the newest intact one (checksums)
    if dist_info.is_main:
        for broken in deepspeed_dir.incomplete_tags(save_dir):
            if deepspeed_dir.tag_step(broken) > deepspeed_dir.tag_step(tag):
                print(f"warning: {os.path.join(save_dir, broken)} is an interrupted save (no "
                      f"{deepspeed_dir.MARKER}); not resuming it", file=sys.stderr, flush=True)
    tag_dir = os.path.join(save_dir, tag)
    already_universal = os.path.isdir(os.path.join(tag_dir, "zero"))  # `vim-ds convert --universal`
    marker = deepspeed_dir.read_marker(tag_dir) if deepspeed_dir.is_complete(tag_dir) else {}
    saved_world, saved_stage = marker.get("world_size"), marker.get("zero_stage", 0)
    to_convert = not already_universal and saved_world not in (None, dist_info.world_size) and bool(saved_stage)
    # another stage, precision or model: one line now, not DeepSpeed's failure
    note = resume_check.check(tag_dir, model_cfg, data_source(datasets.config), ds,
                 universal=already_universal or to_convert,
                 # and other class names: labels that would mean other classes
                 classes=datasets.classes)
    if note and dist_info.is_main:
        print(note, flush=True)
    # a branch from an older step: never over a newer one
    problem = resume_overwrite_error(config, tag_dir)
    if problem:
        raise CheckpointError(problem)
    if already_universal:
        ds.config.setdefault("checkpoint", {})["load_universal"] = True
        return tag_dir
    if not to_convert:
        return tag_dir
    if dist_info.is_main:
        print(f"{os.path.join(save_dir, tag)} was saved by {saved_world} ranks (ZeRO-{saved_stage}); "
              f"converting it to a universal checkpoint for {dist_info.world_size}", flush=True)
        # DeepSpeed's conversion, made for this run: a run refused before its first step takes it back too
        write_journal.filling(os.path.join(save_dir, tag + UNIVERSAL_SUFFIX))
        universal = universal_copy(save_dir, tag)
    else:
        universal = None
    universal = distributed.broadcast_object(universal)
    ds.config.setdefault("checkpoint", {})["load_universal"] = True
    return os.path.join(save_dir, universal)


def build_mixup(config: RunConfig, batch, num_classes: int):
    # timm's Mixup, mixing a host batch pair by pair (same numbers)
    return data_mixup.build_mixup(mixup_config(config), batch.micro, num_classes)


def build_loader(config: RunConfig, dist_info: distributed.DistInfo, dataset, batch_sampler, name: str,
                 fault_hook: faults.FaultHook):
    # workers from a fork server, --data-timeout: see data.loader.build_loader's docstring
    return data_loader.build_loader(dataset, batch_sampler, loader_config(config), name,
                               local_world_size=dist_info.local_world_size, persistent=True,
                               pin_memory=config.data.pin_mem and dist_info.device.type != "cpu",
                               leave_signals_to_owner=True, **fault_hook.loader(name))


def train_sampler(config: RunConfig, size: int, batch, groups: SequenceGroups):
    """Which of a training set's `size` images go into which optimizer step on this rank: the global batch `batch`
    (ds_config.BatchSizes) over the data-parallel ranks of `groups`, shuffled per epoch from --seed, every image
    three times with --repeated-aug."""
    return GlobalBatchSampler(size, micro_batch=batch.micro, accum_steps=batch.accum, rank=groups.data_rank,
                              world_size=groups.data_world, seed=config.run.seed,
                              repeats=3 if config.augment.repeated_aug else 1)


def build_data(config: RunConfig, dist_info: distributed.DistInfo, datasets: Datasets, batch,
               fault_hook: faults.FaultHook, groups: SequenceGroups | None = None) -> Data:
    """The sampler and loaders of `datasets` for the global batch `batch` (ds_config.BatchSizes), over the
    data-parallel ranks (`groups`: the ranks of a sequence group read the same images)."""
    groups = groups or sequence_groups.build(1, dist_info.rank, dist_info.world_size)
    sampler = train_sampler(config, len(datasets.train_set), batch, groups)
    steps_per_epoch = sampler.steps_per_epoch
    total_steps = config.optim.epochs * steps_per_epoch
    if config.optim.max_steps:
        total_steps = min(total_steps, config.optim.max_steps)
    train_loader = build_loader(config, dist_info, datasets.train_set, sampler, "train", fault_hook)
    val_loader = build_loader(config, dist_info, datasets.val_set, eval_sampler(datasets.val_set, batch.micro, groups),
                              "val", fault_hook)
    return Data(datasets, sampler, train_loader, val_loader, steps_per_epoch, total_steps)


def build_model(config: RunConfig, dist_info: distributed.DistInfo, model_cfg, datasets: Datasets, ds,
                resuming: bool = False) -> tuple:
    """(the model with its initial weights, Model): the same weights on every rank (drawn after
    `seed_everything(--seed)`), then --finetune's, then --init-weights' (or saved to --save-init-weights, by a run
    that is not `resuming`)."""
    options = config.model
    # identical initial weights on every rank
    seed_everything(config.run.seed)
    model = model_cfg.build()
    if options.finetune:
        # refused: a head for other names
        note = load_finetune_weights(model, options.finetune, datasets.classes, data_source(datasets.config))
        if note and dist_info.is_main:
            print(note, flush=True)
    # --init-weights / --save-init-weights, before the engine copies the weights
    info = init_weights.apply(model, {
        **model_cfg.description(), "step": 0, "epoch": 0, "zero_stage": ds.zero_stage,
        "precision": ds.precision, "tag": "init", "classes": datasets.classes}, dist_info,
        load=options.init_weights, save=options.save_init_weights, resuming=resuming)
    return model, Model(model_cfg, sum(p.numel() for p in model.parameters()), info)


def build_scheduler(config: RunConfig, steps_per_epoch: int):
    """The per-step lr schedule, as a function of the optimizer (the engine builds the optimizer)."""
    optim = config.optim
    warmup_steps = int(round(optim.warmup_epochs * steps_per_epoch))

    def scheduler(optimizer):
        return PerStepScheduler(optimizer, total_steps=optim.epochs * steps_per_epoch,
                                warmup_steps=warmup_steps, warmup_lr=optim.warmup_lr, min_lr=optim.min_lr)

    return scheduler


def build_engine(config: RunConfig, dist_info: distributed.DistInfo, model: torch.nn.Module, ds,
                 steps_per_epoch: int) -> Engine:
    """The engine --engine names (`training_engines`: DeepSpeed's, compiled with --compile, or a PyTorch baseline
    of `vim-ds zero-compare`), on the same model, parameter groups, data, loss and schedule."""
    scheduler = build_scheduler(config, steps_per_epoch)
    kind = training_engine(config.run.engine)
    compile_backend = config.model.compile_backend if config.model.compile else None
    engine, lr_scheduler, what = kind.build(model, param_groups(model, config.optim.weight_decay), ds,
                                            dist_info.device, scheduler, compile_backend)
    return Engine(engine, lr_scheduler, kind, kind.param_dtype(ds.precision), autocast_dtype(ds.precision), what)


def build_criterion(smoothing: float, mixup):
    """The training loss: soft-target cross-entropy under Mixup (which already smooths the targets), else
    label-smoothing cross-entropy with --smoothing, else plain cross-entropy."""
    if mixup is not None:
        return SoftTargetCrossEntropy()  # Mixup already smooths the targets
    if smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=smoothing)
    return torch.nn.CrossEntropyLoss()


def build_ema(config: RunConfig, engine):
    model = config.model
    return ShardedEMA(engine.module, model.model_ema_decay) if model.model_ema else None


def build_checkpointer(config: RunConfig, dist_info: distributed.DistInfo, engine: Engine,
                       fault_hook: faults.FaultHook, ema: ShardedEMA | None = None):
    """The checkpointer of --output_dir (None without one; the baselines save nothing), saving `ema` too."""
    run = config.run
    if not (run.output_dir and engine.kind.saves_checkpoints):
        return None
    return Checkpointer(engine.engine, os.path.join(run.output_dir, "checkpoints"), dist_info.rank,
                        run.keep_checkpoints, fault_hook, ema=ema)


def run_record(config: RunConfig, dist_info: distributed.DistInfo, ds, model_cfg, datasets: Datasets) -> RunRecord:
    """What every checkpoint records of the run `config` describes (the options as they run: after settle_lr)."""
    return RunRecord(world_size=dist_info.world_size, batch=ds.batch, precision=ds.precision,
                     zero_stage=ds.zero_stage, model=model_cfg.description(), classes=datasets.classes,
                     args=config.to_dict())


def new_run_id() -> str:
    """Which run this is, the same on every rank (a collective): a resumed run continues its checkpoint's lineage
    instead, and prunes only that lineage's checkpoints (see Checkpointer._prune)."""
    return distributed.broadcast_object(uuid.uuid4().hex[:16])


def build_trainer(config: RunConfig, dist_info: distributed.DistInfo) -> Trainer:
    """The parts of the run `config` describes, built in the order it needs, and the Trainer that runs them."""
    fault_hook = faults.for_rank(dist_info.rank)  # VIM_DS_INJECT: no-ops unless set
    # data: which images go into which optimizer step is fixed here, before the engine exists
    datasets = build_datasets(config)
    # what the model is: built below, checked on resume
    model_cfg = model_config(config, datasets.num_classes)
    # --sequence-parallel: groups of ranks share each image (a collective)
    groups = sequence_groups.build(config.run.sequence_parallel, dist_info.rank, dist_info.world_size)
    ds, lr = build_ds_config(config, dist_info, groups.data_world)
    # DeepSpeed counts every rank as data-parallel
    ds.config["train_batch_size"] = groups.deepspeed_batch(ds.batch.global_)
    # may set the engine's load_universal
    resume_path = plan_resume(config, dist_info, ds, model_cfg, datasets)
    # the schedule below, and the checkpoints' record of the options, use the lowered defaults
    config = settle_lr(config, ds, dist_info)
    mixup = build_mixup(config, ds.batch, datasets.num_classes)
    data = build_data(config, dist_info, datasets, ds.batch, fault_hook, groups)
    model, model_parts = build_model(config, dist_info, model_cfg, datasets, ds, resuming=bool(resume_path))
    engine = build_engine(config, dist_info, model, ds, data.steps_per_epoch)
    criterion = build_criterion(config.augment.smoothing, mixup)
    ema = build_ema(config, engine.engine)
    groups.split(model)  # after the EMA's copy: the engine's calls of the model run the split
    checkpointer = build_checkpointer(config, dist_info, engine, fault_hook, ema)
    parts = TrainerParts(dist=dist_info, data=data, ds=ds, lr=lr, model=model_parts, engine=engine, mixup=mixup,
                         criterion=criterion, ema=ema, checkpointer=checkpointer, groups=groups,
                         record=run_record(config, dist_info, ds, model_cfg, datasets), run_id=new_run_id(),
                         resume_path=resume_path, fault_hook=fault_hook)
    return Trainer(loop_settings(config), parts)
