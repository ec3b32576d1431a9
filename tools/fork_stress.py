"""Stress test for data-loader worker start-up in a process full of threads (issue 11: a 2-rank run hung at its
first evaluation, a validation worker stuck in `PyOS_AfterFork_Child` -> `_PyThreadState_DeleteExcept`).

Background threads do what a training rank's threads do to locks, so that `fork()` often lands while a lock is held:
  locks  a thread holds a lock most of the time (as gloo, OpenMP and queue-feeder threads hold theirs), and parked
         threads keep a thread-local object whose finalizer takes that lock: CPython's after-fork clean-up in the
         child (`_PyThreadState_DeleteExcept`) runs that finalizer and waits for good, the reported stack;
  rng    threads draw from torch's CPU generator, whose mutex a forked worker needs to seed itself;
  churn  threads that start and exit short-lived threads, and multiprocessing queues whose feeder threads come
         and go.
Meanwhile it builds and reads N data loaders of 2 workers; a loader that delivers nothing within --timeout counts
as a hang (its workers are SIGKILLed). `--start fork` is plain DataLoader workers forked from this process (the old
code); `--start vim_ds` is `vim_ds.data.loader.build_loader` (fork server).

    python tools/fork_stress.py --start fork --loaders 20      # the bug: hangs
    python tools/fork_stress.py --start vim_ds --loaders 20    # the fix: none
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

STOP = threading.Event()
HELD = threading.Lock()
LOCAL = threading.local()


class Numbers(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.full((4,), float(index))


class _TakesTheLockWhenFreed:
    def __del__(self):
        with HELD:
            pass


def _holder():
    while not STOP.is_set():
        with HELD:
            time.sleep(0.002)
        time.sleep(0.0005)


def _parked():
    LOCAL.value = _TakesTheLockWhenFreed()
    STOP.wait()


def _rng():
    while not STOP.is_set():
        torch.randn(64)


def _churn():
    context = multiprocessing.get_context("fork")
    while not STOP.is_set():
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
        queue = context.Queue()
        queue.put(1)  # starts the queue's feeder thread
        queue.close()
        queue.join_thread()


THREADS = {"locks": (_holder, _parked, _parked), "rng": (_rng, _rng), "churn": (_churn, _churn)}


def _loader(start: str, timeout: float):
    if start == "fork":
        return DataLoader(Numbers(), batch_size=4, num_workers=2, timeout=timeout,
                          multiprocessing_context=multiprocessing.get_context("fork"))
    from vim_ds.data.loader import LoaderConfig, build_loader

    sampler = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    return build_loader(Numbers(), sampler, LoaderConfig(num_workers=2, data_timeout=timeout), "stress")


def run(start: str, loaders: int, timeout: float, threads: list[str]) -> int:
    for name in threads:
        for target in THREADS[name]:
            threading.Thread(target=target, daemon=True).start()
    hangs = 0
    t0 = time.monotonic()
    for i in range(loaders):
        loader = _loader(start, timeout)
        iterator = iter(loader)
        try:
            assert sum(len(batch) for batch in iterator) == 16
        except RuntimeError as exc:  # DataLoader's timeout, or vim_ds's DataStall (which kills the workers itself)
            hangs += 1
            print(f"loader {i}: {str(exc).splitlines()[0]}", flush=True)
            for worker in iterator._workers if start == "fork" else []:
                if worker.is_alive():
                    os.kill(worker.pid, signal.SIGKILL)
        del iterator, loader
    print(f"start={start} threads={','.join(threads)}: {hangs} hangs of {loaders} loaders in "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    return hangs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", choices=["fork", "vim_ds"], required=True)
    p.add_argument("--loaders", type=int, default=20)
    p.add_argument("--timeout", type=float, default=5, help="seconds a loader may take to deliver a batch")
    p.add_argument("--threads", default="locks,rng,churn", help="comma-separated: " + ", ".join(THREADS))
    args = p.parse_args(argv)
    hangs = run(args.start, args.loaders, args.timeout, args.threads.split(","))
    STOP.set()
    sys.stdout.flush()
    os._exit(0 if hangs == 0 else 1)  # daemon threads and killed workers: leave without multiprocessing's clean-up


if __name__ == "__main__":
    main()
