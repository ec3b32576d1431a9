"""DeepSpeed checkpoint directories as vim_ds writes them, and how to find the one to resume.

A save directory holds one sub-directory per checkpoint ("tag", e.g. `global_step1200`) and DeepSpeed's `latest`
file naming the newest. vim_ds adds to each tag directory `ema.pt` (the gathered EMA weights), one
`rng_rank{N}.pt` per rank, and, written last and only after every rank has finished writing, `vim_ds_complete.json`.
A tag without that marker is a save that was interrupted: it is never resumed, even if `latest` names it.
"""
from __future__ import annotations

import glob
import json
import os
import re

from .files import CheckpointError

MARKER = "vim_ds_complete.json"
EMA_FILE = "ema.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def is_tag_dir(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "*model_states.pt")))


def is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, MARKER))


def read_marker(tag_dir: str) -> dict:
    with open(os.path.join(tag_dir, MARKER)) as f:
        return json.load(f)


def complete_tags(save_dir: str) -> list[str]:
    """Complete checkpoints in `save_dir`, oldest first (by optimizer step)."""
    tags = []
    for entry in os.listdir(save_dir):
        tag_dir = os.path.join(save_dir, entry)
        if os.path.isdir(tag_dir) and is_complete(tag_dir):
            tags.append((read_marker(tag_dir).get("step", -1), entry))
    return [tag for _, tag in sorted(tags)]


def tag_step(tag: str) -> int:
    """The optimizer step in a tag name (`global_step1200`, `global_step1200_universal`), or -1."""
    match = re.match(r"global_step(\d+)", tag)
    return int(match.group(1)) if match else -1


def incomplete_tags(save_dir: str) -> list[str]:
    """Tag directories without the completion marker (interrupted saves), oldest first."""
    tags = [entry for entry in os.listdir(save_dir) if tag_step(entry) >= 0
            and os.path.isdir(os.path.join(save_dir, entry)) and not is_complete(os.path.join(save_dir, entry))]
    return sorted(tags, key=tag_step)


def resolve(path: str) -> tuple[str, str]:
    """(save_dir, tag) of the checkpoint to load from a save directory (newest complete one) or a tag directory."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if is_tag_dir(path):
        if not is_complete(path) and os.path.isfile(os.path.join(path, "..", "latest")):
            raise CheckpointError(f"{path} is an incomplete save (no {MARKER}); resume its save directory instead")
        return os.path.dirname(path), os.path.basename(path)
    tags = complete_tags(path)
    if not tags:
        raise CheckpointError(f"no complete checkpoint in {path}")
    latest_file = os.path.join(path, "latest")
    if os.path.isfile(latest_file):
        with open(latest_file) as f:
            latest = f.read().strip()
        if latest in tags:
            return path, latest
    return path, tags[-1]


def write_atomic(path: str, text: str):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
