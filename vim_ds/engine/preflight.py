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

import os

import torch

from . import output_dir, shipped_configs


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


def check(args, is_main: bool) -> None:
    """Check `args` (the parsed `vim-ds train` options) as described above; resolves args.deepspeed_config to a
    file (a shipped name, or the default when none was given) and says so on the first rank."""
    _data(args)
    _model(args)
    _files(args)
    if not args.eval:
        problem = output_dir.check(args) or _resume_overwrite(args)
        if problem:
            raise ValueError(problem)
        # last: its schema is DeepSpeed's (the one check that imports DeepSpeed)
        _deepspeed_config(args, is_main)


def _deepspeed_config(args, is_main: bool) -> None:
    from .ds_config import prepare_ds_config
    from .optim import ds_auto_values

    given = args.deepspeed_config
    args.deepspeed_config = shipped_configs.resolve(given or shipped_configs.DEFAULT)
    if is_main and not given:
        print(f"note: no --deepspeed_config given: using the shipped {shipped_configs.DEFAULT} "
              f"({args.deepspeed_config}; `vim-ds configs` lists the others)", flush=True)
    elif is_main and args.deepspeed_config != given:
        print(f"DeepSpeed config: {given} = {args.deepspeed_config}", flush=True)
    prepared = prepare_ds_config(args.deepspeed_config, world_size=launch_world_size(), device_type=device_type(),
                                 micro_batch=args.batch_size, accum_steps=args.accum_steps, precision=args.precision,
                                 auto_values=lambda batch: ds_auto_values(args, batch))
    _lr_settings(args, prepared, is_main)


def _lr_settings(args, prepared, is_main: bool) -> None:
    """A floor or warmup start above the peak lr (after the batch scaling): refused when given, lowered with a note
    when the built-in default (optim.check_lr_settings); the trainer repeats it with the process group's world."""
    from .optim import check_lr_settings, peak_lr

    for note in check_lr_settings(args, *peak_lr(args, prepared)):
        if is_main:
            print(note, flush=True)


def _data(args) -> None:
    from ..data.datasets import check_layout
    from ..data.shards import check_shards

    if getattr(args, "data_set", "IMNET") in ("IMNET", "folder"):
        check_layout(args.data_path, need_train=not args.eval)
    # each split's index, its shards, their sizes, every offset
    elif getattr(args, "data_set", "") == "shards":
        check_shards(args.data_path or "", need_train=not args.eval)


def _model(args) -> None:
    """The model, built on the meta device with the run's options (a placeholder head: the class count comes from
    the data)."""
    from .components import model_config

    classes = args.nb_classes if getattr(args, "data_set", "") == "synthetic" else 1000
    with torch.device("meta"):
        model_config(args, classes).build()


def _files(args) -> None:
    for option, path in (("--finetune", args.finetune), ("--init-weights", getattr(args, "init_weights", "")),
                         ("--resume", "" if args.resume == "auto" else args.resume)):
        if path and not os.path.exists(path):
            raise ValueError(f"{option} {path}: no such file or folder")
        if path and option != "--resume" and not os.path.isfile(path):
            raise ValueError(f"{option} {path} is a folder, not a weights file; `vim-ds convert` makes one from a "
                             f"checkpoint directory")


def _resume_overwrite(args) -> str | None:
    """A resume of an older checkpoint into a folder holding newer ones (output_dir.resume_overwrite_error). A
    checkpoint that cannot be resolved here is left to the trainer, which says why in its own words."""
    from ..checkpoint import deepspeed_dir
    from ..checkpoint.files import CheckpointError

    path = args.resume
    if path == "auto" and args.output_dir:
        path = os.path.join(args.output_dir, "checkpoints")
    if not path or not os.path.isdir(path):
        return None
    try:
        save_dir, tag = deepspeed_dir.resolve(path, verify=False)
    except (CheckpointError, OSError, ValueError):
        return None
    return output_dir.resume_overwrite_error(args, os.path.join(save_dir, tag))
