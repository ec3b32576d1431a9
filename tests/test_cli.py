"""The console entry points, run as a user runs them: the dispatcher and the demo in a fresh process, the others
forked from the suite's preloaded server (tests/preloaded.py: the same `python -m` entry, without re-importing the
libraries; tests/test_imports.py starts every subcommand's --help fresh)."""
import json
import subprocess
import sys

import preloaded


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def forked(*args, timeout=300):
    return preloaded.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_env_reports_versions_and_backends():
    """Through the dispatcher (`vim-ds env --json`), in a fresh process."""
    out = run("-m", "vim_ds.cli", "env", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    import deepspeed
    import timm
    import torch

    assert info["torch"] == torch.__version__ and info["deepspeed"] == deepspeed.__version__
    assert info["timm"] == timm.__version__
    assert info["scan_backends"]["ref"]["available"]
    assert info["scan_backends"]["cpu"]["available"], info["scan_backends"]["cpu"]["reason"]
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert list(info["scan_backend_in_use"].values()) == [expected]
    import triton  # (torch's wheel for Linux brings it)

    assert info["add_rms_norm"] == f"one triton {triton.__version__} kernel each way on GPUs (PyTorch's on CPU)"


def test_console_script_dispatches_and_rejects_unknown_commands():
    out = forked("-m", "vim_ds.cli", "env")
    assert out.returncode == 0 and "selective-scan backends:" in out.stdout
    assert "in use on cpu: cpu" in out.stdout or "in use on cuda" in out.stdout
    bad = forked("-m", "vim_ds.cli", "frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_demo_runs_a_published_model():
    out = run("-m", "vim_ds.demo", "--model", "vim_tiny", "--batch-size", "1", "--input-size", "64")
    assert out.returncode == 0, out.stderr
    assert "kernel vs float64 reference: max relative error" in out.stdout
    assert "7.1M parameters, 24 blocks, class token at position 8" in out.stdout


def test_bench_scan_prints_kernel_and_reference_side_by_side(tmp_path):
    out = forked("-m", "vim_ds.bench", "scan", "--batch", "1", "--dim", "8", "--seqlen", "33", "--repeat", "1",
              "--json", str(tmp_path / "scan.json"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "scan.json").read_text())
    cpu = [r for r in rows if r["device"] == "cpu" and "op" not in r]  # the scan's rows (the conv's: below)
    assert cpu and cpu[0]["kernel_fwd_ms"] > 0 and cpu[0]["ref_fwd_bwd_ms"] > 0
    assert "speedup fwd" in out.stdout
    # One row per instruction-set variant of the CPU kernel, the default (widest) first.
    from vim_ds.ops.backends import load

    isas = load("cpu").backend.module.available_isas()
    assert [r["isa"] for r in cpu] == isas[::-1]
    assert f"[cpu {isas[-1]}] B=1 D=8 L=33 N=16 float32: kernel fwd" in out.stdout
    # and the causal conv's, per variant and dtype, beside PyTorch's F.conv1d
    conv = [r for r in rows if r.get("op") == "causal_conv1d"]
    assert [(r["dtype"], r["isa"]) for r in conv] == [(d, i) for d in ("float32", "bfloat16") for i in isas[::-1]]
    assert all(r["kernel_fwd_bwd_ms"] > 0 and r["ref_fwd_bwd_ms"] > 0 for r in conv)
    assert f"[cpu {isas[-1]}] conv B=1 D=8 L=33 K=4 bfloat16: kernel fwd" in out.stdout and "F.conv1d fwd" in out.stdout
