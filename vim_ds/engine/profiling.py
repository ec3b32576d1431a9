"""`vim-ds train --profile-steps FIRST:LAST`: torch.profiler over optimizer steps FIRST to LAST of the real trainer
(issue 51: where a training step's time goes).

Rank 0 writes to OUTPUT_DIR/profile/:
- ``trace.json.gz``: the Chrome trace (chrome://tracing or https://ui.perfetto.dev open it as it is);
- ``summary.json``: the top kernels by device time (by CPU time on a CPU), the operators whose cost can be put
  beside a roofline (matrix products with their FLOPs, the scan's and the branch's ops with their shapes), every
  operator's own time (``op_times``: the kernels it launched itself) and the device's total, and the run's model and
  batch, as `vim-ds bench profile` reads them (and puts each beside its roofline, and each kind of operator beside
  `vim-ds bench anatomy`'s step on paper);
- ``top_kernels.md``: the top kernels as a markdown table.

The profiler starts when the optimizer step FIRST - 1 is done (at the start of training for FIRST = 1) and stops when
step LAST is, so whole steps are measured, their micro steps, optimizer step and the loop's own work included. A
run that resumes past FIRST profiles nothing and says so.
"""
from __future__ import annotations

import json
import os
import time

import torch

FOLDER = "profile"
TRACE, SUMMARY, TABLE = "trace.json.gz", "summary.json", "top_kernels.md"
TOP = 30
# Operators put beside a roofline: matrix products (the profiler counts their FLOPs) and the model's own ops.
ROOFLINE_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                "aten::convolution", "vim_ds::")
# Profiler keys that are operators (the rest: kernels, copies, the profiler's own ranges).
OPERATOR_NAMESPACES = ("aten::", "vim_ds::")


def _device_time(event) -> float:
    """Self time on the device in microseconds (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _total_device_time(event) -> float:
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _is_operator(key: str) -> bool:
    return key.startswith(OPERATOR_NAMESPACES)


def _on_device(event) -> bool:
    """A kernel or a copy, which runs on the device (not an operator or a range of the host, whose device time is
    that of the kernels it launched)."""
    kind = getattr(event, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU


def summarize(prof, steps: int, wall_s: float, on_gpu: bool, device_name: str, first_last) -> dict:
    """What summary.json holds, from a stopped profiler."""
    events = prof.key_averages()
    if on_gpu:
        timed = [(e.key, e.count, _device_time(e)) for e in events if _device_time(e) > 0]
    else:
        timed = [(e.key, e.count, float(e.self_cpu_time_total)) for e in events if e.self_cpu_time_total > 0]
    # Each operator's own time (on a GPU the kernels it launched itself, so that the operators' times add up without
    # counting a kernel twice), and on a GPU the device's whole time (the kernels and copies themselves): what is
    # not any operator's is the optimizer's fused kernels, communication and the like.
    op_times = [{"name": key, "calls": calls, "ms_per_step": us / 1e3 / steps}
                for key, calls, us in timed if _is_operator(key)]
    device_ms = sum(_device_time(e) for e in events if _on_device(e)) / 1e3 / steps if on_gpu else None
    timed.sort(key=lambda t: -t[2])
    total_us = sum(t[2] for t in timed)
    kernels = [{"name": name, "calls": calls, "ms": us / 1e3, "ms_per_step": us / 1e3 / steps,
                "share": us / total_us if total_us else 0.0} for name, calls, us in timed[:TOP]]
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith(ROOFLINE_OPS):
            continue
        us = _total_device_time(e) if on_gpu else float(e.cpu_time_total)
        ops.append({"name": e.key, "shapes": [list(s) for s in (e.input_shapes or [])], "calls": e.count,
                    "ms": us / 1e3, "ms_per_step": us / 1e3 / steps, "flops": int(getattr(e, "flops", 0) or 0)})
    ops.sort(key=lambda o: -o["ms"])
    return {"device": "cuda" if on_gpu else "cpu", "device_name": device_name, "steps": list(first_last),
            "profiled_steps": steps, "wall_ms_per_step": wall_s * 1e3 / steps,
            "time": "device (self)" if on_gpu else "CPU (self)", "timed_ms": total_us / 1e3,
            "kernels": kernels, "ops": ops, "op_times": op_times, "device_ms_per_step": device_ms}


def table(summary: dict) -> str:
    """The top kernels as markdown."""
    lines = [f"Top kernels by {summary['time']} time over optimizer steps {summary['steps'][0]}-{summary['steps'][1]} "
             f"on {summary['device_name']} ({summary['wall_ms_per_step']:.1f} ms a step, wall):", "",
             "| kernel | calls | ms per step | share |", "|---|---|---|---|"]
    for k in summary["kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name}` | {k['calls']} | {k['ms_per_step']:.3f} | {100 * k['share']:.1f} % |")
    return "\n".join(lines) + "\n"


class StepProfiler:
    """Profiles optimizer steps first..last when `after_step` is called with each finished step's number (and once
    with the step the run starts from)."""

    def __init__(self, steps, folder: str, device: torch.device, enabled: bool, precision: str = "",
                 run: dict | None = None):
        self.first, self.last = steps if steps else (0, -1)
        self.folder, self.device, self.precision = folder, device, precision
        self.run = run or {}  # the model and the batch (bench profile's step on paper)
        self.enabled = enabled and steps is not None
        self._prof = None
        self._started = 0.0
        self.done = False

    @classmethod
    def idle(cls) -> "StepProfiler":
        """One that profiles nothing."""
        return cls(None, "", torch.device("cpu"), False)

    def after_step(self, step: int) -> None:
        if not self.enabled or self.done:
            return
        if self._prof is None and step == self.first - 1:
            self._start()
        elif self._prof is None and step >= self.first:
            print(f"--profile-steps {self.first}:{self.last}: the run starts at step {step}, past them; nothing "
                  f"profiled", flush=True)
            self.done = True
        elif self._prof is not None and step >= self.last:
            self._stop(step - self.first + 1)

    def close(self) -> None:
        """The run ended: a profile still running is cut at the steps it holds."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
            print(f"--profile-steps {self.first}:{self.last}: the run ended before step {self.last}; no profile "
                  f"written", flush=True)

    def _start(self) -> None:
        # the profiler's own library (Kineto) logs an ERROR line on a machine with CUDA's libraries but no GPU;
        # level 5 keeps it quiet (a level the user set stays)
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
        self._prof.start()
        self._started = time.perf_counter()

    def _stop(self, steps: int) -> None:
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._started
        self._prof.stop()
        os.makedirs(self.folder, exist_ok=True)
        self._prof.export_chrome_trace(os.path.join(self.folder, TRACE))
        name = torch.cuda.get_device_name(self.device) if on_gpu else "CPU"
        summary = {**summarize(self._prof, steps, wall, on_gpu, name, (self.first, self.last)),
                   "precision": self.precision, "run": self.run}
        with open(os.path.join(self.folder, SUMMARY), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(self.folder, TABLE), "w") as f:
            f.write(table(summary))
        self._prof, self.done = None, True
        print(f"profile of steps {self.first}-{self.last}: {self.folder}/ ({TRACE}, {SUMMARY}, {TABLE})", flush=True)
