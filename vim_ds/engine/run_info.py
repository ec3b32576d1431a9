"""The header record of metrics.jsonl: what `vim-ds compare-runs` needs to decide whether two runs can be compared
(the same global batch) and to show what differs between them (ranks, ZeRO stage, device, versions, ...).

It is the first line a run writes (a resumed run appends another one), marked `"header": true` and carrying no
"loss", so readers that pick step records by their "loss" key skip it.
"""
from __future__ import annotations

import os
import platform
import sys

import torch

from .. import __version__


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a version is informative only
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator() -> str:
    """The GPUs torch sees (ROCm or CUDA, count and names), or the CPU build: `vim-ds env`'s and the demo's line."""
    if torch.cuda.is_available():
        kind = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"{kind}: {torch.cuda.device_count()} x {', '.join(names)}"
    build = "ROCm" if torch.version.hip else ("CUDA" if torch.version.cuda else "CPU-only")
    return f"CPU ({torch.get_num_threads()} threads; torch is a {build} build, no GPU visible)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_name()
    return str(device)


def header(settings, parts, start_step: int) -> dict:
    """The header of a run that starts (or resumes) at `start_step`, from its loop settings and parts
    (parts.LoopSettings, parts.TrainerParts)."""
    batch, device, model = parts.ds.batch, parts.dist.device, parts.model.config
    runtime = f"hip {torch.version.hip}" if torch.version.hip else \
        f"cuda {torch.version.cuda}" if torch.version.cuda and device.type == "cuda" else None
    return {"header": True, "start_step": start_step, "global_batch": batch.global_,
            "world_size": parts.dist.world_size, "micro_batch": batch.micro, "accum_steps": batch.accum,
            "zero_stage": parts.ds.zero_stage, "precision": parts.ds.precision, "seed": settings.seed,
            "lr": parts.lr, "model": model.name, "model_kwargs": model.kwargs,
            "input_size": settings.input_size,
            "num_classes": parts.data.datasets.num_classes, "train_images": len(parts.data.datasets.train_set),
            "total_steps": parts.data.total_steps, "device_type": device.type,
            "device_name": device_name(device), "host": platform.node(),
            "vim_ds": __version__, "torch": torch.__version__, "deepspeed": _version("deepspeed"),
            "timm": _version("timm"), "python": platform.python_version(), "accelerator_runtime": runtime,
            "init_weights": None, "init_weights_sha256": None, **parts.model.init_weights_info,
            # the command as typed, and where: its relative paths name files from there
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "cwd": os.getcwd()}
