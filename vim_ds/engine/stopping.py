"""Stopping a training run on a signal (`runtime/signals.py` records it; its docstring says where signals come
from): the ranks agree on the signal where they all meet (the step's all-reduce, each evaluation batch, the start,
the end of an epoch), then save one checkpoint together and stop with `StopRequested`, every rank at the same
point. The trainer holds one `Stopping` and asks it at those points."""
from __future__ import annotations

import signal

from ..runtime import distributed, faults, signals
from ..runtime.signals import StopRequested


class Stopping:
    """The loop's decisions on a stop signal. `save` saves a checkpoint of the run (it records the path here:
    `checkpoint_saved`); `saves`: the run has somewhere to save to; `resuming`: it resumed a checkpoint (which
    `--resume auto` continues from when nothing new was saved)."""

    def __init__(self, dist, save, *, saves: bool, resuming: bool, total_steps: int,
                 fault_hook: faults.FaultHook = faults.NO_FAULTS, received: signals.StopSignals = signals.STOP):
        self.dist, self.save, self.saves, self.resuming = dist, save, saves, resuming
        self.total_steps, self.faults, self.received = total_steps, fault_hook, received
        # the signal the ranks agreed on during the last evaluation, which it cut short (None: it ran whole)
        self.cut_evaluation: int | None = None
        self._eval_batches = 0

    # -- the agreement ------------------------------------------------------------------------------------------

    def votes(self) -> list[float]:
        """This rank's votes, to add to a collective sum the caller makes anyway (the step's); `agreed` reads the
        sums."""
        return self.received.votes()

    def agreed(self, summed: list[float]) -> int | None:
        """The signal every rank stops on, from the votes summed over the ranks, or None (go on)."""
        return self.received.agreed(summed)

    def agree(self) -> int | None:
        """The signal every rank stops on, agreed now (a collective: every rank calls it at the same point)."""
        return self.agreed(distributed.all_reduce_sum(self.votes(), self.dist.device))

    def checkpoint_saved(self, path: str):
        """The run's newest checkpoint, for the line a second Ctrl-C prints (it stops without saving)."""
        self.received.last_checkpoint = path

    # -- where the loop asks ------------------------------------------------------------------------------------

    def before_training(self, progress):
        """A signal while the run was being built (or resumed): stop before the first step."""
        stop = self.agree()
        if stop:
            self.stop(stop, progress)

    def after_step(self, summed_votes: list[float], progress):
        """The step's votes, summed with its loss: the ranks agreed to stop, so save and stop after this step."""
        stop = self.agreed(summed_votes)
        if stop:
            self.stop(stop, progress)

    def evaluation_started(self):
        self.cut_evaluation, self._eval_batches = None, 0

    def cuts_evaluation(self, progress) -> bool:
        """Asked by the evaluation at each batch: have the ranks agreed to stop on a signal? A full evaluation can
        outlast the 30 s a launcher leaves between SIGTERM and SIGKILL, so a stop cuts it short."""
        # trained: not the evaluation a resumed run owes (a wait_for_signal_in_eval lets it through)
        self.faults.in_evaluation(progress.step, self._eval_batches, trained=progress.step > progress.started_at)
        self._eval_batches += 1
        self.cut_evaluation = self.agree()
        return self.cut_evaluation is not None

    def after_owed_evaluation(self, progress):
        """The evaluation a checkpoint owed was cut short again: stop; the checkpoint resumed from still owes it."""
        if self.cut_evaluation:
            self.stop(self.cut_evaluation, progress, saved=True)

    def after_epoch(self, progress, finished: bool):
        """After an epoch's evaluation and save: a signal during either, or that came since, stops the run (the save
        is done), unless the run is `finished` and its evaluation whole."""
        stop = self.cut_evaluation or self.agree()
        if stop and (self.cut_evaluation or not finished):
            self.stop(stop, progress, saved=True)

    # -- the stop -----------------------------------------------------------------------------------------------

    def stop(self, signum: int, progress, saved: bool = False):
        """The ranks agreed to stop on `signum`: save (unless this step was just saved, or nothing was trained) and
        stop, all together (StopRequested)."""
        if not saved and progress.step > progress.started_at:
            self.save()
        if self.dist.is_main:
            name = signal.Signals(signum).name
            if not self.saves:
                where = "nothing saved (no --output_dir)"
            elif progress.step == progress.started_at and not saved:
                where = "no step taken yet, nothing to save" + \
                    ("; continue with --resume auto" if self.resuming else "")
            else:
                where = f"saved {progress.last_checkpoint}; continue with --resume auto"
            print(f"stopping on {name} after step {progress.step} of {self.total_steps}: {where}", flush=True)
        raise StopRequested(signum, progress.last_checkpoint)
