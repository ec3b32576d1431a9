"""An output folder belongs to one run: claimed before anything is trained or written.

- A run started without `--resume` into a folder that already holds checkpoints is refused: it would write its
  metrics into the earlier run's and, through `--keep-checkpoints`, delete that run's checkpoints.
- A resume never writes over a complete checkpoint it did not come from: resuming `global_step10` into a folder
  that holds a newer complete `global_step20` (a user branching from an earlier step to try another lr, or a
  `latest` edited back by hand) is refused, naming the way to branch (another --output_dir), since the resumed run
  would save `global_step20` again in its place and prune the original run's history.
- A lock (`OUTPUT_DIR/.vim_ds.lock`, an exclusive `flock` held by rank 0 for the life of the run) stops a second
  live run in the same folder; the kernel drops it when the holder dies, however it dies, and the next run says
  whose lock it took over. (flock is per host: two runs on different hosts sharing the folder over NFS are not
  told apart.) It is asked about before anything else (`_in_use` in the checks before the process group; the
  claim takes it first), so a live run's folder is never answered with advice the lock would refuse.
- `--resume auto` does not start from step 0 in a folder whose `latest` names a checkpoint that is gone with
  nothing else to resume (`latest_gone`): the run would write a second history there.
- A refused run leaves the folder as it found it: the checks before the process group create nothing (they probe
  the nearest existing parent), and what `claim` creates (the folder and its parents, `checkpoints/`, the lock
  file) goes into the run's write journal (runtime/write_journal.py), with everything the run writes after it
  until its first step (options.yaml, metrics.jsonl, ...): a run that ends in an error before then takes it all
  back (engine/run.py). Only what this process created, and only empty folders (os.rmdir): a folder that existed
  before, or anything written into it meanwhile, stays.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from ..checkpoint import deepspeed_dir
from ..config.run_config import RunConfig, RunOptions
from ..config.training_engines import training_engine
from ..runtime import distributed, write_journal

LOCK_FILE = ".vim_ds.lock"
_held = None  # the open lock file: the lock lasts as long as this process


def _makedirs(path: str) -> None:
    """os.makedirs, noting the folders it creates in the run's write journal (a refused run removes them)."""
    missing, current = [], os.path.abspath(path)
    while not os.path.exists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    os.makedirs(path, exist_ok=True)
    for folder in reversed(missing):
        write_journal.created(folder)


def _holder(text: str) -> dict:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return {}


def _in_use_error(output_dir: str, holder: dict) -> str:
    who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, started " \
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('time', 0)))}" if holder else "a process"
    return f"{output_dir} is in use by another run ({who}); wait for it to end or give another --output_dir"


def _in_use(output_dir: str) -> str | None:
    """Whether a live run holds the folder's lock, found without taking it (a shared lock tried and dropped at
    once: the checks before the process group create and hold nothing), as `_lock`'s error, or None. Asked first:
    every other refusal's advice (`--resume auto`, `--resume NEWEST`) would fail on the lock."""
    try:
        f = open(os.path.join(output_dir, LOCK_FILE))
    except OSError:
        return None  # no lock file (or none readable): no run has claimed the folder
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _in_use_error(output_dir, _holder(f.read()))
        except OSError:
            return None
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _lock(output_dir: str) -> tuple[str | None, str | None]:
    """(error, note) of taking the folder's lock on this process."""
    global _held
    _makedirs(output_dir)
    lock_path = os.path.join(output_dir, LOCK_FILE)
    new_lock = not os.path.exists(lock_path)
    f = open(lock_path, "a+")
    # a moment's retry: another job's `_in_use` check holds a shared lock for microseconds
    for attempt in range(6):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt < 5:
                time.sleep(0.05)
                continue
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            return _in_use_error(output_dir, holder), None
    f.seek(0)
    previous = _holder(f.read())
    note = None
    if previous.get("pid") not in (None, os.getpid()):
        note = (f"note: {output_dir} was locked by process {previous['pid']} on {previous.get('host', '?')}, which "
                f"is no longer running; taking it over")
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
    f.flush()
    _held = f
    if new_lock:  # only once it is ours: a refused run removes it while it still holds it (engine/run.py)
        write_journal.created(lock_path)
    return None, note


def release() -> None:
    """End of the run (whatever its outcome, short of being killed): the lock file is emptied, so the next run in
    the folder does not report a dead holder, and the lock is dropped."""
    global _held
    if _held is not None:
        _held.seek(0)
        _held.truncate()
        _held.close()
        _held = None


def _earlier_checkpoints(output_dir: str) -> str | None:
    save_dir = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(save_dir):
        return None
    tags = sorted((e for e in os.listdir(save_dir) if deepspeed_dir.tag_step(e) >= 0), key=deepspeed_dir.tag_step)
    return tags[-1] if tags else None


def _unwritable(save_dir: str, create: bool = True) -> str | None:
    """Why checkpoints cannot be written to `save_dir`, found by writing a file there and removing it (os.access
    says yes to root on a read-only mount, and knows nothing of quotas), or None. With `create` a missing
    `save_dir` is created (and noted in the run's write journal); without (the checks before the process group, which
    create nothing), the file is written in its nearest existing parent, where the folders would be made."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        return f"{save_dir} is a file, not a folder; move it away or give another --output_dir"
    where = save_dir
    if not create:
        while not os.path.exists(where) and os.path.dirname(where) not in ("", where):
            where = os.path.dirname(where)
        if not os.path.exists(where):
            where = "."
        if not os.path.isdir(where):
            return (f"cannot write checkpoints to {save_dir}: Not a directory ({where} is a file); give a writable "
                    f"--output_dir")
    probe = os.path.join(where, f".vim_ds_write_test.{socket.gethostname()}.{os.getpid()}")
    try:
        if create:
            _makedirs(save_dir)
        with open(probe, "w") as f:
            f.write("x")
        os.remove(probe)
    except OSError as exc:
        return f"cannot write checkpoints to {save_dir}: {exc.strerror or exc}; give a writable --output_dir"
    return None


def _earlier_run(run: RunOptions) -> str | None:
    newest = None if run.resume else _earlier_checkpoints(run.output_dir)
    if newest:
        return (f"{run.output_dir} holds the checkpoints of an earlier run (newest: {newest}); continue it with "
                f"--resume auto, or start anew with another --output_dir")
    return None


def latest_gone(output_dir: str) -> str | None:
    """Why `--resume auto` into `output_dir` must not start from step 0 although nothing is there to resume, or None:
    its `latest` names a checkpoint that is gone (deleted or moved) and no other complete one exists. The run saved
    that checkpoint (`latest` moves only once one is complete), so starting over would write a second history into
    its folder (metrics.jsonl's steps from 1 again)."""
    save_dir = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(save_dir) or deepspeed_dir.complete_tags(save_dir):
        return None
    missing = deepspeed_dir.missing_latest(save_dir)
    if not missing:
        return None
    return (f"--resume auto: {os.path.join(save_dir, 'latest')} names {missing}, which is not there (deleted or "
            f"moved?), and {save_dir} holds no other complete checkpoint; starting from step 0 would write a second "
            f"history into {output_dir}: put {missing} back, or start anew with another --output_dir")


def overwritten_by_resume(output_dir: str, tag_dir: str) -> list[str]:
    """The complete checkpoints in OUTPUT_DIR/checkpoints that a run resumed from `tag_dir` would write over (its
    saves are named after their step) and prune: every one of a later step than `tag_dir`'s, whatever run saved it.
    Damaged ones (which a resume has already skipped with a warning) do not count: nothing usable is lost with
    them."""
    save_dir = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(save_dir):
        return []
    start = deepspeed_dir.read_marker(tag_dir).get("step", deepspeed_dir.tag_step(os.path.basename(tag_dir))) \
        if deepspeed_dir.is_complete(tag_dir) else deepspeed_dir.tag_step(os.path.basename(tag_dir))
    newer = []
    for tag in deepspeed_dir.complete_tags(save_dir):
        path = os.path.join(save_dir, tag)
        if deepspeed_dir.read_marker(path).get("step", -1) > start and deepspeed_dir.damage(path) is None:
            newer.append(tag)
    return newer


def resume_overwrite_error(config: RunConfig, tag_dir: str) -> str | None:
    """Why resuming `tag_dir` into the run's --output_dir is refused (see `overwritten_by_resume`), or None."""
    run = config.run
    if not run.output_dir or run.eval:
        return None
    newer = overwritten_by_resume(run.output_dir, tag_dir)
    if not newer:
        return None

    step = deepspeed_dir.checkpoint_step(tag_dir)
    how = "`latest` names" if run.resume == "auto" or not deepspeed_dir.is_tag_dir(run.resume) else "--resume"
    shown = ", ".join(newer[-3:]) + (f" and {len(newer) - 3} more" if len(newer) > 3 else "")
    return (f"{how} {tag_dir} (step {step}), but {os.path.join(run.output_dir, 'checkpoints')} holds newer "
            f"complete checkpoints ({shown}) that this run would write over and prune; to branch from step {step}, "
            f"resume it with another --output_dir (the checkpoint is read where it is, the new run's are written "
            f"there); to continue the newest, --resume {os.path.join(run.output_dir, 'checkpoints', newer[-1])}")


def check(config: RunConfig) -> str | None:
    """Why the run's --output_dir cannot take this run (a live run holds it; an earlier run's checkpoints without
    --resume; `--resume auto` with a `latest` naming a checkpoint that is gone; not writable), or None: what
    `claim` and the resume plan find, without taking the lock, for any rank to tell before the process group
    exists."""
    run = config.run
    if not run.output_dir or run.eval:
        return None
    problem = _in_use(run.output_dir) or _earlier_run(run) or (latest_gone(run.output_dir) if run.resume == "auto"
                                                                 else None)
    # the baselines save nothing
    if problem or not training_engine(run.engine).saves_checkpoints:
        return problem
    return _unwritable(os.path.join(run.output_dir, "checkpoints"), create=False)


def claim(config: RunConfig, dist_info) -> None:
    """Refuse (ValueError, on every rank) a folder holding another run's checkpoints, in use by a live run, or
    where checkpoints cannot be written (found now, not at the first save after hours of training)."""
    run = config.run
    output_dir = run.output_dir
    if not output_dir or run.eval:
        return
    error = None
    if dist_info.is_main:
        # the lock first: a live run's folder is refused as such, not with advice that would fail on its lock
        try:
            error, note = _lock(output_dir)
        except OSError as exc:
            error, note = f"cannot write to {output_dir}: {exc.strerror or exc}; give a writable --output_dir", None
        error = error or _earlier_run(run)
        # the baselines save nothing
        if not error and training_engine(run.engine).saves_checkpoints:
            error = _unwritable(os.path.join(output_dir, "checkpoints"))
        if note and not error:
            print(note, flush=True)
    error = distributed.broadcast_object(error)
    if error:
        raise ValueError(error)
