"""Running real training jobs from tests: real launchers (torchrun, deepspeed), real processes, real files."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import preloaded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "ds_configs")

# A Vim small enough for 2 CPU cores: 32x32 digits, 8x8 patches of 4 pixels.
TINY = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]
QUIET_AUG = ["--drop-path", "0", "--mixup", "0", "--cutmix", "0", "--reprob", "0"]


def config(name: str) -> str:
    return os.path.join(CONFIGS, f"{name}.json")


def train_command(args, nproc: int = 1, launcher: str = "torchrun", module: str = "vim_ds.train") -> list[str]:
    if nproc == 1 and launcher == "torchrun":
        cmd = [sys.executable, "-m", module]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               module]
    else:
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", str(_free_port()), "--module", module]
    return cmd + [str(a) for a in args]


def train_env(env=None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_train(args, nproc: int = 1, launcher: str = "torchrun", module: str = "vim_ds.train", timeout: int = 600,
              check: bool = True, env=None) -> subprocess.CompletedProcess:
    """Run a training job to its end. With torchrun (and one plain process), its ranks are forked from the suite's
    preloaded server (tests/preloaded.py: the same code and environment, without re-importing the libraries); the
    deepspeed launcher runs for real."""
    proc = preloaded.run(train_command(args, nproc, launcher, module), capture_output=True, text=True,
                         timeout=timeout, env=train_env(env), cwd=ROOT)
    if check and proc.returncode != 0:
        pytest.fail(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


_free_port = preloaded.free_port  # the name the launch, SLURM and resume tests import


def rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference between two step -> value maps with the same (non-empty) keys."""
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in a)


def records(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(output_dir) -> dict[int, float]:
    """step -> loss; a resumed run's later lines overwrite nothing (steps are unique)."""
    return {r["step"]: r["loss"] for r in records(output_dir) if "loss" in r and "summary" not in r}


def evals(output_dir) -> list[dict]:
    return [r for r in records(output_dir) if "eval_acc1" in r]


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The trainer's one-line error (rank 0's, or any rank's)."""
    lines = [line for line in proc.stderr.splitlines() if "error" in line and line.startswith("vim-ds")]
    return lines[0] if lines else ""


# -- one short run per shipped config, shared by test_ds_config.py and test_convert.py ------------------------------

# Every ds_configs/*.json that runs on a CPU (zero2_fp16 does not: fp16 is GPU-only), overridden to fp32 so runs
# of different stages agree to float rounding (bf16 is emulated on AVX2-only CPUs, ~4x slower).
CPU_CONFIGS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
CONFIG_STEPS = 3  # a checkpoint after every step, all kept: resume from step 1 compares steps 2 and 3


def config_run_args(digits, out, name: str, *extra) -> list:
    """2 ranks x micro batch 8, fp32, 3 steps at lr 2e-3 as it is (--unscale-lr; 3 Adam steps move the weights by
    ~6e-3, the logits by ~1e-1), EMA 0.8, a complete checkpoint after every step."""
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config(name), "--precision", "fp32",
            "--batch-size", 8, "--max-steps", CONFIG_STEPS, "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0",
            "--model-ema-decay", "0.8", "--save-interval", 1, "--keep-checkpoints", 0, *extra]


def assert_same_state(resumed_tag_dir, straight_tag_dir, tolerance: dict | None = None) -> dict:
    """The training state of two checkpoints (`vim_ds.checkpoint.training_state`) is the same: step counts, group
    hyperparameters, scheduler and position exactly, and each kind of tensor (weights, exp_avg, exp_avg_sq, ema)
    within `tolerance[kind]` (||a - b|| / ||b||; default 0: the same bits). Returns the worst difference per kind."""
    from vim_ds.checkpoint.training_state import differences, read_training_state

    tolerance = tolerance or dict.fromkeys(("weights", "exp_avg", "exp_avg_sq", "ema"), 0.0)
    diff = differences(read_training_state(str(resumed_tag_dir)), read_training_state(str(straight_tag_dir)))
    for key in ("steps", "groups", "scheduler", "position"):
        assert not diff[key], (key, diff[key])
    worst = {key: diff[key][0] for key in tolerance}
    for key, limit in tolerance.items():
        assert diff[key][0] <= limit, (key, diff[key], worst)
    return worst


def rerecord_checksums(tag_dir) -> None:
    """Record a tag directory's files as they are now in its completion marker, as the writer of a checkpoint
    would: for tests whose fault is in what a file holds (an unsafe pickle) or in which files exist (no EMA),
    not in damage after the save, which the checksums would report first."""
    from vim_ds.checkpoint.deepspeed_dir import MARKER, file_checksums

    path = os.path.join(tag_dir, MARKER)
    if os.path.isfile(path):
        with open(path) as f:
            marker = json.load(f)
        marker["files"] = file_checksums(str(tag_dir))
        with open(path, "w") as f:
            json.dump(marker, f)


def folder_bytes(folder) -> dict[str, bytes]:
    """Every file under `folder` (its path relative to `folder`) with its bytes: what a test compares before and
    after a command that must leave a folder as it found it."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


def digits80(digits: str, root) -> str:
    """8 training and 3 validation images of each digit, from the suite's digits folder: 80 images (5 steps of a
    global batch of 16 an epoch) and a 30-image evaluation."""
    for split, count in (("train", 8), ("val", 3)):
        for cls in sorted(os.listdir(os.path.join(digits, split))):
            os.makedirs(os.path.join(root, split, cls))
            for name in sorted(os.listdir(os.path.join(digits, split, cls)))[:count]:
                shutil.copy(os.path.join(digits, split, cls, name), os.path.join(root, split, cls, name))
    return str(root)
