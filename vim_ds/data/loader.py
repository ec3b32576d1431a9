"""DataLoaders for training, evaluation and `vim-ds eval`: worker processes that start safely in a process full of
threads, a stall timeout that names the loader, and a default worker count that fits the machine.

Why workers come from a fork server. A training rank runs many threads (gloo/NCCL, OpenMP, the DataLoader's queue
feeder threads, ...). `fork()` copies only the calling thread; any lock another thread held at that instant stays
locked in the child for good. CPython's own after-fork clean-up then runs finalizers of the other threads' state
(`PyOS_AfterFork_Child` -> `_PyThreadState_DeleteExcept`), and the worker's start-up seeds torch's CPU generator,
whose mutex another thread may hold: either can wait forever on a lock nobody will release. That is how the first
evaluation of a 2-rank run hung (its validation workers are forked lazily, long after those threads started).
Three ways out: `spawn` (a fresh interpreter per worker: safe, but every worker re-imports torch, seconds each),
starting every worker before any thread exists (impossible to keep true: the process group's threads exist before
the trainer is built, and loaders are re-created), or `forkserver`: one clean, single-threaded server process per
rank, started by fork+exec with the heavy modules imported once (`_PRELOAD`), from which each worker is forked.
We use the fork server: workers start as fast as with `fork` and no thread of the rank is ever copied.

Workers receive the dataset by pickling (datasets and transforms must pickle) and seed every sample from its key
(`datasets.seeded_rngs`), so batches and losses do not depend on how workers are started.
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker

from torch.utils.data import DataLoader, Dataset

DEFAULT_WORKERS = 10  # the published Vim/DeiT default, per rank
START_METHOD = "forkserver"
# blocked in the fork server (see `_worker_context`), unblocked again in each worker (`_worker_init`)
_SERVER_BLOCKS = {signal.SIGTERM, signal.SIGINT}
# imported once by the fork server; every worker forked from it has them (vim_ds.data: torch, torchvision, timm
# transforms, PIL, the datasets)
_PRELOAD = ["vim_ds.data.loader"]


class DataStall(RuntimeError):
    """A data loader delivered no batch within its timeout (`--data-timeout`)."""


def default_num_workers(local_world_size: int | None = None) -> int:
    """The published 10 workers per rank, capped to the cores this process may use shared by the ranks on this node.

    At least 1, not 0: data then never runs in the training thread, so `--data-timeout` can always stop a stalled
    loader (a read that hangs in the training process itself could not be interrupted), and the same worker code
    runs in every default run. The cost on a 1-core-per-rank machine is one extra process.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    cores = len(os.sched_getaffinity(0))
    return max(1, min(DEFAULT_WORKERS, cores // max(1, local_world_size)))


def _worker_init(leave_signals_to_owner: bool, owner_pid: int, _worker_id: int):
    """SIGTERM and SIGINT in a worker. A trainer's workers ignore both: the rank decides (it saves and stops, see
    `vim_ds/runtime/signals.py`, and shuts them down itself), and a signal to the whole process group (SLURM, Ctrl-C,
    a launcher's tree kill) must not kill them under a rank that is still saving. Other workers die of SIGTERM and
    leave SIGINT to torch's worker loop. Either way both are unblocked (see `_worker_context`).

    A worker also exits when the process that owns its loader (`owner_pid`) is gone, e.g. a rank killed with
    SIGKILL. torch's own check does not see that: it watches the worker's parent, which is the fork server, and the
    fork server lives as long as any worker holds its "alive" pipe, which every worker inherits. Without this a
    killed rank would leave its workers and fork server running for good."""
    _keep_freed_memory()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if leave_signals_to_owner else signal.SIG_DFL)
    if leave_signals_to_owner:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SERVER_BLOCKS)
    threading.Thread(target=_exit_with, args=(owner_pid,), name="vim_ds-owner-watch", daemon=True).start()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
WORKER_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
WORKER_TRIM_THRESHOLD = 256 << 20


def _keep_freed_memory() -> bool:
    """Tell glibc's malloc, in this worker, to keep memory it frees for the next image instead of giving it back.

    Every sample allocates and frees the same large buffers (the decoded photo, 0.5 MB at ImageNet's sizes, and
    the transform's intermediate images). By default glibc serves blocks above its mmap threshold with a fresh
    mmap and returns freed heap tops to the system, so each image's buffers are new pages that fault in again
    (measured: 250-450 page faults per image, the decode 0.2-0.3 ms slower than timm's loader with the same
    Pillow call). With both thresholds high, the heap grows to what one sample needs once and is reused. The cost
    is memory a worker keeps: its peak heap, tens of MB at ImageNet's sizes. Done with mallopt through ctypes
    rather than MALLOC_*_ environment variables, which would reach every process the rank starts, not only the
    workers. No-op (False) where there is no glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD))


def _exit_with(pid: int) -> None:
    """Block until process `pid` ends, then end this process (a pidfd becomes readable when its process
    terminates, zombie or not)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (old kernel or non-Linux): poll instead
        while True:
            time.sleep(2)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


def _worker_context():
    """The fork-server context, its server started now (so it imports `_PRELOAD` while the caller builds the model).

    The server is started with SIGTERM and SIGINT blocked, as the standard library starts its resource tracker: it
    is in the rank's process group, and a SIGTERM to the whole job (SLURM, the launcher) or a Ctrl-C must not kill
    it, because workers whose server died look dead to the DataLoader. The standard library's server ignores SIGINT
    itself, but only once it has imported `_PRELOAD` (seconds): a Ctrl-C in a run's first seconds killed it there,
    with a KeyboardInterrupt traceback. Blocking rather than ignoring keeps a signal that arrives meanwhile pending
    for this process instead of losing it; workers unblock both (`_worker_init`). The server exits when this
    process does.

    The resource tracker is started first, apart: `forkserver.ensure_running` starts it when it is not running yet,
    and its start unblocks SIGTERM and SIGINT in the calling thread when done (`resource_tracker.ensure_running`
    blocks them around its own spawn, then unblocks rather than restoring the mask). Started in the same call, the
    server came up with SIGTERM unblocked and died of the job's SIGTERM; its workers then exit (torch's worker
    watches its parent) and a rank still waiting for data failed with "DataLoader worker ... exited unexpectedly".
    """
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(_PRELOAD)
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SERVER_BLOCKS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return context


def stop_workers(iterator) -> None:
    """Stop a multi-process iterator's workers: ask them to exit (DataLoader's own shutdown, which waits a few
    seconds each and then sends SIGTERM), then SIGKILL any that is still there (stuck, or ignoring SIGTERM)."""
    if iterator is None or not hasattr(iterator, "_shutdown_workers"):
        return
    workers = list(getattr(iterator, "_workers", []))
    iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.join(5)


class Loader(DataLoader):
    """A DataLoader that knows its name ("train", "val") and turns its timeout into a one-line `DataStall`.

    With a `finish` (`transforms.Finish`), workers hand over (uint8 images, targets, ok, erase seeds) and the
    loader yields (finished float images, targets, ok): normalisation and random erasing run here, in the
    consuming process, on the whole batch."""

    def __init__(self, *args, name: str, finish=None, **kwargs):
        self.name, self.finish = name, finish
        super().__init__(*args, **kwargs)

    def __iter__(self):
        for batch in self._batches():
            if self.finish is not None:
                images, targets, ok, seeds = batch
                batch = self.finish(images, seeds.tolist(), pin_memory=self.pin_memory), targets, ok
            yield batch

    def _batches(self):
        iterator = super().__iter__()
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as exc:
                if not (self.timeout and str(exc).startswith("DataLoader timed out")):
                    raise
                pids = ", ".join(str(w.pid) for w in getattr(iterator, "_workers", []))
                stop_workers(iterator)
                self._iterator = None
                raise DataStall(f"the {self.name} data loader delivered no batch in {self.timeout:g} s "
                                f"(--data-timeout): a worker is stuck (a hung file system, a blocked read or decode); "
                                f"workers were pids {pids}") from None
            yield batch

    def shutdown(self) -> None:
        """Stop persistent workers now (a no-op when none were started)."""
        stop_workers(getattr(self, "_iterator", None))
        self._iterator = None


class _Handover(Dataset):
    """What a worker reads from a dataset with a `finish`: `handover_item` (uint8 image, target, ok, erase seed)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.dataset.handover_item(key)


class _SignalAt(Dataset):
    """Fault injection (`VIM_DS_INJECT="signal_in_train@N:RANK"`, see runtime/faults.py): at the N-th sample it
    loads, a worker sends `signum` to `pid` (0: its whole process group), then takes 2 s over the sample, so the
    signal arrives while the rank waits for data."""

    def __init__(self, dataset, at: int, signum: int, pid: int):
        self.dataset, self.at, self.signum, self.pid, self.loaded = dataset, at, signum, pid, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        self.loaded += 1
        if self.loaded == self.at:
            if self.pid:
                os.kill(self.pid, self.signum)
            else:
                os.killpg(os.getpgid(0), self.signum)
            time.sleep(2)
        return self.dataset[key]


class _StallAt(Dataset):
    """Fault injection (`VIM_DS_INJECT="stall_val@N:RANK"`, see runtime/faults.py): the N-th sample a worker loads
    blocks for good, as a read from a hung file system does."""

    def __init__(self, dataset, at: int):
        self.dataset, self.at, self.loaded = dataset, at, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        self.loaded += 1
        if self.loaded >= self.at:
            threading.Event().wait()
        return self.dataset[key]


@dataclass(frozen=True)
class LoaderConfig:
    """The loader settings a run chooses; the fields are `vim-ds train`'s options of the same names (the engine
    fills them from there: config/components.py)."""

    # worker processes; None: `default_num_workers`; 0: read in the calling process
    num_workers: int | None
    # seconds for the workers to deliver a batch; 0 or None: no limit
    data_timeout: float | None


def build_loader(dataset, batch_sampler, config: LoaderConfig, name: str, *, local_world_size: int | None = None,
                 persistent: bool = False, pin_memory: bool = False, leave_signals_to_owner: bool = False,
                 stall_at: int | None = None, signal_at: tuple[int, int, int] | None = None,
                 owner_pid: int | None = None) -> Loader:
    """The DataLoader for `dataset` (read in `batch_sampler`'s batches) with `config.num_workers` workers (None: the
    machine's default, `default_num_workers`) started from the fork server, and `config.data_timeout` seconds (0 or
    None: no limit) to deliver each batch. Fault injection, chosen by the engine: `stall_at`, the sample count at
    which a worker blocks for good; `signal_at`, (sample count, signal, pid or 0 for the process group) a worker
    sends. Workers exit when `owner_pid` (default: this process) is gone."""
    workers = config.num_workers if config.num_workers is not None else default_num_workers(local_world_size)
    finish = getattr(dataset, "finish", None)
    if finish is not None:
        dataset = _Handover(dataset)
    if stall_at is not None:
        dataset = _StallAt(dataset, stall_at)
    if signal_at is not None:
        dataset = _SignalAt(dataset, *signal_at)
    if workers == 0:
        return Loader(dataset, batch_sampler=batch_sampler, name=name, finish=finish)
    return Loader(dataset, batch_sampler=batch_sampler, name=name, finish=finish, num_workers=workers,
                  pin_memory=pin_memory,
                  persistent_workers=persistent, prefetch_factor=4, multiprocessing_context=_worker_context(),
                  worker_init_fn=functools.partial(_worker_init, leave_signals_to_owner, owner_pid or os.getpid()),
                  timeout=float(config.data_timeout or 0))
