"""`bash tools/gpu_check.sh` end to end on this CPU machine (every GPU step says "no GPU", the report says so, exit
0), and its report generator fed the files of a GPU run (measured / bound, mamba_ssm side by side)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vim_ds.bench import gpu_report, scan, scan_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real thing (minutes)")
def test_gpu_check_on_a_cpu_reports_no_gpu_and_the_predictions(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STEPS", None)  # every step
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    report = (out / "report.md").read_text()
    assert "**Device:** no GPU on this machine" in report
    for step in ("build", "tests", "model", "train", "split"):
        assert f"| {step} | skipped (no GPU) |" in report
    assert "| scan | no GPU: predictions only, measured n/a |" in report
    assert "no GPU: measured n/a" in report and "no GPU: the GPU tests" in report
    assert "| mamba_ssm | not installed |" in report and f"| torch | {torch.__version__} |" in report
    # The predictions are the model's numbers.
    b = scan_model.predict(8, 384, 6085, 16, "bfloat16")["bounds"]["MI300X"]
    assert f"{b['fwd_ms']:.3f} ({b['fwd_bound_by']}) / {b['fwd_bwd_ms']:.3f}" in report
    assert json.loads((out / "bench_scan.json").read_text())["predictions"] == json.loads(
        json.dumps(scan_model.predictions()))


def test_steps_limits_what_runs(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, STEPS="scan",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if torch.cuda.is_available():
        pytest.skip("on a GPU the scan step times the kernels (minutes)")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == ["scan"]


def _gpu_run(tmp_path, with_mamba):
    """The files a GPU run of gpu_check.sh leaves, with measured rows made up (no GPU here to measure them)."""
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.00\ntorch 2.11.0+cu130 13.0\n")
    (tmp_path / "steps.tsv").write_text("build\tok\t95\tbuild.log\ntests\tok\t40\tgpu_tests.log\n"
                                        "scan\tok\t120\tbench_scan.log\nmodel\tfailed (exit 1)\t30\tbench_model.log\n")
    (tmp_path / "gpu_tests.log").write_text("....\n31 passed, 2 skipped in 40.1s\n")
    gpu = scan_model.gpu_for_device("NVIDIA H100 80GB HBM3")
    rows = []
    for (shape, _), ms in zip(scan_model.BENCH_SHAPES, (0.5, 2.0, 0.3, 1.5)):
        row = dict(device="cuda", gpu="NVIDIA H100 80GB HBM3", shape=scan_model.shape_text(*shape),
                   shape_tuple=list(shape), dtype="bfloat16", kernel_fwd_ms=ms, kernel_fwd_bwd_ms=4 * ms)
        if with_mamba:
            row.update(mamba_fwd_ms=ms / 2, mamba_fwd_bwd_ms=ms)
        rows.append(scan.annotate(row, gpu))
    (tmp_path / "bench_scan.json").write_text(json.dumps(
        {"device": "NVIDIA H100 80GB HBM3", "modelled_gpu": gpu.name, "rows": rows,
         "predictions": scan_model.predictions(), "gpus": scan_model.gpus_used()}))
    (tmp_path / "bench_split.json").write_text(json.dumps(
        {"settings": {"share_gpu": True}, "rows": [
            {"ranks": 1, "threads": None, "peak_bytes": 123456789, "forward_s": 0.01, "backward_s": 0.02},
            {"ranks": 2, "threads": None, "peak_bytes": 61728394, "forward_s": 0.02, "backward_s": 0.03}]}))
    return rows


@pytest.mark.parametrize("with_mamba", [True, False])
def test_report_of_a_gpu_run_has_every_number_and_the_ratio(tmp_path, with_mamba):
    rows = _gpu_run(tmp_path, with_mamba)
    assert gpu_report.main([str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "**Device:** NVIDIA H100 80GB HBM3" in report and "31 passed, 2 skipped" in report
    assert "| model | failed (exit 1) |" in report and "no GPU" not in report
    for r in rows:
        bound = scan_model.predict(*r["shape_tuple"], "bfloat16")["bounds"]["H100 SXM"]
        ratio = f"{r['kernel_fwd_ms'] / bound['fwd_ms']:.1f}x, {r['kernel_fwd_bwd_ms'] / bound['fwd_bwd_ms']:.1f}x"
        line = next(line for line in report.splitlines() if line.startswith(f"| {r['shape']} | bfloat16 | "
                                                                           f"{r['kernel_fwd_ms']:.3f}"))
        assert ratio in line and f"{bound['fwd_ms']:.3f}" in line
        if with_mamba:
            assert f"{r['mamba_fwd_bwd_ms'] / bound['fwd_bwd_ms']:.1f}x" in line
    assert ("mamba_ssm: not installed, so not timed." in report) != with_mamba
    # the sequence split's rows (bench split --share-gpu)
    assert "## The sequence split's memory per rank" in report and "| 2 | — | 61728394 |" in report


def test_report_generator_rejects_a_missing_folder(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path / "nope")]) == 2
    assert "usage" in capsys.readouterr().err
