"""What a run's command line names, checked before the process group or DeepSpeed's engine starts.

Every rank runs these checks on its own, so bad input costs each rank of a 64-GPU job the seconds of its imports,
not the minute of a process group, DeepSpeed's op builds and a model: the DeepSpeed config (a shipped name or a
file; its JSON, keys and types, the batch sizes for this job's world size), the data path and its layout, the
model name and its kwargs (the model is built on the meta device: no memory, no time), the files of --resume,
--finetune and --init-weights, and the output folder (an earlier run's checkpoints; whether it can be written).
Each problem is a ValueError with the one-line cause, which `vim-ds train` prints and exits 2 on, as it does for
the same problems found later. The trainer repeats the checks where it uses the same things (with the process
group, under the output folder's lock): these are for speed, not the only line of defence.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..checkpoint import deepspeed_dir
from ..checkpoint.files import CheckpointError
from ..config import shipped_configs
from ..config.components import model_config
from ..config.ds_config import prepare_ds_config
from ..config.run_config import RunConfig
from ..data.datasets import check_layout
from ..data.shards import check_shards
from ..models.sequence_parallel import split_error
from ..runtime import sequence_groups
from . import output_dir
from .init_weights import existing_file_error
from .optim import check_lr_settings, ds_auto_values, peak_lr, settle_shared


def launch_world_size() -> int:
    """The number of ranks the launcher started, from its environment (torchrun, deepspeed, SLURM, Open MPI)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def device_type() -> str:
    """The device type the trainer will use: DeepSpeed's accelerator choice (DS_ACCELERATOR), else a GPU when
    torch sees one (CUDA or ROCm), else the CPU."""
    chosen = os.environ.get("DS_ACCELERATOR", "")
    if chosen:
        return "cpu" if chosen == "cpu" else "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def check(config: RunConfig, is_main: bool) -> RunConfig:
    """Check `config` (the run's options) as described above. Returns it with what the checks resolve: the DeepSpeed
    config's file (a shipped name, or the default when none was given, said on the first rank) and a default lr
    floor or warmup start lowered to the peak (optim.check_lr_settings)."""
    _data(config)
    _model(config)
    _files(config)
    problem = sequence_groups.world_error(config.run.sequence_parallel, launch_world_size())
    if problem:
        raise ValueError(problem)
    if config.run.eval:
        return config
    problem = output_dir.check(config) or _resume_overwrite(config)
    if problem:
        raise ValueError(problem)
    if is_main and not config.run.output_dir:  # said now, not found after hours of training
        print("note: no --output_dir: nothing of this run is kept (no checkpoints, no metrics.jsonl, no "
              "options.yaml); give --output_dir DIR to keep them", flush=True)
    # last: its schema is DeepSpeed's (the one check that imports DeepSpeed)
    return _deepspeed_config(config, is_main)


def _deepspeed_config(config: RunConfig, is_main: bool) -> RunConfig:
    given = config.deepspeed.deepspeed_config
    path = shipped_configs.resolve(given or shipped_configs.DEFAULT)
    if is_main and not given:
        print(f"note: no --deepspeed_config given: using the shipped {shipped_configs.DEFAULT} "
              f"({path}; `vim-ds configs` lists the others)", flush=True)
    elif is_main and path != given:
        print(f"DeepSpeed config: {given} = {path}", flush=True)
    config = config.replace(deepspeed_config=path)
    optim = config.optim
    # the data-parallel ranks, which the global batch (and so the scaled lr) counts: groups of
    # --sequence-parallel N ranks share each image (world_error above made sure N divides the world)
    data_world = launch_world_size() // config.run.sequence_parallel
    prepared = prepare_ds_config(path, world_size=data_world, device_type=device_type(),
                                 micro_batch=optim.batch_size, accum_steps=optim.accum_steps,
                                 precision=optim.precision, auto_values=lambda batch: ds_auto_values(optim, batch))
    return _lr_settings(_settle_with_the_json(config, prepared, is_main), prepared, is_main)


def _settle_with_the_json(config: RunConfig, prepared, is_main: bool) -> RunConfig:
    """What the DeepSpeed config and the command line both set, settled (optim.settle_shared: a contradiction is
    refused, a number the command line did not give taken, so that the options say what runs and options.yaml
    records it); --precision wins over the file's sections, said once."""
    optim, note = settle_shared(config.optim, prepared)
    notes = [note] if note else []
    if prepared.overridden_precision:
        notes.insert(0, f"note: --precision {optim.precision} overrides the {prepared.overridden_precision} of "
                        f"{prepared.source}")
    for note in notes:
        if is_main:
            print(note, flush=True)
    return dataclasses.replace(config, optim=optim)


def _lr_settings(config: RunConfig, prepared, is_main: bool) -> RunConfig:
    """A floor or warmup start above the peak lr (after the batch scaling): refused when given, lowered with a note
    when the built-in default (optim.check_lr_settings); the trainer repeats it with the process group's world."""
    optim, notes = check_lr_settings(config.optim, *peak_lr(config.optim, prepared))
    for note in notes:
        if is_main:
            print(note, flush=True)
    return dataclasses.replace(config, optim=optim)


def _data(config: RunConfig) -> None:
    data, need_train = config.data, not config.run.eval
    if data.data_set in ("IMNET", "folder"):
        check_layout(data.data_path, need_train=need_train)
    # each split's index, its shards, their sizes, every offset
    elif data.data_set == "shards":
        check_shards(data.data_path or "", need_train=need_train)


def _model(config: RunConfig) -> None:
    """The model, built on the meta device with the run's options (a placeholder head: the class count comes from
    the data), and whether --sequence-parallel can split its tokens."""
    classes = config.data.nb_classes if config.data.data_set == "synthetic" else 1000
    with torch.device("meta"):
        model = model_config(config, classes).build()
    # the split's own check runs inside the first forward, after the process group and DeepSpeed have started
    problem = split_error(model, config.run.sequence_parallel)
    if problem:
        raise ValueError(f"--sequence-parallel {config.run.sequence_parallel} with --model {config.model.model} at "
                         f"--input-size {config.model.input_size}: {problem}")


def _files(config: RunConfig) -> None:
    resume = config.run.resume
    for option, path in (("--finetune", config.model.finetune), ("--init-weights", config.model.init_weights),
                         ("--resume", "" if resume == "auto" else resume)):
        if path and not os.path.exists(path):
            raise ValueError(f"{option} {path}: no such file or folder")
        if path and option != "--resume" and not os.path.isfile(path):
            raise ValueError(f"{option} {path} is a folder, not a weights file; `vim-ds convert` makes one from a "
                             f"checkpoint directory")
    # a new run writes its initial weights to a new file (a resumed one writes none: init_weights.apply)
    if config.model.save_init_weights and not resume:
        problem = existing_file_error(config.model.save_init_weights)
        if problem:
            raise ValueError(problem)


def _resume_overwrite(config: RunConfig) -> str | None:
    """A resume of an older checkpoint into a folder holding newer ones (output_dir.resume_overwrite_error). A
    checkpoint that cannot be resolved here is left to the trainer, which says why in its own words."""
    path = config.run.resume
    if path == "auto" and config.run.output_dir:
        path = os.path.join(config.run.output_dir, "checkpoints")
    if not path or not os.path.isdir(path):
        return None
    try:
        save_dir, tag = deepspeed_dir.resolve(path, verify=False)
    except (CheckpointError, OSError, ValueError):
        return None
    return output_dir.resume_overwrite_error(config, os.path.join(save_dir, tag))
