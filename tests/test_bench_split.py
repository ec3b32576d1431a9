"""`vim-ds bench split` (issue 38's memory and time per N): a real run of the command on a tiny Vim, 1 and 2 ranks
(spawned processes, gloo), read back from its --json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vim_ds.cli.bench.split import communication_per_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def test_bench_split_measures_each_n_and_the_split_computes_the_unsplit_logits(tmp_path):
    kwargs = ["depth=2", "embed_dim=32", "patch_size=4", "stride=4"]
    out = tmp_path / "split.json"
    proc = subprocess.run([sys.executable, "-m", "vim_ds.bench", "split", "--model", "vim_tiny", "--model-kwargs",
                           *kwargs, "--input-size", "64", "--ranks", "1", "2", "--repeat", "1", "--nb-classes", "10",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = results["rows"]
    cores = len(os.sched_getaffinity(0))
    # on a CPU the unsplit model is timed again with the split ranks' threads (cores // 2), when that differs
    expected = [(1, cores), (2, max(1, cores // 2))] + ([(1, cores // 2)] if cores >= 2 else [])
    assert [(r["ranks"], r["threads"]) for r in rows] == expected
    for row in rows:
        assert row["peak_bytes"] >= 0 and row["forward_s"] > 0 and row["backward_s"] > 0
    # the measured split is the unsplit computation (fp32: rounding at most)
    assert rows[1]["logits_max_rel_diff"] <= 1e-5
    assert all(r["logits_max_rel_diff"] <= 1e-5 for r in rows[1:])
    # the paper numbers: Vim-tiny's mixer at embed_dim 32: d_inner 64, d_state 16, d_conv 4; fp32
    assert rows[1]["comm"] == {"edges": 2 * 3 * 64 * 4, "pairs": 4 * 64 * 16 * 4, "class_token": 32 * 4}
    assert "N = 2, " in proc.stdout and "x the unsplit step / N" in proc.stdout
    if cores >= 2:
        assert f"against the unsplit model at {cores // 2} thread" in proc.stdout


def test_communication_per_block_follows_the_model():
    import timm

    import vim_ds.models  # noqa: F401

    model = timm.create_model("vim_small", pretrained=False, num_classes=10, depth=1)
    import torch

    comm = communication_per_block(model, batch=2, dtype=torch.bfloat16)
    # Vim-small: embed_dim 384, d_inner 768, d_state 16, d_conv 4
    assert comm == {"edges": 2 * 3 * 2 * 768 * 2, "pairs": 4 * 2 * 768 * 16 * 4, "class_token": 2 * 384 * 2}


def test_share_gpu_without_a_gpu_is_refused_in_one_line(capsys):
    import torch

    from vim_ds.cli.bench import main

    if torch.cuda.is_available():
        pytest.skip("on a GPU --share-gpu runs (tools/gpu_check.sh's split step)")
    assert main(["split", "--share-gpu", "--ranks", "1", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--share-gpu needs a GPU; this machine has none" in err[0], err
