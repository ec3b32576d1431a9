"""DeepSpeed checkpoint directories as vim_ds writes them, and how to find the one to resume.

A save directory holds one sub-directory per checkpoint ("tag", e.g. `global_step1200`) and DeepSpeed's `latest`
file naming the newest. vim_ds adds to each tag directory `ema.pt` (the gathered EMA weights), one
`rng_rank{N}.pt` per rank, and, written last and only after every rank has finished writing, `vim_ds_complete.json`.
A tag without that marker is a save that was interrupted: it is never resumed, even if `latest` names it.

The run's own checkpoints are the folders named as it names them, `global_step<N>` (and `global_step<N>_universal`
for DeepSpeed's universal copy of one): only they are chosen when a save directory is resolved, counted, pruned or
cleaned up. A folder a user makes beside them (`cp -a global_step2 my_best_step2`, `global_step4.bak`) is theirs;
it is resumed, evaluated or converted only when named itself. Removing a checkpoint removes what its save wrote
(`remove_saved`), never a file a user put into its folder.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import zlib

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
    """The run's complete checkpoints in `save_dir` (named as it names them, see the module docstring), oldest
    first (by optimizer step)."""
    tags = []
    for entry in os.listdir(save_dir):
        tag_dir = os.path.join(save_dir, entry)
        if tag_step(entry) >= 0 and os.path.isdir(tag_dir) and is_complete(tag_dir):
            tags.append((read_marker(tag_dir).get("step", -1), entry))
    return [tag for _, tag in sorted(tags)]


# the names the trainer gives its checkpoints (Checkpointer.save, universal_copy), whole names only
_TAG_NAME = re.compile(r"global_step(\d+)(?:_universal)?")


def tag_step(tag: str) -> int:
    """The optimizer step in a tag name the trainer gives (`global_step1200`, `global_step1200_universal`), or -1
    for any other name (`global_step1200.bak`, `my_best_step2`)."""
    match = _TAG_NAME.fullmatch(tag)
    return int(match.group(1)) if match else -1


def checkpoint_step(tag_dir: str) -> int:
    """The step of the checkpoint in `tag_dir`: its marker's, else its name's (-1 when neither says)."""
    if is_complete(tag_dir):
        try:
            return int(read_marker(tag_dir).get("step", -1))
        except (OSError, ValueError, TypeError):
            pass
    return tag_step(os.path.basename(os.path.normpath(tag_dir)))


def incomplete_tags(save_dir: str) -> list[str]:
    """The run's tag directories without the completion marker (interrupted saves), oldest first."""
    tags = [entry for entry in os.listdir(save_dir) if tag_step(entry) >= 0
            and os.path.isdir(os.path.join(save_dir, entry)) and not is_complete(os.path.join(save_dir, entry))]
    return sorted(tags, key=tag_step)


# What a save writes into a tag folder, by relative path: DeepSpeed's states (`mp_rank_00_model_states.pt`,
# `[bf16_]zero_pp_rank_N_mp_rank_00_{model,optim}_states.pt`, and its other `*_states.pt` layouts), vim_ds's EMA,
# RNG states, marker and the marker's temporary (write_atomic).
_SAVED_NAME = re.compile(r"[\w.-]*_states\.pt|" + re.escape(EMA_FILE) + r"|rng_rank\d+\.pt|"
                         + re.escape(MARKER) + r"(?:\.tmp\d+)?")
# ds_to_universal's tree in a `_universal` folder: one folder per parameter (named after it) and its scratch folder
_UNIVERSAL_TREE = re.compile(r"(?:zero|tmp)/.+")


def saved_by_a_save(tag_dir: str, rel: str) -> bool:
    """Whether the file `rel` (relative to `tag_dir`) has a name a save gives its files."""
    return bool(_SAVED_NAME.fullmatch(rel)
                or (tag_dir.rstrip(os.sep).endswith("_universal") and _UNIVERSAL_TREE.fullmatch(rel)))


def foreign_files(tag_dir: str) -> set[str]:
    """The files in `tag_dir` (relative paths) whose names no save gives: a user's, before a save writes there."""
    return {rel for root, _, names in os.walk(tag_dir) for name in names
            if not saved_by_a_save(tag_dir, rel := os.path.relpath(os.path.join(root, name), tag_dir))}


def remove_saved(tag_dir: str) -> tuple[list[str], list[str]]:
    """Remove what a save wrote into `tag_dir`, then the folders left empty, `tag_dir` last; returns (removed, kept)
    as paths relative to `tag_dir`. What a save wrote: the files its marker lists, and the marker (removed first, so
    that a removal cut short leaves an interrupted save, never a complete checkpoint with files missing); without a
    marker listing them (an interrupted or failed save, a checkpoint older than the list), the files named as
    DeepSpeed and vim_ds name theirs (`saved_by_a_save`). Anything else (a user's `weights.pth`, notes) stays, and
    with it the folders that hold it."""
    listed, removed, kept = None, [], []
    if is_complete(tag_dir):
        try:
            listed = set(read_marker(tag_dir).get("files") or ()) or None
        except (OSError, ValueError):
            pass  # unreadable: the names tell
        os.remove(os.path.join(tag_dir, MARKER))
        removed.append(MARKER)
    for root, _, files in os.walk(tag_dir):
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), tag_dir)
            if (rel in listed) if listed is not None else saved_by_a_save(tag_dir, rel):
                os.remove(os.path.join(root, name))
                removed.append(rel)
            else:
                kept.append(rel)
    for root, _, _ in os.walk(tag_dir, topdown=False):
        try:
            os.rmdir(root)  # only an empty folder
        except OSError:
            pass
    return removed, kept


def file_checksums(tag_dir: str) -> dict[str, list]:
    """{relative path: [bytes, CRC-32]} of every file in a tag directory but the completion marker: recorded in the
    marker when a save completes, checked before a checkpoint is used. CRC-32 finds damage (a bad disk, a truncated
    copy, bytes overwritten) at ~3 GB/s, about 3x faster than SHA-256 here; it is no defence against tampering,
    which the weights-only loads are (checkpoint/safe_load.py)."""
    out = {}
    for root, _, files in os.walk(tag_dir):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, tag_dir)
            if rel == MARKER:
                continue
            crc = 0
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    crc = zlib.crc32(chunk, crc)
            out[rel] = [os.path.getsize(path), f"{crc:08x}"]
    return out


CHUNK = 16 * 2 ** 20


def damage(tag_dir: str) -> str | None:
    """What is wrong with a complete checkpoint's files, in a few words naming the file, or None when each file
    has the size and checksum its marker recorded (or the marker records none: checkpoints before checksums)."""
    recorded = read_marker(tag_dir).get("files")
    if recorded is None:
        return None
    found = file_checksums(tag_dir)
    for rel, (size, crc) in sorted(recorded.items()):
        path = os.path.join(tag_dir, rel)
        if rel not in found:
            return f"{path} is missing"
        if found[rel][0] != size:
            return f"{path} has {found[rel][0]} bytes, {size} were saved"
        if found[rel][1] != crc:
            return f"{path} is damaged (its checksum differs from the one saved)"
    return None


def _warn(text: str):
    if os.environ.get("RANK", "0") == "0":  # every rank resolves the same files: one says so
        print(f"warning: {text}", file=sys.stderr, flush=True)


_WARNED: set[str] = set()


def _warn_once(text: str):
    """A warning said once per process (every command resolves its checkpoint more than once)."""
    if text not in _WARNED:
        _WARNED.add(text)
        _warn(text)


def read_latest(save_dir: str, newest: str = "") -> str | None:
    """The tag DeepSpeed's `latest` file in `save_dir` names, or None: no such file, or one that cannot be read
    (invalid UTF-8, binary garbage, empty, an I/O error), said once per process in a warning naming the file (and
    `newest`, the checkpoint used instead), as a `latest` naming a missing tag is ignored. vim_ds always passes
    DeepSpeed the tag it resolved, so DeepSpeed never reads the file itself."""
    latest_file = os.path.join(save_dir, "latest")
    if not os.path.isfile(latest_file):
        return None
    problem = None
    try:
        with open(latest_file, "rb") as f:
            data = f.read(4096)
        text = data.decode("utf-8").strip()
        if not text:
            problem = "it is empty"
        elif not text.isprintable():
            problem = "it holds no tag name (binary or control characters)"
    except UnicodeDecodeError as exc:
        problem = f"it is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    except OSError as exc:
        problem = f"it cannot be read ({exc.strerror or type(exc).__name__})"
    if problem is None:
        return text
    if latest_file not in _WARNED:
        _WARNED.add(latest_file)
        instead = f"; using the newest complete checkpoint, {newest}" if newest else ""
        _warn(f"ignoring {latest_file}: {problem}{instead}")
    return None


def save_dir_of(path: str) -> str:
    """The save directory `path` names: itself, or for a training run's --output_dir (which holds no checkpoints of
    its own, only `checkpoints/`) its `checkpoints/`, so that every command takes the same three forms (a tag
    directory, a save directory, an --output_dir)."""
    inner = os.path.join(path, "checkpoints")
    if os.path.isdir(inner) and not os.path.isfile(os.path.join(path, "latest")) \
            and not any(tag_step(entry) >= 0 for entry in os.listdir(path)):
        return inner
    return path


def missing_latest(save_dir: str) -> str | None:
    """The tag `save_dir`'s `latest` names when no folder of that name is there (deleted or moved), else None."""
    latest = read_latest(save_dir)
    if latest is None or os.path.isdir(os.path.join(save_dir, latest)):
        return None
    return latest


def resolve(path: str, verify: bool = True, fall_back: bool = False) -> tuple[str, str]:
    """(save_dir, tag) of the checkpoint to load from a tag directory, a save directory (its newest complete one)
    or a training --output_dir (its `checkpoints/`). With `verify`, a checkpoint whose files do not match their
    recorded checksums (see `damage`) is refused naming the file; with `fall_back` too (resuming), a save
    directory's newest *intact* checkpoint is taken instead, with a warning. A `latest` naming a tag that is not
    there is said: in the refusal when no other complete checkpoint exists, else in a warning naming the one used."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if is_tag_dir(path):
        if not is_complete(path) and os.path.isfile(os.path.join(path, "..", "latest")):
            raise CheckpointError(f"{path} is an incomplete save (no {MARKER}); resume its save directory instead")
        problem = damage(path) if verify and is_complete(path) else None
        if problem:
            raise CheckpointError(f"{path} cannot be used: {problem}")
        return os.path.dirname(path), os.path.basename(path)
    path = save_dir_of(path)
    tags = complete_tags(path)
    latest = read_latest(path, newest=tags[-1] if tags else "")
    missing = latest is not None and not os.path.isdir(os.path.join(path, latest))
    if not tags:
        named = f": its `latest` names {latest}, which is not there (deleted or moved?)" if missing else ""
        raise CheckpointError(f"no complete checkpoint in {path}{named}")
    if missing:
        _warn_once(f"{os.path.join(path, 'latest')} names {latest}, which is not there (deleted or moved?); using "
                   f"the newest complete checkpoint, {tags[-1]}")
    if latest in tags:  # the newest unless `latest` names an older one
        tags = tags[:tags.index(latest) + 1]
    for tag in reversed(tags):
        problem = damage(os.path.join(path, tag)) if verify else None
        if not problem:
            return path, tag
        if not fall_back:
            raise CheckpointError(f"{os.path.join(path, tag)} cannot be used: {problem}")
        _warn(f"{os.path.join(path, tag)} cannot be used: {problem}; trying the checkpoint before it")
    raise CheckpointError(f"no intact checkpoint in {path}: every complete one has damaged files")


def write_atomic(path: str, text: str):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
