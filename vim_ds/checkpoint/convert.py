"""A `vim-ds train` checkpoint directory -> one portable weights file.

The fp32 master weights are consolidated from any ZeRO stage and rank count (consolidate.fp32_state_dict) and
written in the published Vim format, `{"model": state_dict, "model_ema": ema_state_dict, "vim_ds": {...}}`, with
nothing but tensors and plain Python values so it loads with `torch.load(weights_only=True)`; or as a
`.safetensors` file holding the "model" weights only (the EMA ones with `ema=True`), the model description in its
metadata ({"model": name, "config": JSON of model_kwargs/num_classes/input_size, "format": "vim_ds", "classes":
JSON list of the class names in label order}).
"""
from __future__ import annotations

import glob
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from ..models.factory import DESCRIPTION_KEYS
from . import deepspeed_dir, safe_load
from .atomic_write import files_under, same_file, write_atomically
from .consolidate import fp32_state_dict
from .files import (
    SAFE_GLOBALS,
    SAFETENSORS,
    TORCH,
    CheckpointError,
    is_safetensors,
    load_weights_file,
    safe_globals,
    sniff,
)

_PARTITION = re.compile(r"^(.*zero_pp_rank_)(\d+)(_mp_rank_\d+_(?:optim|model)_states\.pt)$")
# the model's description (models.ModelConfig), where the run was, and "classes": the class names the run was
# trained on, in label order (see class_names.py; absent before they were)
META_KEYS = DESCRIPTION_KEYS + ("step", "epoch", "zero_stage", "precision", "classes")


def client_state(tag_dir: str, mmap: bool = False) -> dict:
    """Rank 0's model states file of a DeepSpeed checkpoint: the trainer's client state (model description, ZeRO
    stage, precision, position, ...) at its top level beside DeepSpeed's entries. With `mmap` its tensors are not
    read (for a look at the description)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        path = os.path.join(tag_dir, name)
        if os.path.isfile(path):
            return safe_load.load(path, mmap=mmap)
    files = sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt")))
    if files:
        raise CheckpointError(f"incomplete checkpoint {tag_dir}: rank 0's model states are missing "
                              f"(found {', '.join(os.path.basename(f) for f in files)})")
    raise CheckpointError(f"{tag_dir} is not a vim-ds checkpoint (no *model_states.pt)")


def check_complete(tag_dir: str, state: dict):
    """Every rank's ZeRO partition files are there (the marker alone does not prove a copied directory whole)."""
    world = state.get("world_size") or state.get("dp_world_size")
    if not world:
        return
    for kind in ("optim", "model"):
        files = [os.path.basename(f) for f in glob.glob(os.path.join(tag_dir, f"*zero_pp_rank_*_{kind}_states.pt"))]
        parts = [m.groups() for m in map(_PARTITION.match, files) if m]
        if not parts:
            if kind == "optim" and int(state.get("zero_stage") or 0) > 0:
                raise CheckpointError(f"incomplete checkpoint {tag_dir}: no *optim_states.pt partitions for "
                                      f"ZeRO-{state['zero_stage']} ({world} ranks)")
            continue
        prefix, _, suffix = parts[0]
        present = {int(rank) for _, rank, _ in parts}
        missing = [f"{prefix}{r}{suffix}" for r in range(world) if r not in present]
        if missing:
            raise CheckpointError(f"incomplete checkpoint {tag_dir}: missing {', '.join(missing)} "
                                  f"({len(present)} of {world} ranks' {kind} states)")


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _size(paths) -> str:
    return f"{sum(os.path.getsize(p) for p in paths) / 2 ** 20:,.0f} MiB"


def convert(ckpt_path: str, out_path: str, *, tag: str | None = None, ema: bool = False,
            safetensors: bool | None = None, progress=None, stall=None) -> dict:
    """Write the consolidated weights of a checkpoint directory to `out_path`; returns a summary dict.
    `progress(message)`, when given, is told what is being read and written (large models take minutes)."""
    progress = progress or (lambda message: None)
    ckpt_path = os.fspath(ckpt_path)
    if os.path.isdir(out_path):  # before the (long) read; os.replace cannot put a file there
        raise CheckpointError(f"{os.fspath(out_path)} is a folder: OUT is the file to write, e.g. "
                              f"{os.path.join(out_path, 'weights.pth')}")
    if tag:  # in a save directory or a training --output_dir
        save_dir = deepspeed_dir.save_dir_of(os.path.normpath(ckpt_path))
        if not os.path.isdir(os.path.join(save_dir, tag)):
            raise CheckpointError(f"no checkpoint {tag!r} in {save_dir}")
    else:
        save_dir, tag = deepspeed_dir.resolve(ckpt_path)
    tag_dir = os.path.join(save_dir, tag)
    if not deepspeed_dir.is_tag_dir(tag_dir):
        raise CheckpointError(f"{tag_dir} is not a vim-ds checkpoint (no *model_states.pt)")
    problem = output_problem(os.fspath(out_path), tag_dir)
    if problem:  # before anything is read or written
        raise CheckpointError(problem)
    state = client_state(tag_dir)
    check_complete(tag_dir, state)
    ema_path = os.path.join(tag_dir, deepspeed_dir.EMA_FILE)
    if ema and not os.path.isfile(ema_path):
        raise CheckpointError(f"{tag_dir} has no EMA weights ({deepspeed_dir.EMA_FILE}); train with EMA or drop --ema")
    rank_files = glob.glob(os.path.join(tag_dir, "*_states.pt"))
    progress(f"reading {len(rank_files)} DeepSpeed files ({_size(rank_files)}) from {tag_dir} ...")
    model_sd = fp32_state_dict(save_dir, tag)
    ema_sd = safe_load.load(ema_path) if os.path.isfile(ema_path) else None
    if ema_sd is not None:
        ema_sd = {k: v.float() if v.is_floating_point() else v for k, v in ema_sd.items()}
    marker = deepspeed_dir.read_marker(tag_dir) if deepspeed_dir.is_complete(tag_dir) else {}
    meta = {k: _plain(state.get(k, marker.get(k))) for k in META_KEYS}
    meta["tag"] = tag

    out_path = os.fspath(out_path)
    if safetensors is None:
        safetensors = out_path.endswith(".safetensors")
    weights = ema_sd if ema else model_sd
    tensors = [weights] + ([ema_sd] if ema_sd is not None and not ema and not safetensors else [])
    size = sum(v.numel() * v.element_size() for d in tensors for v in d.values())
    progress(f"writing {out_path} ({size / 2 ** 20:,.0f} MiB) ...")
    write_weights_file(out_path, weights, meta, "ema" if ema else "model", None if ema else ema_sd, safetensors,
                       stall=stall)
    return {"source": tag_dir, "out": out_path, "format": "safetensors" if safetensors else "torch",
            "weights": "ema" if ema else "model", "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()), "has_ema": ema_sd is not None, **meta}


def output_problem(out_path: str, tag_dir: str) -> str | None:
    """Why OUT must not be written by converting `tag_dir`, or None: OUT is one of the files the conversion reads
    (the checkpoint's own files, its save directory's `latest`; also through a link), or an existing file that is
    not a weights file vim_ds wrote (a published checkpoint, another checkpoint's DeepSpeed file, anything else a
    user keeps there). A converted file written earlier is replaced, as a conversion run again expects."""
    read = same_file(out_path, files_under(tag_dir) + [os.path.join(os.path.dirname(tag_dir), "latest")])
    if read:
        what = "a file" if os.path.abspath(read) == os.path.abspath(out_path) else f"{read}, a file"
        return (f"{out_path} is {what} of the checkpoint being converted ({tag_dir}): writing it would destroy the "
                f"checkpoint; give OUT a new file outside {tag_dir}, e.g. weights.pth")
    return not_our_file(out_path, "vim-ds convert", "OUT")


def not_our_file(path: str, writer: str, option: str) -> str | None:
    """Why the existing file `path` is not replaced by `writer` (it is not a weights file vim_ds wrote, see
    `written_by_vim_ds`), or None (no such file, or one vim_ds wrote)."""
    if not os.path.lexists(path) or written_by_vim_ds(path):
        return None
    try:
        kind, what = sniff(path)
    except OSError as exc:
        kind, what = "", f"a file that cannot be read ({exc.strerror or exc})"
    if kind:
        what = f"{'a safetensors' if kind == SAFETENSORS else 'a PyTorch'} file with no vim_ds record"
    return (f"{path} exists and is {what}: {writer} replaces only a weights file vim_ds wrote; give {option} a "
            f"new name, or move {path} away first")


def written_by_vim_ds(path: str) -> bool:
    """Whether `path` is a weights file vim_ds wrote (`vim-ds convert`, `--save-init-weights`): its vim_ds record,
    read without its tensors (a .pth memory-mapped; a safetensors header)."""
    try:
        kind, _ = sniff(path)
        if kind == SAFETENSORS:

            with safe_open(path, framework="pt") as f:
                return (f.metadata() or {}).get("format") == "vim_ds"
        if kind == TORCH:
            with safe_globals(SAFE_GLOBALS):
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return isinstance(obj, dict) and isinstance(obj.get("vim_ds"), dict)
    except Exception:  # noqa: BLE001 - unreadable, a legacy pickle (no mmap), not a dict: not one of ours
        return False
    return False


def write_weights_file(out_path: str, weights: dict, meta: dict, which: str = "model", ema_sd: dict | None = None,
                       safetensors: bool | None = None, stall=None, replace: bool = True):
    """Write a converted weights file atomically: .pth `{"model": weights, "vim_ds": meta, ["model_ema": ema_sd]}`,
    or .safetensors with the model description as metadata (no EMA there). `which` names what `weights` are. A
    failed write is a one-line CheckpointError and leaves no file, however the writer stops (see atomic_write;
    `stall` is its fault-injection point). Without `replace`, a file already at `out_path` is kept and the write
    fails."""
    if safetensors is None:
        safetensors = out_path.endswith(".safetensors")

    # into the unnamed (or hidden) temporary that becomes out_path: see atomic_write
    def write(path: str):
        if safetensors:

            config = {"model_kwargs": meta["model_kwargs"], "num_classes": meta["num_classes"],
                      "input_size": meta["input_size"]}
            metadata = {"model": str(meta["model"]), "config": json.dumps(config), "format": "vim_ds",
                        "weights": which}
            if meta.get("classes"):  # str -> str only: the names as a JSON list
                metadata["classes"] = json.dumps(list(meta["classes"]))
            # bytes: save_file renames on its own
            data = safetensors_bytes({k: v.contiguous() for k, v in weights.items()}, metadata=metadata)
            with open(path, "wb") as f:
                f.write(data)
        else:
            obj = {"model": weights, "vim_ds": {**meta, "weights": which}}
            if ema_sd is not None:
                obj["model_ema"] = ema_sd
            torch.save(obj, path)

    # a full disk, a read-only one, Ctrl-C, SIGTERM, SIGKILL: no half-written file is left behind, one-line errors
    write_atomically(out_path, write, stall=stall, replace=replace)


def read_vim_ds_meta(obj_or_path) -> dict | None:
    """The model description of a converted file (.pth "vim_ds" entry or safetensors metadata), else None."""
    if isinstance(obj_or_path, dict):
        meta = obj_or_path.get("vim_ds")
        return meta if isinstance(meta, dict) else None
    path = os.fspath(obj_or_path)
    # by its content: a safetensors file renamed .pth still describes its model
    if is_safetensors(path):

        try:
            with safe_open(path, framework="pt") as f:
                md = f.metadata() or {}
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
        if md.get("format") != "vim_ds":
            return None
        try:
            classes = json.loads(md["classes"]) if md.get("classes") else None
        except ValueError:
            classes = None  # not our JSON: no recorded names (class_names.recorded checks the rest)
        return {"model": md.get("model"), **json.loads(md.get("config") or "{}"),
                **({"classes": classes} if classes else {})}

    return read_vim_ds_meta(load_weights_file(path))
