"""`vim-ds bench train`: real launches of the trainer (torchrun, 2 CPU ranks) with a tiny Vim, read back as JSON. The
command's torchrun jobs are forked from the suite's preloaded server (`preloaded.nested_env`); `launched_runs`'s
real torchrun keeps its test (tests/test_zero_compare_baselines.py's lr control).

A config that cannot be run is a row with a one-line "error" (the other configs still run) and makes the exit
status 1; a successful benchmark exits 0.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

import preloaded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4", "stride=4", "--input-size", "32",
        "--batch-size", "4", "--steps", "6", "--warmup-steps", "2", "--nproc", "2"]


def bench_train(tmp_path, *args, timeout=240):
    out = tmp_path / "out.json"
    proc = preloaded.run([sys.executable, "-m", "vim_ds.bench", "train", *TINY, *args, "--json", str(out)],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env=preloaded.nested_env({**os.environ, "PYTHONUNBUFFERED": "1"}))
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


@pytest.mark.slow
def test_bench_train_zero0_zero3_and_a_bogus_config(tmp_path):
    proc, result = bench_train(tmp_path, "--configs", "zero0", "zero3", "no_such_config")
    assert result is not None, proc.stdout + proc.stderr
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["zero0", "zero3", "no_such_config"], proc.stdout + proc.stderr

    ok = [rows["zero0"], rows["zero3"]]
    for row in ok:
        assert "error" not in row, row.get("error")
        assert row["ranks"] == 2 and row["global_batch"] == 8 and row["steps_timed"] == 6
        assert row["images_per_sec"] > 0 and row["median_samples_per_sec"] > 0
        peaks = row["peak_memory_mb_per_rank"]
        assert len(peaks) == 2 and all(p > 0 for p in peaks)
        assert 0 <= row["loop_overhead"] < 1
        assert math.isfinite(row["final_loss"])
    assert [r["stage"] for r in ok] == [0, 3]
    assert all(r["precision"] == "bf16" for r in ok)

    # unknown name: a row with a one-line error (naming the configs there are), no launch
    error = rows["no_such_config"]["error"]
    assert "no_such_config" in error and "zero2_offload" in error and "\n" not in error

    assert proc.returncode == 1  # some config failed
    out = proc.stdout
    assert "images/s" in out and "peak MiB/rank" in out
    assert "loop overhead (data, logging, EMA) < 10% of step time: " in out
    assert result["loop_overhead_max"] == max(r["loop_overhead"] for r in ok)


def test_bench_train_refuses_fp16_on_cpu(capsys):
    import torch

    from vim_ds.cli import bench

    if torch.cuda.is_available():
        pytest.skip("fp16 runs on a GPU")
    assert bench.main(["train", "--configs", "zero0", "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vim-ds bench train: error: fp16 is GPU only") and len(err.strip().splitlines()) == 1


def test_a_malformed_model_kwarg_is_a_usage_error_of_bench_train(capsys):
    """Refused by the parser, before any launch."""
    from vim_ds.cli import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["train", "--configs", "zero0", "--model-kwargs", "depth=2", "embed_dim"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "vim-ds bench train: error: argument --model-kwargs: expected KEY=VALUE, got 'embed_dim'"


@pytest.mark.parametrize("option, value", [("--steps", "0"), ("--warmup-steps", "-1"), ("--nproc", "0"),
                                           ("--batch-size", "0"), ("--num-workers", "-1")])
def test_out_of_range_counts_are_usage_errors(option, value, capsys):
    from vim_ds.cli import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["train", "--configs", "zero0", option, value])
    assert exit_info.value.code == 2
    least = 0 if option in ("--warmup-steps", "--num-workers") else 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"vim-ds bench: error: {option} must be at least {least}, got {value}"

# -- the pieces, without launching anything -----------------------------------------------------------------------

def test_error_line_prefers_the_trainers_rank0_line():
    from vim_ds.cli.bench import error_line

    stderr = """[WARNING] Setting accelerator to CPU.
vim-ds train: error (rank 1): ds.json: unknown top-level key 'gradient_cliping'
vim-ds train: error (rank 0): ds.json: unknown top-level key 'gradient_cliping'
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""
    assert error_line(stderr, 1) == "vim-ds train: error (rank 0): ds.json: unknown top-level key 'gradient_cliping'"
    crash = "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n====\n"
    assert error_line(crash, 1) == "RuntimeError: boom"
    assert "status -9" in error_line("", -9)


def test_summarise_metrics_skips_warmup(tmp_path):
    from vim_ds.cli.bench import summarise_metrics

    lines = [{"step": s, "epoch": 0, "loss": 7.0 - s / 10, "lr": 1e-6, "grad_norm": 1.0,
              "samples_per_sec": 8 / t, "step_time": t, "bad_images": 0}
             for s, t in ((1, 5.0), (2, 1.0), (3, 2.0), (4, 1.0))]
    lines.append({"step": 4, "epoch": 0, "eval_acc1": 10.0, "eval_acc5": 50.0, "eval_loss": 6.0, "eval_images": 3})
    lines.append({"summary": True, "step": 4, "steps_timed": 4, "world_size": 2, "zero_stage": 2,
                  "precision": "bf16", "global_batch": 8, "data_time": 0.5, "compute_time": 8.0, "other_time": 0.1,
                  "loop_overhead": 0.6 / 8.6, "peak_memory_mb_per_rank": [100.0, 120.0], "device": "cpu"})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summarise_metrics(str(path), warmup=1)
    assert s["steps_timed"] == 3 and s["images_per_sec"] == pytest.approx(8 * 3 / 4.0)
    assert s["median_samples_per_sec"] == pytest.approx(8.0)
    assert s["peak_memory_mb_max"] == 120.0 and s["stage"] == 2 and s["ranks"] == 2
    assert s["final_loss"] == pytest.approx(6.6) and s["eval_acc1"] == 10.0
    with pytest.raises(ValueError, match="none after the 4 warmup steps"):
        summarise_metrics(str(path), warmup=4)


def test_gpu_rows_are_compared_with_the_published_mi210_rate():
    from vim_ds.cli.bench import MI210_FP32_FINETUNE_IMAGES_PER_SEC_PER_GPU as REF, reference_lines

    row = {"config": "zero0", "device": "cuda", "precision": "bf16", "images_per_sec_per_rank": 4.5 * REF}
    lines = reference_lines([row], "vim_small_s8")
    assert len(lines) == 1 and "4.5x" in lines[0] and "met" in lines[0] and "not met" not in lines[0]
    assert row["vs_mi210_fp32_finetune"] == pytest.approx(4.5)
    assert reference_lines([{**row, "device": "cpu"}], "vim_small_s8") == []  # CPU: only the CPU numbers
    assert reference_lines([row], "vim_tiny") == []
