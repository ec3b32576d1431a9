"""Stopping a training run on a signal, as clusters and terminals send them, without losing it.

SIGTERM comes from SLURM before a time limit or on preemption (`--signal=TERM@120`, to every process of the
step), from `kill`, and from a launcher passing a signal on (the deepspeed launcher turns anything into SIGTERM to
the whole tree, and SIGKILLs 30 s later). SIGINT comes from Ctrl-C in a terminal (to the whole foreground process
group: the launcher and every rank) and from torchrun passing one on. Either may arrive at any moment: in a
training step, while the rank waits for data, in an evaluation, while it saves, or before training starts.

The handler only records the signal. The ranks agree on it at the next point where they all meet (the step's
all-reduce, each evaluation batch, after the epoch's checkpoint: the trainer's `engine.stopping.Stopping`), then
save one checkpoint together and stop:
exit code 128 + the signal, as a shell reports a process the signal ended (143 for SIGTERM, 130 for SIGINT).
Data-loader workers and their fork server ignore both (see `vim_ds/data/loader.py`), so that a signal to the
whole process group cannot kill them under a rank that is still saving: the decision is the rank's.

A launcher killed with SIGKILL passes nothing on; a rank that sees its launcher gone requests the same stop as a
SIGTERM itself (`StopSignals.request`, from `launcher_watch.py`), and exits 143 the same way.

A second Ctrl-C stops at once without saving (exit 130). A SIGINT that follows the first by less than
`SAME_PRESS` seconds is the same Ctrl-C passed on by a launcher (torchrun forwards it to every rank, which the
terminal signalled already), not a second press.
"""
from __future__ import annotations

import os
import signal
import time

# seconds: a SIGINT this soon after the first is the same Ctrl-C relayed by a launcher
SAME_PRESS = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """The ranks agreed to stop on a signal; a checkpoint was saved (or no --output_dir was given)."""

    def __init__(self, signum: int, checkpoint: str | None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.checkpoint = signum, checkpoint


class StopSignals:
    """The signals this process received, and what the ranks agreed on (one per process: see `install`)."""

    def __init__(self):
        self.first: int | None = None      # the first stop signal this process received
        self.first_at = 0.0
        self.is_main = True                # prints the Ctrl-C notice
        self.last_checkpoint = None        # for the line a second Ctrl-C prints

    def install(self, is_main: bool):
        self.is_main = is_main
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame):
        now = time.monotonic()
        if self.first is None:
            self.first, self.first_at = signum, now
            if signum == signal.SIGINT and self.is_main:
                _say("Ctrl-C: saving a checkpoint after the current step, then stopping (Ctrl-C again to stop at "
                     "once without saving)")
            return
        if signum == signal.SIGINT and now - self.first_at >= SAME_PRESS:
            where = f"the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
                "no checkpoint of this run was saved"
            if self.is_main:
                _say(f"second Ctrl-C: stopping now without saving; {where}")
            # at once: no clean-up that could wait on other ranks or workers
            os._exit(128 + signal.SIGINT)

    def request(self, signum: int):
        """A stop this process asks for itself, counted as if `signum` had arrived (its launcher is gone: see
        `launcher_watch`); nothing if a stop signal came first. Safe from any thread."""
        if self.first is None:
            self.first, self.first_at = signum, time.monotonic()

    def votes(self) -> list[float]:
        """This rank's part of the agreement, summed over ranks: [received SIGINT first, received SIGTERM first]."""
        return [float(self.first == signal.SIGINT), float(self.first == signal.SIGTERM)]

    @staticmethod
    def agreed(summed: list[float]) -> int | None:
        """The signal every rank stops on, from the summed votes: SIGINT if any rank got one first (a person at a
        terminal), else SIGTERM if any rank got it, else None (go on)."""
        if summed[0] > 0:
            return signal.SIGINT
        return signal.SIGTERM if summed[1] > 0 else None


def _say(line: str):
    # not print(): a handler may run while the main thread is inside print()
    os.write(2, (line + "\n").encode())


STOP = StopSignals()


def install(is_main: bool):
    """Route SIGTERM and SIGINT to `STOP` for the rest of this process (call before the slow start-up: a signal
    that arrives while the model is built or a checkpoint loaded stops the run at its first step)."""
    STOP.install(is_main)
