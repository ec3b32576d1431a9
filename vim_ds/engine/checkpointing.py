"""Saving and resuming training state: DeepSpeed's checkpoint plus what the trainer owns (EMA, RNG, and the run's
`TrainState` as the checkpoint's client state).

Saving is crash-safe: DeepSpeed writes the tag directory without touching `latest`; every rank then writes its
RNG states, rank 0 the gathered EMA; after a barrier rank 0 writes the completion marker and only then moves
`latest` (atomically). See `vim_ds/checkpoint/deepspeed_dir.py` for the layout.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

from ..checkpoint import deepspeed_dir as layout
from ..checkpoint import safe_load
from ..checkpoint.files import CheckpointError
from ..runtime import distributed, faults, versions
from .train_state import TrainState

# `<tag>_universal`: DeepSpeed's universal copy of `<tag>` (see universal_copy)
UNIVERSAL_SUFFIX = "_universal"


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, permissions); the previous one is untouched."""


def rng_state() -> dict:
    """This process's RNG states as tensors and plain Python values, so the file loads with weights_only=True."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    # a tuple with a NumPy array: files written before the dict format
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_failure(save_dir: str, exc: Exception) -> str:
    """Why a save failed, in a few words: a full filesystem is named as such, whichever layer noticed it."""
    try:
        fs = os.statvfs(save_dir)
        if fs.f_bavail * fs.f_frsize < 2 ** 20:
            return "No space left on device"
    except OSError:
        pass
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


class Checkpointer:
    def __init__(self, engine, save_dir: str, rank: int, keep_last: int = 2,
                 fault_hook: faults.FaultHook | None = None, ema=None):
        """`fault_hook`: the rank's fault injection (by default `faults.for_rank`), called half-way through a save;
        `ema`: the run's EMA (engine.ema.ShardedEMA), saved and restored with the engine (None: the run keeps none)."""
        self.engine, self.ema = engine, ema
        self.save_dir = save_dir
        self.rank = rank
        self.keep_last = keep_last
        self.faults = fault_hook or faults.for_rank(rank)
        self.saved: list[str] = []       # tags this run saved
        self.resumed_from: str | None = None

    def save(self, state: TrainState) -> str:
        """Save the engine, the EMA, this rank's RNG and `state` (as the client state) as one checkpoint; returns its
        directory."""
        client_state, summary = state.client_state(), state.summary()
        step = client_state["step"]
        tag = f"global_step{step}"
        tag_dir = os.path.join(self.save_dir, tag)
        # what a user put into a folder being rewritten is not this save's: not in its marker, never pruned with it
        foreign = layout.foreign_files(tag_dir) if self.rank == 0 else set()
        if self.rank == 0 and os.path.exists(os.path.join(tag_dir, layout.MARKER)):
            # being rewritten: not complete until done again
            os.remove(os.path.join(tag_dir, layout.MARKER))
        try:
            self.engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state, save_latest=False)
            # collective under ZeRO-3
            ema_state = self.ema.full_state_dict() if self.ema is not None else None
            # VIM_DS_INJECT: kill_in_save, signal_in_save, wait_for_signal_in_save
            self.faults.in_save(step)
            torch.save(rng_state(), os.path.join(tag_dir, layout.rng_file(self.rank)))
            if self.rank == 0 and ema_state is not None:
                torch.save(ema_state, os.path.join(tag_dir, layout.EMA_FILE))
        # torch.save reports a full disk as a RuntimeError from its writer
        except (OSError, RuntimeError) as exc:
            cause = _save_failure(self.save_dir, exc)
            # Free what the failed save wrote (it has no marker, so it would never be resumed anyway), by its
            # names: a user's file in the folder stays; the other ranks stop too, as soon as their next collective
            # finds this one gone.
            _remove_quietly(tag_dir)
            previous = layout.complete_tags(self.save_dir) if os.path.isdir(self.save_dir) else []
            kept = f"the previous checkpoint {os.path.join(self.save_dir, previous[-1])} is intact" if previous \
                else "no earlier checkpoint exists"
            raise SaveError(f"cannot save checkpoint {tag_dir}: {cause}; {kept}") from exc
        distributed.barrier()  # every rank's files are on disk
        if self.rank == 0:
            marker = {"step": step, "epoch": client_state["epoch"], "time": time.time(), **summary,
                      # checked before the checkpoint is used
                      "files": {rel: entry for rel, entry in layout.file_checksums(tag_dir).items()
                                if rel not in foreign}}
            layout.write_atomic(os.path.join(tag_dir, layout.MARKER), json.dumps(marker, indent=1))
            layout.write_atomic(os.path.join(self.save_dir, "latest"), tag)
            self._prune(keep=tag)
        distributed.barrier()
        return tag_dir

    def _prune(self, keep: str):
        """Keep the newest `keep_last` complete checkpoints (0 keeps all), and delete interrupted saves older than
        the one just completed. Runs only after `keep` is complete, so a crash never leaves fewer good ones.

        Only the run's own checkpoints count: folders named as it names them (`global_stepN`, whose marker says
        step N; never a user's `my_best_step2` or `global_step4.bak`), of this run's lineage (the same `run_id` in
        their markers: this run's and those of the runs it resumed), and only they are removed, file by file
        (layout.remove_saved: what the save wrote; a file a user put in the folder keeps it, said in one line). A
        `<tag>_universal` copy is derived from `<tag>` and goes when `<tag>` goes, never in its place. The checkpoint
        this run resumed from stays until `keep_last` checkpoints this run saved itself are complete, so a resumed
        run that fails early still has its start."""
        marker = layout.read_marker(os.path.join(self.save_dir, keep))
        newest, lineage = marker["step"], marker.get("run_id")
        for tag in layout.incomplete_tags(self.save_dir):
            if layout.tag_step(tag) < newest:
                self._remove(tag)
        self.saved.append(keep)
        if self.keep_last <= 0:
            return
        tags = [t for t in layout.complete_tags(self.save_dir) if self._of_lineage(t, lineage)]
        own_saves = len(set(self.saved))
        for tag in tags[:-self.keep_last]:
            if tag == keep or (tag == self.resumed_from and own_saves < self.keep_last):
                continue
            self._remove(tag)

    def _of_lineage(self, tag: str, lineage) -> bool:
        """`tag` is a checkpoint the run names `global_stepN` whose marker says step N and `lineage`'s run id."""
        if tag.endswith(UNIVERSAL_SUFFIX) or layout.tag_step(tag) < 0:
            return False
        marker = layout.read_marker(os.path.join(self.save_dir, tag))
        return marker.get("run_id") == lineage and marker.get("step") == layout.tag_step(tag)

    def _remove(self, tag: str):
        """Remove checkpoint `tag` and its universal copy, what their saves wrote only (see `_prune`)."""
        for name in (tag, tag + UNIVERSAL_SUFFIX):
            path = os.path.join(self.save_dir, name)
            if not os.path.isdir(path):
                continue
            removed, kept = layout.remove_saved(path)
            if removed and kept:
                shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
                print(f"note: --keep-checkpoints: removed the checkpoint files of {path} but kept the folder: it "
                      f"holds files the run did not write ({shown})", flush=True)

    def protect(self, path: str):
        """The checkpoint (directory, or save directory + `latest`) this run resumed from: see `_prune`."""
        save_dir, tag = layout.resolve(path, verify=False)
        if os.path.realpath(save_dir) == os.path.realpath(self.save_dir):
            self.resumed_from = tag[:-len(UNIVERSAL_SUFFIX)] if tag.endswith(UNIVERSAL_SUFFIX) else tag

    def restore(self, path: str, state: TrainState) -> TrainState:
        """Restore the engine, the EMA and the RNG from the checkpoint `path` (a save or tag directory), which this
        run's pruning then keeps (`protect`); returns `state` continued from there (`TrainState.resumed`: its
        position and lineage; refused for another global batch)."""
        saved = self.load(path)
        self.protect(path)
        return state.resumed(saved, path)

    def load(self, path: str) -> dict:
        """Restore engine, optimizer, scheduler, EMA and RNG from a save or tag directory; returns the client state."""
        # the trainer chose (and verified) it: parts.plan_resume
        save_dir, tag = layout.resolve(path, verify=False)
        try:  # DeepSpeed unpickles with weights_only=False: forced to weights-only loads here
            with safe_load.deepspeed_loads(os.path.join(save_dir, tag)):
                loaded, client_state = self.engine.load_checkpoint(save_dir, tag=tag, load_module_strict=True,
                                                                   load_optimizer_states=True,
                                                                   load_lr_scheduler_states=True)
        except CheckpointError:
            raise
        # DeepSpeed's messages span many lines; keep the first informative one
        except Exception as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: {first}") from exc
        if loaded is None:
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: DeepSpeed found no checkpoint there")
        tag_dir = os.path.join(save_dir, tag)
        if os.path.isdir(os.path.join(tag_dir, "zero")):  # a universal checkpoint
            repaired = repair_universal_load(self.engine.optimizer, os.path.join(tag_dir, "zero", "optimizer_state.pt"))
            if repaired and self.rank == 0:
                print(f"note: repaired what DeepSpeed's universal loader restored wrongly ({'; '.join(repaired)})",
                      flush=True)
        if self.ema is not None:
            ema_path = os.path.join(tag_dir, layout.EMA_FILE)
            if os.path.isfile(ema_path):
                self.ema.load_full_state_dict(safe_load.load(ema_path))
            elif self.rank == 0:
                print(f"warning: {tag_dir} has no EMA weights; the EMA restarts from the resumed weights", flush=True)
        rng_path = os.path.join(tag_dir, layout.rng_file(self.rank))
        if os.path.isfile(rng_path):
            set_rng_state(safe_load.load(rng_path, extra_globals=safe_load.numpy_rng_globals()))
        return client_state


def _remove_quietly(tag_dir: str) -> None:
    """layout.remove_saved where the folder may be gone or unreadable (a failed save's or conversion's clean-up)."""
    try:
        layout.remove_saved(tag_dir)
    except OSError:
        pass


def repair_universal_load(optimizer, optimizer_state_path: str) -> list[str]:
    """Undo what DeepSpeed's ZeRO-3 universal loader gets wrong; returns what was repaired (nothing where
    DeepSpeed got it right, so this switches itself off once DeepSpeed is fixed).

    Seen on DeepSpeed 0.19.8, in `load_hp_checkpoint_state_from_checkpoint_dir_stage3` (ZeRO-1/2's loader is
    right); tests/test_resume_exact.py reproduces both with DeepSpeed alone:
    - it copies the saved *first* group's hyperparameters into every group, so the no-weight-decay group (biases,
      norms, A_log, D, the position embedding, the class token) resumed with weight decay 0.05;
    - it gives every parameter group's optimizer state the *same* `step` tensor, which torch's Adam increments in
      place once per group, so with two groups the step count ran twice as fast after the resume (wrong bias
      corrections from the first resumed step on).
    """
    saved = safe_load.load(optimizer_state_path).get("param_groups") or []
    # the torch optimizer inside DeepSpeed's ZeRO wrapper
    base = getattr(optimizer, "optimizer", optimizer)
    groups = base.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"{optimizer_state_path} has {len(saved)} parameter groups, the optimizer "
                              f"{len(groups)}: the checkpoint was written for another model or recipe")
    repaired = []
    for i, (group, saved_group) in enumerate(zip(groups, saved)):
        wrong = {k: v for k, v in saved_group.items() if k != "params" and group.get(k) != v}
        if wrong:
            group.update(wrong)
            repaired.append(f"group {i}: {', '.join(sorted(wrong))}")
    seen, shared = set(), False
    # keyed by ZeRO-3's flat fp32 partitions (not in `params` between steps)
    for state in base.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                shared = True
            seen.add(id(state["step"]))
    if shared:
        repaired.append("a step tensor shared between groups")
    return repaired


def universal_refusal(src: str) -> str | None:
    """Why the installed DeepSpeed cannot make a universal copy of the checkpoint `src`, or None. Before 0.18 its
    ds_to_universal re-partitions the first parameter group of a ZeRO-3 checkpoint only (fp32_flat_groups[0]), and
    vim_ds's optimizer has two (with and without weight decay): the conversion failed half-way with "start (12192)
    + length (16) exceeds dimension size (12192)". A fixed bug has no module to find it by: the version says it."""
    marker = layout.read_marker(src)
    deepspeed = versions.installed()["deepspeed"]
    numbers = versions.release(deepspeed) if deepspeed else None
    if marker.get("zero_stage") != 3 or numbers is None or numbers >= (0, 18):
        return None
    return (f"cannot convert {src} to a universal checkpoint: it was saved by ZeRO-3, and DeepSpeed {deepspeed}'s "
            f"ds_to_universal re-partitions only one parameter group of a ZeRO-3 checkpoint (DeepSpeed >= 0.18 all "
            f"of them); resume it on the {marker.get('world_size', '?')} ranks that saved it, or install "
            f"deepspeed>=0.18")


def universal_copy(save_dir: str, tag: str, stall=None) -> str:
    """Re-partition a ZeRO-1/2/3 checkpoint for any rank count with DeepSpeed's `ds_to_universal` (once; run on one
    rank), next to the original as `<tag>_universal`; returns the new tag. The EMA and the completion marker are
    copied last, so a conversion that was interrupted is done again rather than resumed; one that fails or is
    stopped by an exception (vim-ds convert's signals) removes its folder. `stall()`, when given, runs before the
    marker is written (fault injection)."""
    universal = tag + UNIVERSAL_SUFFIX
    src, dst = os.path.join(save_dir, tag), os.path.join(save_dir, universal)
    if layout.is_complete(dst):
        return universal
    refused = universal_refusal(src)
    if refused:
        raise CheckpointError(refused)
    # an interrupted conversion's files (by their names: a user's file in the folder stays, out of the marker)
    _remove_quietly(dst)
    foreign = layout.foreign_files(dst)
    # ds_to_universal unpickles every rank file: run it under the weights-only allow-list like every other load. In
    # a session of its own, so that its worker processes can be stopped with it (see _end_group).
    proc = None
    try:
        proc = _start_in_session([sys.executable, "-m", "vim_ds.checkpoint.safe_load", src,
                                  "deepspeed.checkpoint.ds_to_universal", "--input_folder", src, "--output_folder",
                                  dst])
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            raise CheckpointError(f"cannot convert {src} to a universal checkpoint: "
                                  f"{_universal_failure(stderr, save_dir)}")
        if os.path.isfile(os.path.join(src, layout.EMA_FILE)):
            shutil.copy2(os.path.join(src, layout.EMA_FILE), os.path.join(dst, layout.EMA_FILE))
        if stall is not None:
            stall()
        files = {rel: entry for rel, entry in layout.file_checksums(dst).items() if rel not in foreign}
        marker = {**layout.read_marker(src), "files": files, "universal_of": tag}
        layout.write_atomic(os.path.join(dst, layout.MARKER), json.dumps(marker, indent=1))
    # a full or read-only disk, a signal (vim-ds convert's Ctrl-C, SIGTERM): no partial folder is left
    except BaseException as exc:
        cause = _save_failure(save_dir, exc) if isinstance(exc, OSError) else None
        if proc is not None:
            _end_group(proc)
        _remove_quietly(dst)
        if cause is not None:
            raise CheckpointError(f"cannot write {dst}: {cause}") from exc
        raise
    return universal


def _universal_failure(stderr: str, save_dir: str) -> str:
    """Why ds_to_universal failed, in a few words: a full or read-only disk as such, whichever words the failing
    writer used (an errno in its traceback, torch's zip writer's `unexpected pos`, the C++ stream's `basic_ios::clear:
    iostream error`, or none), else the last line it printed."""
    lines = stderr.strip().splitlines() or ["no output"]
    for code in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES):
        if re.search(rf"\[Errno {code}\]|os error {code}\b|{re.escape(os.strerror(code))}", stderr):
            return os.strerror(code)
    try:  # checked while the partial folder still holds the space it took
        fs = os.statvfs(save_dir)
    except OSError:
        return lines[-1]
    if fs.f_bavail * fs.f_frsize < 2 ** 20:
        return os.strerror(errno.ENOSPC)
    if fs.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    return lines[-1]


def _start_in_session(cmd: list[str]):
    """`cmd` as a child process in a session of its own (so that `_end_group` stops its workers with it), its output
    piped as text."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _end_group(proc) -> None:
    """Stop a child started in a session of its own and every process of its group (ds_to_universal's pool
    workers), and wait until none is left writing."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
