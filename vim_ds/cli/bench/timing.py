"""Wall-clock timing shared by the scan and model benchmarks."""
from __future__ import annotations

import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, warmup=1, repeat=3, min_time=0.0):
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start_all = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start_all < min_time:
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if len(times) >= 100:
            break
    times.sort()
    return times[len(times) // 2]
