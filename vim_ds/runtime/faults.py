"""Fault injection for the fault-tolerance tests (`tests/faults/`): never active unless VIM_DS_INJECT is set.

Some faults cannot be produced from outside a real run at a precise moment — a loss that turns NaN at step 5, a
process killed while it is half-way through writing a checkpoint — so the trainer asks this module at those
points. The variable holds comma-separated `FAULT@STEP[:RANK]` items, e.g.

    VIM_DS_INJECT="nan_loss@5,nan_loss@6"     the loss of optimizer steps 5 and 6 is NaN (on every rank)
    VIM_DS_INJECT="kill_in_save@4:0"          rank 0 SIGKILLs itself while saving the step-4 checkpoint
    VIM_DS_INJECT="hang@3:1"                  rank 1 blocks for good at the start of optimizer step 3
    VIM_DS_INJECT="wait_for_signal@3"         every rank waits at the start of step 3 until it has a stop signal

Faults: `nan_loss` (multiplies the step's loss by NaN before backward, so the gradients are NaN too),
`kill_in_save` (after DeepSpeed has written its files, before vim_ds's own files and the completion marker), `hang`
(the rank stays alive but never reaches the step's collectives, as a rank stuck in a driver call or on a lost node
does: its peers must fail after --dist-timeout), and
`stall_train`/`stall_val`, whose number counts samples, not steps: a worker of that data loader blocks for good at
the N-th sample it loads (`vim_ds/data/loader.py`), as a read from a hung file system does.

Signals from outside at a known step, for tests/test_slurm.py (a real SLURM sends them: `scontrol requeue`, a time
limit's `--signal=TERM@N`, `scancel`): `wait_for_signal@N` makes the rank wait (sleeping, no CPU) at the start of
optimizer step N until it has received SIGTERM or SIGINT, then take the step, so the ranks agree to stop after step N
however long the signal takes to come; a resumed run starts after step N and never waits. In the other two phases
where a signal can find the ranks: `wait_for_signal_in_eval@N` waits the same way at the first batch of the
evaluation after step N (the ranks then agree to cut it short; the run that resumes the checkpoint saved then
evaluates step N again, without waiting), and `wait_for_signal_in_save@N` half-way through
saving the step-N checkpoint, where `signal_in_save` sends its signal (the save then completes).

Signals at a precise phase, for tests/faults/test_signals.py: a real signal (VIM_DS_INJECT_SIGNAL: `SIGTERM`, the
default, or `SIGINT`; with `:rank`, to the injecting rank only instead of its whole process group, launcher and
workers included) sent by `signal_in_step@N` at the start of optimizer step N, `signal_in_eval@N` at the first
batch of the evaluation after step N, `signal_in_save@N` half-way through saving the step-N checkpoint, and
`signal_in_train@N` by a training data-loader worker at its N-th sample, which it then takes 2 s over (the rank is
waiting for data when the signal arrives).

A refusal at a precise moment, for tests/faults/test_refused_runs_leave_nothing.py: `refuse_in_step@N` raises, at the
start of optimizer step N, the ValueError a check of the input raises (the run ends as refused, exit 2), after the
run has written its options.yaml and metrics.jsonl: what a run refused that late must take back.

For `vim-ds convert` (tests/faults/test_convert_faults.py): `stall_convert_write@1` stops the converter for good
once the bytes of OUT are written, before OUT gets them (fsynced, not yet named), after saying so on stderr, so that
a test sends a real signal (or SIGKILL) to a converter that is writing; with `--universal`, once ds_to_universal has
written the folder, before its completion marker.

The training loop reaches all of this through one object, `for_rank(rank)`, built once per rank: one call per point
where a fault can strike (before a micro step, on a step's loss, at an evaluation batch, in a save, in a data
loader's workers). Nothing injected and nothing recorded, it is `NO_FAULTS`, whose calls do nothing.

One recording hook, for tests/test_recipe_step.py (an independent reference of the training step replays what the
trainer consumed): `VIM_DS_RECORD_BATCHES=DIR` makes every rank save each training micro batch as the loader
delivered it (before Mixup), with the seed its micro step was seeded with, to `DIR/step{S}_micro{M}_rank{R}.pt`
(S counts optimizer steps from 1). Off unless set.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

from . import signals

KNOWN = ("nan_loss", "kill_in_save", "hang", "stall_train", "stall_val", "signal_in_step", "signal_in_eval",
         "signal_in_save", "signal_in_train", "wait_for_signal", "wait_for_signal_in_eval", "wait_for_signal_in_save",
         "stall_convert_write", "refuse_in_step")


def _parse(text: str) -> set[tuple[str, int, int | None]]:
    faults = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if name not in KNOWN or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"VIM_DS_INJECT: cannot read {item!r} (expected FAULT@STEP[:RANK], FAULT one of "
                             f"{', '.join(KNOWN)})")
        faults.add((name, int(step), int(rank) if rank else None))
    return faults


# read when first asked, not at import: a value it cannot read is then a one-line error of the command that reads
# it (runtime/env_vars.py checks it at every command's start), not a traceback of an import
_FAULTS = None
_RECORD_DIR = os.environ.get("VIM_DS_RECORD_BATCHES", "")


def check_injected(text: str) -> None:
    """A ValueError naming VIM_DS_INJECT and what it accepts when `text` cannot be read."""
    _parse(text)


def check_signal(text: str) -> None:
    """A ValueError naming VIM_DS_INJECT_SIGNAL and what it accepts when `text` cannot be read."""
    _signal_target(text)


def _faults() -> set[tuple[str, int, int | None]]:
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = _parse(os.environ.get("VIM_DS_INJECT", ""))
    return _FAULTS


def active(name: str, step: int, rank: int) -> bool:
    faults = _faults()
    return (name, step, None) in faults or (name, step, rank) in faults


def number(name: str, rank: int) -> int | None:
    """The number of a `name` fault that applies to `rank`, or None."""
    return min((n for fault, n, r in _faults() if fault == name and r in (None, rank)), default=None)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def hang():
    """Block this thread for good (signals still run their handlers; only SIGKILL or the handlers end it)."""
    while True:
        time.sleep(3600)


def wait_for_signal():
    """Sleep until this process has received a stop signal (see `signals.STOP`)."""
    while signals.STOP.first is None:
        time.sleep(0.1)


def stall(what: str):
    """Say on stderr that this process is stalled at `what` (a test waits for the line), then block for good."""
    print(f"VIM_DS_INJECT: stalled {what}", file=sys.stderr, flush=True)
    hang()


def _signal_target(text: str | None = None) -> tuple[int, bool]:
    """(signal, to this process only) from VIM_DS_INJECT_SIGNAL (or `text`)."""
    text = os.environ.get("VIM_DS_INJECT_SIGNAL", "SIGTERM") if text is None else text
    name, _, target = text.partition(":")
    if name not in ("SIGTERM", "SIGINT") or target not in ("", "rank"):
        raise ValueError(f"VIM_DS_INJECT_SIGNAL: cannot read {name}{':' + target if target else ''} (expected "
                         f"SIGTERM or SIGINT, optionally followed by :rank)")
    return getattr(signal, name), target == "rank"


def send_signal():
    """Send the injected signal now, to this process or to its whole process group."""
    signum, rank_only = _signal_target()
    if rank_only:
        os.kill(os.getpid(), signum)
    else:
        os.killpg(os.getpgid(0), signum)


def signal_at(sample: int | None) -> tuple[int, int, int] | None:
    """For a data loader: (sample count, signal, pid or 0 for the process group) its worker sends, or None."""
    if sample is None:
        return None
    signum, rank_only = _signal_target()
    return sample, int(signum), os.getpid() if rank_only else 0


def record_batch(step: int, micro: int, rank: int, seed: int, images, targets) -> None:
    """Under VIM_DS_RECORD_BATCHES=DIR, save one micro batch (see the module docstring); otherwise nothing."""
    if not _RECORD_DIR:
        return

    os.makedirs(_RECORD_DIR, exist_ok=True)
    torch.save({"images": images.detach().cpu().clone(), "targets": targets.detach().cpu().clone(), "seed": seed},
               os.path.join(_RECORD_DIR, f"step{step}_micro{micro}_rank{rank}.pt"))


class FaultHook:
    """The faults VIM_DS_INJECT injects into one rank (and VIM_DS_RECORD_BATCHES's recording), at each point of the
    training loop where one can strike. Steps are optimizer steps counted from 1, as in VIM_DS_INJECT."""

    def __init__(self, rank: int):
        self.rank = rank

    def _active(self, name: str, step: int) -> bool:
        return active(name, step, self.rank)

    def before_micro_step(self, step: int, micro: int, seed: int, images, targets) -> None:
        """A micro step of optimizer step `step` is about to run on this batch (seeded with `seed`): record it, and
        at the step's first micro step send a signal, hang or wait for a signal."""
        record_batch(step, micro, self.rank, seed, images, targets)  # VIM_DS_RECORD_BATCHES
        if micro == 0 and self._active("signal_in_step", step):
            send_signal()
        if micro == 0 and self._active("hang", step):
            hang()
        if micro == 0 and self._active("wait_for_signal", step):
            wait_for_signal()
        if micro == 0 and self._active("refuse_in_step", step):
            raise ValueError(f"VIM_DS_INJECT: refuse_in_step@{step}: a refusal injected at the start of step {step}")

    def on_loss(self, step: int, loss):
        """The loss of a micro step of optimizer step `step`, before backward (NaN under `nan_loss`)."""
        if self._active("nan_loss", step):
            return loss * float("nan")
        return loss

    def in_evaluation(self, step: int, batch: int, trained: bool) -> None:
        """Before batch `batch` (counted from 0 over the model's and the EMA's evaluations) of the evaluation after
        step `step`; `trained`: this process trained a step (not the evaluation a resumed run owes, which a
        `wait_for_signal_in_eval` lets through)."""
        if self._active("signal_in_eval", step) and batch == 0:
            send_signal()
        if self._active("wait_for_signal_in_eval", step) and batch == 0 and trained:
            wait_for_signal()

    def in_save(self, step: int) -> None:
        """Half-way through saving the step-`step` checkpoint (DeepSpeed's files written, vim_ds's not yet)."""
        if self._active("kill_in_save", step):
            kill_self()
        if self._active("signal_in_save", step):
            send_signal()
        if self._active("wait_for_signal_in_save", step):
            wait_for_signal()

    def loader(self, name: str) -> dict:
        """The keywords of `data.loader.build_loader` that make the `name` loader's workers stall or send a signal
        (`stall_NAME`, `signal_in_NAME`)."""
        return {"stall_at": number(f"stall_{name}", self.rank),
                "signal_at": signal_at(number(f"signal_in_{name}", self.rank))}


class _NoFaults(FaultHook):
    """Nothing injected, nothing recorded: every point is a no-op."""

    def __init__(self):
        super().__init__(-1)

    def before_micro_step(self, step, micro, seed, images, targets) -> None:
        pass

    def on_loss(self, step, loss):
        return loss

    def in_evaluation(self, step, batch, trained) -> None:
        pass

    def in_save(self, step) -> None:
        pass

    def loader(self, name: str) -> dict:
        return {"stall_at": None, "signal_at": None}


NO_FAULTS = _NoFaults()


def for_rank(rank: int) -> FaultHook:
    """The fault hook of `rank`: NO_FAULTS unless VIM_DS_INJECT or VIM_DS_RECORD_BATCHES is set."""
    return FaultHook(rank) if _faults() or _RECORD_DIR else NO_FAULTS
