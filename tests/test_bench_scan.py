"""`vim-ds bench scan --predict`: the performance model's predictions beside the measurements (measured / bound on a
modelled GPU, "no GPU: measured n/a" here), in the JSON too; mamba_ssm side by side, and asking for it when it is
absent is one line and exit 2."""
from __future__ import annotations

import json
import sys

import pytest

from vim_ds.cli import bench
from vim_ds.cli.bench import scan, scan_model
from vim_ds.ops import backends

TINY = ["--batch", "1", "--dim", "8", "--seqlen", "8", "--repeat", "1", "--skip-ref"]


def test_predict_on_a_cpu_prints_the_bounds_and_says_no_gpu(tmp_path, capsys):
    out = tmp_path / "scan.json"
    # the emulator's counts beside the model: tests/test_kernel_counts.py
    assert bench.main(["scan", "--predict", "--no-counts", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU: measured n/a" in text and "Traceback" not in text
    assert "[cpu" in text  # the CPU rows are still measured
    expected = scan_model.predictions()
    b = expected[1]["bounds"]["H100 SXM"]  # B=64 L=197 bf16
    assert "| B=64 D=768 L=197 N=16 | bfloat16 |" in text and f"{b['fwd_ms']:.3f} ({b['fwd_bound_by']})" in text
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["modelled_gpu"] is None
    assert data["predictions"] == json.loads(json.dumps(expected))
    assert {g["name"] for g in data["gpus"]} == {g.name for g in scan_model.GPUS}
    assert data["rows"] and all(r["device"] == "cpu" and "bound_fwd_ms" not in r for r in data["rows"])


def test_predict_only_times_nothing(capsys):
    assert bench.main(["scan", "--predict-only", "--no-counts"]) == 0
    text = capsys.readouterr().out
    assert "[cpu" not in text and "no GPU: measured n/a" in text


def test_without_predict_the_json_stays_a_list_of_rows(tmp_path):
    out = tmp_path / "scan.json"
    assert bench.main(["scan", *TINY, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and rows[0]["shape"] == "B=1 D=8 L=8 N=16"


def test_a_gpu_row_gets_the_bound_and_the_ratio():
    """The GPU path of the printout, fed a measured row (no GPU here to measure one)."""
    row = dict(device="cuda", gpu="NVIDIA H100 80GB HBM3", shape="B=64 D=768 L=197 N=16",
               shape_tuple=[64, 768, 197, 16], dtype="bfloat16", kernel_fwd_ms=0.5, kernel_fwd_bwd_ms=2.0,
               mamba_fwd_ms=0.25, mamba_fwd_bwd_ms=1.0)
    scan.annotate(row, scan_model.gpu_for_device(row["gpu"]))
    bound = scan_model.predict(64, 768, 197, 16, "bfloat16")["bounds"]["H100 SXM"]
    assert row["bound_fwd_ms"] == bound["fwd_ms"] and row["ratio_fwd"] == pytest.approx(0.5 / bound["fwd_ms"])
    assert row["ratio_fwd_bwd"] == pytest.approx(2.0 / bound["fwd_bwd_ms"])
    assert row["mamba_ratio_fwd_bwd"] == pytest.approx(1.0 / bound["fwd_bwd_ms"])
    text = scan._scan_row(row)
    assert f"measured/bound fwd {0.5 / bound['fwd_ms']:.1f}x" in text and "ours / mamba_ssm 2.00x" in text
    # Negative control: a GPU the model does not know gets no ratio, and says so.
    other = dict(row, gpu="NVIDIA H100 PCIe")
    for k in list(other):
        if k.startswith(("bound", "ratio", "mamba_ratio")):
            del other[k]
    scan.annotate(other, scan_model.gpu_for_device(other["gpu"]))
    assert "ratio_fwd" not in other and "bound: n/a (NVIDIA H100 PCIe is not a modelled GPU)" in scan._scan_row(other)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_asking_for_absent_mamba_ssm_is_one_line_and_exit_2(how, monkeypatch, capsys):
    backends._registry.loaded.pop("mamba", None)
    monkeypatch.setitem(sys.modules, backends.MAMBA_MODULE, None)
    argv = ["scan", *TINY] + (["--mamba"] if how == "flag" else [])
    if how == "env":
        monkeypatch.setenv("VIM_DS_SCAN", "mamba")
    try:
        assert bench.main(argv) == 2
    finally:
        backends._registry.loaded.pop("mamba", None)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vim-ds bench scan: error: --mamba: mamba_ssm is not installed")
    assert "[cpu" not in captured.out  # nothing was timed
