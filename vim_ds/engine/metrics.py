"""What rank 0 reports: one JSON line per optimizer step and per evaluation in OUTPUT_DIR/metrics.jsonl, a progress
bar with ETA on a terminal (plain log lines otherwise), and TensorBoard scalars when asked."""
from __future__ import annotations

import json
import math
import os
import sys
import time

from tqdm import tqdm

from ..runtime import write_journal  # a run that ends in an error before its first step takes these back


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _clean(value):
    """JSON has no NaN/inf: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    def __init__(self, output_dir: str | None, enabled: bool, total_steps: int, start_step: int = 0,
                 log_interval: int = 10, tensorboard: bool = False):
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_interval = max(1, log_interval)
        self.file = None
        self.writer = None
        self.bar = None
        self._t0, self._s0 = time.time(), start_step
        if not enabled:
            return

        if output_dir:
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, "metrics.jsonl")
            write_journal.appending(path)
            self.file = open(path, "a", buffering=1)
        if tensorboard:
            try:  # here, not at the top: an optional package (the tensorboard extra), only for --tensorboard
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
            folder = os.path.join(output_dir or ".", "tensorboard")
            write_journal.filling(folder)
            self.writer = SummaryWriter(folder)
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def _write(self, record: dict):
        if self.file:
            self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def step(self, record: dict):
        if not self.enabled:
            return
        self._write(record)
        step = record["step"]
        if self.writer:
            for key in ("loss", "lr", "grad_norm", "samples_per_sec"):
                if isinstance(record.get(key), (int, float)):
                    self.writer.add_scalar(f"train/{key}", record[key], step)
        summary = f"loss {record['loss']:.4f} lr {record['lr']:.3e}"
        if self.bar:
            self.bar.set_postfix_str(f"epoch {record['epoch']} {summary}", refresh=False)
            self.bar.update(step - self.bar.n)
        elif step % self.log_interval == 0 or step == self.total_steps:
            rate = (step - self._s0) / max(time.time() - self._t0, 1e-9)
            eta = _fmt_duration((self.total_steps - step) / rate) if rate > 0 else "?"
            grad = record.get("grad_norm")
            grad = f" grad_norm {grad:.3f}" if isinstance(grad, float) else ""
            print(f"epoch {record['epoch']} step {step}/{self.total_steps} {summary}{grad} "
                  f"{record['samples_per_sec']:.1f} img/s eta {eta}", flush=True)

    def evaluation(self, record: dict):
        if not self.enabled:
            return
        self._write(record)
        if self.writer:
            for key, value in record.items():
                if key.startswith(("eval_", "ema_eval_")):
                    self.writer.add_scalar(f"eval/{key}", value, record["step"])
        parts = [f"acc1 {record['eval_acc1']:.2f} acc5 {record['eval_acc5']:.2f} loss {record['eval_loss']:.4f}"]
        if "ema_eval_acc1" in record:
            parts.append(f"EMA acc1 {record['ema_eval_acc1']:.2f}")
        where = f"epoch {record['epoch']} step {record['step']}" if record.get("step") is not None else \
            record.get("source", "")
        message = f"eval {where}: " + ", ".join(parts) + f" ({record['eval_images']} images)"
        if self.bar:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, flush=True)

    def header(self, record: dict):
        """The run's settings and versions, first (see `run_info.py`)."""
        if self.enabled:
            self._write(record)

    def summary(self, record: dict):
        if self.enabled:
            self._write(record)

    def close(self):
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()
