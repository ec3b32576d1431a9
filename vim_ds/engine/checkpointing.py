"""Saving and resuming training state: DeepSpeed's checkpoint plus what the trainer owns (EMA, position, RNG).

Saving is crash-safe: DeepSpeed writes the tag directory without touching `latest`; every rank then writes its
RNG states, rank 0 the gathered EMA; after a barrier rank 0 writes the completion marker and only then moves
`latest` (atomically). See `vim_ds/checkpoint/deepspeed_dir.py` for the layout.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time

import numpy as np
import torch

from ..checkpoint import deepspeed_dir as layout
from ..checkpoint.files import CheckpointError
from . import distributed, faults


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
    np.random.set_state(numpy_state)  # a tuple with a NumPy array: files written before the dict format
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
    def __init__(self, engine, save_dir: str, rank: int, keep_last: int = 2):
        self.engine = engine
        self.save_dir = save_dir
        self.rank = rank
        self.keep_last = keep_last

    def save(self, client_state: dict, ema=None, summary: dict | None = None) -> str:
        step = client_state["step"]
        tag = f"global_step{step}"
        tag_dir = os.path.join(self.save_dir, tag)
        if self.rank == 0 and os.path.exists(os.path.join(tag_dir, layout.MARKER)):
            os.remove(os.path.join(tag_dir, layout.MARKER))  # being rewritten: not complete until done again
        try:
            self.engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state, save_latest=False)
            ema_state = ema.full_state_dict() if ema is not None else None  # collective under ZeRO-3
            if faults.active("kill_in_save", step, self.rank):
                faults.kill_self()
            torch.save(rng_state(), os.path.join(tag_dir, layout.rng_file(self.rank)))
            if self.rank == 0 and ema_state is not None:
                torch.save(ema_state, os.path.join(tag_dir, layout.EMA_FILE))
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError from its writer
            cause = _save_failure(self.save_dir, exc)
            # Free what the failed save wrote (it has no marker, so it would never be resumed anyway); the other
            # ranks stop too, as soon as their next collective finds this one gone.
            shutil.rmtree(tag_dir, ignore_errors=True)
            previous = layout.complete_tags(self.save_dir) if os.path.isdir(self.save_dir) else []
            kept = f"the previous checkpoint {os.path.join(self.save_dir, previous[-1])} is intact" if previous \
                else "no earlier checkpoint exists"
            raise SaveError(f"cannot save checkpoint {tag_dir}: {cause}; {kept}") from exc
        distributed.barrier()  # every rank's files are on disk
        if self.rank == 0:
            marker = {"step": step, "epoch": client_state["epoch"], "time": time.time(), **(summary or {})}
            layout.write_atomic(os.path.join(tag_dir, layout.MARKER), json.dumps(marker, indent=1))
            layout.write_atomic(os.path.join(self.save_dir, "latest"), tag)
            self._prune(keep=tag)
        distributed.barrier()
        return tag_dir

    def _prune(self, keep: str):
        """Keep the newest `keep_last` complete checkpoints (0 keeps all), and delete interrupted saves older than
        the one just completed. Runs only after `keep` is complete, so a crash never leaves fewer good ones."""
        newest = layout.read_marker(os.path.join(self.save_dir, keep))["step"]
        for tag in layout.incomplete_tags(self.save_dir):
            if layout.tag_step(tag) < newest:
                shutil.rmtree(os.path.join(self.save_dir, tag), ignore_errors=True)
        if self.keep_last <= 0:
            return
        for tag in layout.complete_tags(self.save_dir)[:-self.keep_last]:
            if tag != keep:
                shutil.rmtree(os.path.join(self.save_dir, tag), ignore_errors=True)

    def load(self, path: str, ema=None) -> dict:
        """Restore engine, optimizer, scheduler, EMA and RNG from a save or tag directory; returns the client state."""
        from ..checkpoint import safe_load

        save_dir, tag = layout.resolve(path)
        try:  # DeepSpeed unpickles with weights_only=False: forced to weights-only loads here
            with safe_load.deepspeed_loads(os.path.join(save_dir, tag)):
                loaded, client_state = self.engine.load_checkpoint(save_dir, tag=tag, load_module_strict=True,
                                                                   load_optimizer_states=True,
                                                                   load_lr_scheduler_states=True)
        except CheckpointError:
            raise
        except Exception as exc:  # DeepSpeed's messages span many lines; keep the first informative one
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: {first}") from exc
        if loaded is None:
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: DeepSpeed found no checkpoint there")
        tag_dir = os.path.join(save_dir, tag)
        if ema is not None:
            ema_path = os.path.join(tag_dir, layout.EMA_FILE)
            if os.path.isfile(ema_path):
                ema.load_full_state_dict(safe_load.load(ema_path))
            elif self.rank == 0:
                print(f"warning: {tag_dir} has no EMA weights; the EMA restarts from the resumed weights", flush=True)
        rng_path = os.path.join(tag_dir, layout.rng_file(self.rank))
        if os.path.isfile(rng_path):
            set_rng_state(safe_load.load(rng_path, extra_globals=safe_load.numpy_rng_globals()))
        return client_state


def universal_copy(save_dir: str, tag: str) -> str:
    """Re-partition a ZeRO-1/2/3 checkpoint for any rank count with DeepSpeed's `ds_to_universal` (once; run on one
    rank), next to the original as `<tag>_universal`; returns the new tag. The EMA and the completion marker are
    copied last, so a conversion that was interrupted is done again rather than resumed."""
    import subprocess
    import sys

    universal = f"{tag}_universal"
    src, dst = os.path.join(save_dir, tag), os.path.join(save_dir, universal)
    if layout.is_complete(dst):
        return universal
    shutil.rmtree(dst, ignore_errors=True)
    # ds_to_universal unpickles every rank file: run it under the weights-only allow-list like every other load
    proc = subprocess.run([sys.executable, "-m", "vim_ds.checkpoint.safe_load", src,
                           "deepspeed.checkpoint.ds_to_universal", "--input_folder", src, "--output_folder", dst],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"cannot convert {src} to a universal checkpoint: {last}")
    if os.path.isfile(os.path.join(src, layout.EMA_FILE)):
        shutil.copy2(os.path.join(src, layout.EMA_FILE), os.path.join(dst, layout.EMA_FILE))
    shutil.copy2(os.path.join(src, layout.MARKER), os.path.join(dst, layout.MARKER))
    return universal
