"""What a run writes before it is sure to run, so that a run ending in an error before then takes all of it back.

A run is sure once it has taken its first optimizer step. Until then an error ends it as a refusal (exit 2) or a
failure (exit 1), whatever raised it and wherever: the checks before the process group, the trainer's, DeepSpeed's,
the first forward's. Such a run must leave every folder as it found it: a later run into the same folder found the
refused run's options.yaml and its metrics.jsonl header, which `vim-ds compare-runs` then reported as the folder's
run (4 ranks, input size 4). So whatever writes before then tells this journal first, and `undo` takes it back:

- `created(path)`: a file or folder made now that was not there (the output folder and its parents, the lock
  file, `checkpoints/`): removed; a folder only when empty (os.rmdir), so nothing anyone else put there is lost;
- `rewriting(path)`: a file about to be written whole (options.yaml, --save-init-weights): its earlier bytes are
  put back, or it is removed when it was not there;
- `appending(path)`: a file about to grow (metrics.jsonl): cut back to its earlier length, or removed;
- `filling(folder)`: a folder a library writes files of its own naming into (tensorboard/): the entries it did not
  hold are removed, and the folder when it was not there.

Per process: each rank keeps its own (rank 0 writes the run's files). `sure()` (the trainer, after its first step)
ends the journal: from then on the run's files are its record, whatever happens. `start()` begins anew (engine/run.py,
also for a run started in-process after another). Not undone: what a process killed outright wrote (nothing runs
then); a folder where a write is taken back keeps its modification time.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable

_entries: list[tuple[str, str, object]] = []  # (kind, absolute path, its state before the run), in the order made
_sure = False


def start() -> None:
    """A new run: nothing written yet, not sure yet."""
    global _sure
    _entries.clear()
    _sure = False


def sure() -> None:
    """The run has taken its first step: what it wrote stays, whatever ends it."""
    global _sure
    _entries.clear()
    _sure = True


def _note(kind: str, path: str, state: Callable[[str], object] = lambda path: None) -> None:
    path = os.path.abspath(path)
    # the first note of a path holds its state before the run
    if _sure or any(p == path for _, p, _ in _entries):
        return
    _entries.append((kind, path, state(path)))


def created(path: str) -> None:
    _note("created", path)


def rewriting(path: str) -> None:
    _note("rewritten", path, _bytes)


def appending(path: str) -> None:
    _note("appended", path, lambda p: os.path.getsize(p) if os.path.isfile(p) else None)


def filling(folder: str) -> None:
    _note("filled", folder, lambda p: set(os.listdir(p)) if os.path.isdir(p) else None)


def _bytes(path: str) -> bytes | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def undo() -> None:
    """Take back what the run wrote, last first; nothing once it is sure. A step that cannot be taken back (the
    file was changed or removed meanwhile, by someone else) leaves that path as it is."""
    for kind, path, before in reversed(_entries):
        try:
            _take_back(kind, path, before)
        except OSError:
            pass
    start()


def _take_back(kind: str, path: str, before) -> None:
    if kind == "created":
        os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    elif before is None:
        _remove(path)  # it was not there
    elif kind == "rewritten":
        with open(path, "wb") as f:
            f.write(before)
    elif kind == "appended":
        os.truncate(path, before)
    else:  # filled: what the folder did not hold
        for name in set(os.listdir(path)) - before:
            _remove(os.path.join(path, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
