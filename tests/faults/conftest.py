"""Shared pieces of the fault-injection suite: one small, fully specified 2-rank fp32 run, the uninterrupted
reference it is compared with, and helpers to watch and kill real training processes."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from train_utils import ROOT, TINY, config, records, run_train, train_command, train_env

STEPS = 12  # the reference run; checkpoints every 4 steps


def fault_args(digits, out, *extra) -> list[str]:
    """The full recipe in fp32 on a tiny Vim (so resumed losses must match the reference to float rounding)."""
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "1",
            "--seed", "5", *TINY, "--deepspeed_config", config("zero2"), "--precision", "fp32", "--batch-size", "8",
            "--epochs", "2", "--warmup-epochs", "0.1", "--lr", "2e-3", "--model-ema-decay", "0.9",
            "--save-interval", "4", "--log-interval", "1", *extra]


@pytest.fixture(scope="session")
def reference(digits, shared) -> str:
    """The uninterrupted run: 12 steps on 2 ranks (made once per test run). Started like the resumed runs it is
    compared with, by torchrun with ranks forked from the preloaded server: what is compared is training state,
    which does not depend on the launcher; the runs that a fault interrupts use the real deepspeed launcher."""
    return shared("faults_reference", lambda out: run_train(fault_args(digits, out, "--max-steps", STEPS), nproc=2))


def start_train(args, nproc: int = 2, launcher: str = "deepspeed", env=None) -> subprocess.Popen:
    """Start a run in its own process group (so a test can signal the whole job, as SLURM and a terminal do)."""
    return subprocess.Popen(train_command(args, nproc, launcher), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=train_env(env), cwd=ROOT, start_new_session=True)


def complete_tags(out) -> list[str]:
    """The complete checkpoints of the run in `out`, oldest first."""
    from vim_ds.checkpoint.deepspeed_dir import complete_tags as tags

    return tags(os.path.join(out, "checkpoints"))


def steps_logged(out) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    try:
        return max((r["step"] for r in records(out) if "loss" in r), default=0)
    except ValueError:  # a line being written
        return 0


def wait_for_step(proc: subprocess.Popen, out, step: int, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while steps_logged(out) < step:
        if proc.poll() is not None:
            stdout, stderr = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before step {step}:\n{stdout[-2000:]}\n{stderr[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"step {step} not reached in {timeout} s")
        time.sleep(0.2)


def rank_pid(launcher: subprocess.Popen, local_rank: int) -> int:
    """The pid of one rank started by the deepspeed launcher (it passes --local_rank=N to each)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if f"--local_rank={local_rank}" in child.cmdline() and "vim_ds.train" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank {local_rank} under launcher {launcher.pid}")


def finish(proc: subprocess.Popen, timeout: float) -> tuple[float, str, str]:
    """Wait for `proc` at most `timeout` s; returns (seconds waited, stdout, stderr); kills it and fails if it hangs."""
    t0 = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        still = "still running" if proc.poll() is None else f"exited ({proc.returncode}) but its output is still open"
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        # the whole session (start_train starts one): also a process orphaned by a killed rank, e.g. a data-loader
        # worker and its forkserver, which would keep the pipes open and this communicate() waiting for good
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"{still} {timeout} s later (hung):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return time.monotonic() - t0, stdout, stderr
