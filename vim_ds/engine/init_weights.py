"""`--init-weights FILE` and `--save-init-weights FILE`: start two runs (two clusters, two vendors) from the very
same weights, whatever each vendor's random number generator makes of `--seed`.

The file is a plain state dict in the format `vim-ds convert` writes (`{"model": state_dict, "vim_ds": {...}}` in a
.pth, or a .safetensors file); `--save-init-weights` writes the run's initial weights in that format, so the
reference run produces the file the other clusters load. Loading is exact: the keys and shapes must be the model's
(no position-embedding resize or head reset, unlike --finetune), and the values are copied as they are.
"""
from __future__ import annotations

import hashlib
import os

import torch

from ..checkpoint.convert import write_weights_file
from ..checkpoint.files import CheckpointError, load_weights_file, select_weights
from ..runtime import distributed, write_journal
from ..runtime.errors import first_line


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_init_weights(model: torch.nn.Module, path: str) -> str:
    """Copy the weights of `path` into `model` (strict: same keys, same shapes); returns the file's sha256."""
    state = select_weights(load_weights_file(path), f"--init-weights {path}")
    expected = model.state_dict()
    wrong_shape = sorted(f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                         for k in set(state) & set(expected) if tuple(state[k].shape) != tuple(expected[k].shape))
    problems = []
    for label, keys in (("missing", sorted(set(expected) - set(state))),
                        ("unexpected", sorted(set(state) - set(expected))), ("shape mismatch", wrong_shape)):
        if keys:
            more = f", ... ({len(keys)} in all)" if len(keys) > 6 else ""
            problems.append(f"{label}: " + ", ".join(keys[:6]) + more)
    if problems:
        raise CheckpointError(f"--init-weights {path} does not match the model (same --model, --model-kwargs, "
                              f"--input-size and classes?): " + "; ".join(problems))
    model.load_state_dict(state, strict=True)
    return sha256_file(path)


def existing_file_error(path: str) -> str | None:
    """Why `--save-init-weights PATH` is refused because something is already there, or None."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return f"--save-init-weights {path} is a folder: give the file to write, e.g. {os.path.join(path, 'init.pth')}"
    return (f"--save-init-weights {path} exists and is never replaced (runs that started from it record its "
            f"sha256): start from it with --init-weights {path}, or give a new file name")


def save_init_weights(model: torch.nn.Module, path: str, meta: dict) -> str:
    """Write `model`'s weights as `vim-ds convert` would (fp32, CPU) to a new file; returns the file's sha256. An
    existing file is refused, also one that appears while the weights are written (the write never replaces)."""
    problem = existing_file_error(path)
    if problem:
        raise CheckpointError(problem)
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    write_weights_file(path, weights, meta, replace=False)
    return sha256_file(path)


def apply(model: torch.nn.Module, meta: dict, dist_info: distributed.DistInfo, *, load: str = "",
          save: str = "", resuming: bool = False) -> dict:
    """Load `load` (--init-weights) on every rank, or write `save` (--save-init-weights) on rank 0; every rank learns
    whether all succeeded (one collective), so a file missing on one node stops the whole job with its message
    instead of leaving the other ranks waiting in the engine's first collective. Returns what metrics.jsonl
    records. A resumed run (`resuming`) writes no `save`: its initial weights were its first segment's, which wrote
    the file (recorded as such when it is there)."""
    if save and resuming:
        if os.path.isfile(save):
            return {"init_weights": os.path.abspath(save), "init_weights_sha256": sha256_file(save),
                    "init_weights_mode": "saved"}
        return {}
    if not (load or save):
        return {}
    digest, error = None, ""
    try:
        if load:
            digest = load_init_weights(model, load)
        elif dist_info.is_main:
            write_journal.rewriting(save)  # a run refused before its first step puts back what was there
            digest = save_init_weights(model, save, meta)
    except (ValueError, OSError) as exc:
        error = first_line(exc)
    failed = distributed.all_reduce_max([float(bool(error)) * (dist_info.rank + 1)], dist_info.device)[0]
    if error:
        # a bad or missing file is bad input (exit 2), as for --finetune
        raise CheckpointError(error)
    if failed:
        what = "load --init-weights" if load else "write --save-init-weights"
        raise RuntimeError(f"rank {int(failed) - 1} could not {what} (its error is in its log)")
    digest = distributed.broadcast_object(digest)  # --save-init-weights: rank 0 knows the hash
    return {"init_weights": os.path.abspath(load or save), "init_weights_sha256": digest,
            "init_weights_mode": "loaded" if load else "saved"}

