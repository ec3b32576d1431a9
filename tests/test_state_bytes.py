"""`vim_ds.engine.memory.state_bytes` on one rank, where every ZeRO stage holds whole tensors and the expected
bytes follow from the parameter count Ψ alone: parameters and gradients in the training dtype, Adam's two fp32
moments (8Ψ), and DeepSpeed's fp32 master copy (4Ψ) wherever it keeps one (bf16, and ZeRO 1-3 even in fp32).
The 2-rank partitioned sizes are checked against the ZeRO paper in tests/test_zero_compare.py."""
from __future__ import annotations

import json
import os
import sys

import pytest

import preloaded
from train_utils import ROOT, TINY, config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_on_one_rank(stage, precision):
    args = ["--deepspeed_config", config(f"zero{stage}"), "--precision", precision, "--data-set", "synthetic",
            "--synthetic-size", "32", "--nb-classes", "10", *TINY, "--batch-size", "4", "--num_workers", "0",
            "--no-model-ema"]
    proc = preloaded.run([sys.executable, os.path.join(ROOT, "tests", "engine_state_bytes.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    psi, live, after = result["params"], result["live"], result["after_step"]
    width = 2 if precision == "bf16" else 4
    master = 4 * psi if precision == "bf16" or stage > 0 else 0

    for held in (live, after):
        assert held["param_bytes"] == width * psi
        assert held["grad_bytes"] == width * psi
        assert held["master_bytes"] == master
    # after backward the gradients are read from the live buffers; after step() (when the trainer asks) from the
    # engine's layout for ZeRO 0-2, and the two agree
    assert live["grad_source"] == "live"
    assert after["grad_source"] == ("live" if stage == 3 else "layout")
    # Adam creates its moments at the first step (DeepSpeed's bf16 wrapper without ZeRO: at initialisation);
    # besides them it keeps a 4-byte step counter per tensor (per parameter without ZeRO, per flat group with it):
    # at most 4 bytes for each of the model's ~40 tensors
    assert live["optim_bytes"] == (after["optim_bytes"] if (stage, precision) == (0, "bf16") else master)
    assert 0 <= after["optim_bytes"] - (master + 8 * psi) <= 4 * 64
