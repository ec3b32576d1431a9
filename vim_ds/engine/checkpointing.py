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
from . import distributed


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        self.engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state, save_latest=False)
        ema_state = ema.full_state_dict() if ema is not None else None  # collective under ZeRO-3
        torch.save(rng_state(), os.path.join(tag_dir, layout.rng_file(self.rank)))
        if self.rank == 0 and ema_state is not None:
            torch.save(ema_state, os.path.join(tag_dir, layout.EMA_FILE))
        distributed.barrier()  # every rank's files are on disk
        if self.rank == 0:
            marker = {"step": step, "epoch": client_state["epoch"], "time": time.time(), **(summary or {})}
            layout.write_atomic(os.path.join(tag_dir, layout.MARKER), json.dumps(marker, indent=1))
            layout.write_atomic(os.path.join(self.save_dir, "latest"), tag)
            self._prune(keep=tag)
        distributed.barrier()
        return tag_dir

    def _prune(self, keep: str):
        """Keep the newest `keep_last` complete checkpoints (0 keeps all)."""
        if self.keep_last <= 0:
            return
        for tag in layout.complete_tags(self.save_dir)[:-self.keep_last]:
            if tag != keep:
                shutil.rmtree(os.path.join(self.save_dir, tag), ignore_errors=True)

    def load(self, path: str, ema=None) -> dict:
        """Restore engine, optimizer, scheduler, EMA and RNG from a save or tag directory; returns the client state."""
        save_dir, tag = layout.resolve(path)
        try:
            loaded, client_state = self.engine.load_checkpoint(save_dir, tag=tag, load_module_strict=True,
                                                               load_optimizer_states=True,
                                                               load_lr_scheduler_states=True)
        except Exception as exc:  # DeepSpeed's messages span many lines; keep the first informative one
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: {first}") from exc
        if loaded is None:
            raise CheckpointError(f"cannot resume {os.path.join(save_dir, tag)}: DeepSpeed found no checkpoint there")
        tag_dir = os.path.join(save_dir, tag)
        if ema is not None:
            ema_path = os.path.join(tag_dir, layout.EMA_FILE)
            if os.path.isfile(ema_path):
                ema.load_full_state_dict(torch.load(ema_path, map_location="cpu", weights_only=True))
            elif self.rank == 0:
                print(f"warning: {tag_dir} has no EMA weights; the EMA restarts from the resumed weights", flush=True)
        rng_path = os.path.join(tag_dir, layout.rng_file(self.rank))
        if os.path.isfile(rng_path):
            set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=False))
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
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
                           "--output_folder", dst], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"cannot convert {src} to a universal checkpoint: {last}")
    if os.path.isfile(os.path.join(src, layout.EMA_FILE)):
        shutil.copy2(os.path.join(src, layout.EMA_FILE), os.path.join(dst, layout.EMA_FILE))
    shutil.copy2(os.path.join(src, layout.MARKER), os.path.join(dst, layout.MARKER))
    return universal
