"""A rank whose launcher is gone saves and stops, as on SIGTERM.

A rank is started by a chain of launcher processes: the deepspeed runner (`deepspeed ...`) starts one
`deepspeed.launcher.launch` per node, which starts the ranks; torchrun's agent starts its ranks itself. Killing a
launcher with SIGKILL (a user who kills "the job" by the pid they see, a scheduler that kills only the process it
started, an OOM killer) passes nothing on: the processes below it are re-parented to init and train to the end,
holding the output folder's lock (`output_dir.py`), while whoever killed the job believes it stopped.

So each rank records, before its slow start-up, the launcher processes above it: its parent and the parents above
that, as long as each is one of the launchers above (matched on the command line; a process is identified by its
pid and start time, so a reused pid is not mistaken for it). A daemon thread checks them every `INTERVAL` seconds;
when one has ended (a zombie its parent has not reaped yet counts as ended), the rank requests the same stop a
SIGTERM does (`signals.STOP.request`): the ranks agree on it at their next meeting point, save one checkpoint
together and exit 143. Only local rank 0 of each node watches (the node's ranks share their launchers, and one
rank's request is enough: the agreement is a sum over all ranks), so the node says why in exactly one line on
stderr, unless a stop signal came first (a SIGTERM to the whole job also ends the deepspeed runner at once: nothing
more to say then).

What is never watched: a parent that is not a launcher, and anything above it. A plain `python -m vim_ds.train`
(under a shell, pytest, `vim-ds`), ranks started by SLURM directly (slurmstepd), and ranks forked by the test suite's
preloaded server (tests/preloaded.py: a test harness standing in for torchrun, not a launcher a user can kill)
have nothing to watch; a wrapper script above a launcher (launch/single_node.sh) is not watched either: it waits
for the launcher's whole process group itself. Data-loader workers never run the thread: they are forked from the
rank's fork server (a fork+exec'd process, see `vim_ds/data/loader.py`), not from the rank, and threads do not
survive a fork. The thread holds no lock of the rank's while it waits (it sleeps) and writes its line with
os.write, so it cannot leave a lock held in a process the rank forks.
"""
from __future__ import annotations

import os
import signal
import threading
import time

from . import signals

# seconds between checks: the stop comes at most this much later than a SIGTERM would
INTERVAL = 1.0
# `python -m MODULE` launchers, and launcher scripts (console scripts run as `python SCRIPT`)
LAUNCHER_MODULES = ("deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed.run",
                    "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("deepspeed", "ds", "torchrun")
_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")  # the interpreter's options that take the next argument


def launcher_name(cmdline: list[str]) -> str | None:
    """The launcher a process's command line runs (its module or script name), or None if it runs no launcher."""
    if not cmdline:
        return None
    args, script = list(cmdline), None
    if os.path.basename(args[0]).startswith("python"):
        i = 1
        while i < len(args):
            arg = args[i]
            if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):  # -m MODULE, -mMODULE
                module = args[i + 1] if arg == "-m" and i + 1 < len(args) else arg[2:]
                return module if module in LAUNCHER_MODULES else None
            if arg in ("-c", "-"):
                return None
            i += 2 if arg in _OPTIONS_WITH_VALUE else 1
            if not arg.startswith("-"):
                script = arg
                break
    else:
        script = args[0]  # a launcher run as an executable of its own
    name = os.path.basename(script) if script else None
    return name if name in LAUNCHER_SCRIPTS else None


def launchers(pid: int | None = None) -> list[tuple[object, str]]:
    """The launcher processes above process `pid` (default: this one), nearest first: (psutil.Process, name) for
    its parent and each parent above, as long as they run a launcher. Empty when the parent runs none."""
    # psutil here, not at the top: a package `import vim_ds` does not load (start-up)
    import psutil

    chain = []
    try:
        proc = psutil.Process(pid or os.getpid()).parent()
        while proc is not None and proc.pid > 1:
            name = launcher_name(proc.cmdline())
            if name is None:
                break
            chain.append((proc, name))
            proc = proc.parent()
    # a process above ended while we looked: what was found so far is still watched
    except psutil.Error:
        pass
    return chain


def _alive(proc) -> bool:
    # psutil here, not at the top (start-up)
    import psutil

    try:  # is_running() compares the start time (a reused pid is not the launcher)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LauncherWatch:
    """The launchers above this rank, found now (call it early: a launcher killed before this looks has already
    orphaned the rank, and the rank's parent is then init), watched from `start` on."""

    def __init__(self):
        # (and psutil imported here, in the main thread, not first in the watching one)
        self.chain = launchers()

    def start(self, prog: str, rank: int, local_rank: int) -> None:
        if self.chain and local_rank == 0:
            threading.Thread(target=self._watch, args=(prog, rank), name="vim_ds-launcher-watch",
                             daemon=True).start()

    def _watch(self, prog: str, rank: int) -> None:
        while True:
            time.sleep(INTERVAL)
            for proc, name in self.chain:
                if not _alive(proc):
                    if signals.STOP.first is None:
                        line = f"{prog}: rank {rank}: the launcher ({name}, pid {proc.pid}) is gone; saving a " \
                               f"checkpoint and stopping\n"
                        # not print(): no lock of sys.stderr's is taken here
                        os.write(2, line.encode())
                    signals.STOP.request(signal.SIGTERM)
                    return
