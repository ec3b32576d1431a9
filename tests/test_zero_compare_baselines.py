"""`vim-ds zero-compare --baselines ddp fsdp`: the byte formulas, the trainer's refusals, and (slow) real 2-rank
DDP and FSDP2 runs beside ZeRO-0 with a negative control.

Loss tolerance (fp32): the baselines run the same fp32 arithmetic as ZeRO-0 (same initial weights, same images,
same AdamW, gradients averaged over the same 2 ranks); what may differ is the order of a few sums (bucketed vs
per-tensor all-reduce, DeepSpeed's fused Adam vs torch's foreach AdamW), i.e. some fp32 roundings (eps = 1.19e-7)
per step, which 4 steps of Adam cannot grow to 1e-5 relative (`zero_compare.LOSS_TOLERANCE["fp32"]`, ~84 eps).
Measured on this machine: 0 (bitwise equal losses). Doubling the lr moves the losses by ~1e-2, three orders above.
"""
from __future__ import annotations

import csv
import json
import os
import sys

import pytest
import torch

import preloaded
from vim_ds.cli import zero_compare as zc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_KWARGS = {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4}
LR = 0.1  # scaled by the trainer to 0.1 x 8 / 512; no warmup, so every step is a real update


def test_fsdp_shard_numel_chunks_dim0_rounding_up():
    # 7 rows on 2 ranks: 4 + 3; 3 rows on 4 ranks: 1 + 1 + 1 + 0; a scalar is one row
    assert [zc.fsdp_shard_numel((7, 5), r, 2) for r in range(2)] == [20, 15]
    assert [zc.fsdp_shard_numel((3,), r, 4) for r in range(4)] == [1, 1, 1, 0]
    assert zc.fsdp_shard_numel((), 0, 2) == 1 and zc.fsdp_shard_numel((), 1, 2) == 0
    for shape in [(7, 5), (3,), (1, 65, 32), (10, 1, 4)]:
        for n in (1, 2, 3, 8):
            total = 1
            for d in shape:
                total *= d
            assert sum(zc.fsdp_shard_numel(shape, r, n) for r in range(n)) == total


def test_expected_baseline_bytes():
    shapes = [(7, 5), (7,), (3, 7), (3,)]
    psi = 35 + 7 + 21 + 3
    assert zc.expected_baseline_bytes("ddp", shapes, 2) == {"param": 4 * psi, "grad": 4 * psi, "optim": 8 * psi,
                                                            "total": 16 * psi}
    rank0 = 20 + 4 + 14 + 2  # ceil(7/2)=4 rows of 5, 4 of 1, ceil(3/2)=2 rows of 7, 2 of 1
    assert zc.expected_baseline_bytes("fsdp", shapes, 2)["total"] == 16 * rank0
    assert zc.expected_baseline_bytes("fsdp", shapes, 1) == zc.expected_baseline_bytes("ddp", shapes, 1)
    with pytest.raises(ValueError):
        zc.expected_baseline_bytes("zero", shapes, 2)


def test_torch_state_bytes_counts_params_grads_and_adam_once():
    from vim_ds.engine.memory import torch_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    held = torch_state_bytes(model.parameters(), opt)
    psi = 66
    assert held["param_bytes"] == held["grad_bytes"] == 4 * psi
    assert held["optim_bytes"] == 8 * psi + 4 * 4  # two moments + a 4-byte step counter per tensor
    assert held["master_bytes"] == 0 and held["grad_source"] == "live"


def test_baseline_precision_and_refusals():
    from vim_ds.runtime.baselines import precision_label
    from vim_ds.cli.run_options import parse_args

    assert precision_label("fp32") == "fp32" and precision_label("bf16") == "fp32+autocast-bf16"
    with pytest.raises(ValueError, match="fp16"):
        precision_label("fp16")
    assert parse_args(["--engine", "ddp"]).model_ema is False
    assert parse_args([]).model_ema is True and parse_args(["--no-model-ema"]).model_ema is False
    for extra in (["--resume", "auto"], ["--save-interval", "5"], ["--model-ema"]):
        with pytest.raises(SystemExit):
            parse_args(["--engine", "fsdp", *extra])


def test_finish_rows_gives_baselines_their_own_expectation():
    shapes = [(8, 4), (8,)]
    rows = [{"config": "zero0", "engine": "deepspeed", "stage": 0, "offload": "-", "precision": "fp32", "ranks": 2},
            {"config": "fsdp", "engine": "fsdp", "stage": None, "offload": "-", "precision": "fp32", "ranks": 2}]
    for r in rows:
        r.update(param_bytes_per_rank=[1, 1], grad_bytes_per_rank=[1, 1], optim_bytes_per_rank=[1, 1])
    zc.finish_rows(rows, {"zero0": {1: 1.0}, "fsdp": {1: 1.0 + 1e-3}}, psi=40, shapes=shapes)
    assert rows[0]["expected_model_state_bytes_per_rank"] == 16 * 40
    assert rows[1]["expected_model_state_bytes_per_rank"] == 16 * 20
    assert rows[1]["loss_flag"] is True  # 1e-3 > the fp32 tolerance


# -- real runs ----------------------------------------------------------------------------------------------------

def _ints(cell):
    return [int(float(v)) for v in cell.split()]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One real zero-compare: ZeRO-0, DDP and FSDP2, 2 ranks, fp32, 4 steps at a real lr; its torchrun jobs are
    forked from the suite's preloaded server (`preloaded.nested_env`). The real torchrun under zero-compare's
    launcher (`launched_runs`) is the lr control's run below, started from this process."""
    out = tmp_path_factory.mktemp("baselines") / "cmp"
    proc = preloaded.run(
        [sys.executable, "-m", "vim_ds.zero_compare", "--model", "vim_tiny", "--model-kwargs",
         *[f"{k}={v}" for k, v in MODEL_KWARGS.items()], "--input-size", "32", "--batch-size", "4", "--steps", "4",
         "--ranks", "2", "--stages", "0", "--baselines", "ddp", "fsdp", "--precision", "fp32", "--nb-classes", "10",
         "--lr", str(LR), "--warmup-epochs", "0", "--out", str(out)],
        # a hang guard: 3 two-rank jobs, ~3 min on a busy 2-core box
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=preloaded.nested_env({**os.environ, "PYTHONUNBUFFERED": "1"}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "report.csv") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    return out, rows


@pytest.mark.slow
def test_ddp_and_fsdp_rows_hold_the_expected_bytes_and_agree_with_zero0(report):
    out, rows = report
    assert list(rows) == ["zero0", "ddp", "fsdp"] and all(not r["error"] for r in rows.values())
    assert rows["ddp"]["engine"] == "ddp" and rows["fsdp"]["precision"] == "fp32"
    _, _, shapes = zc.model_params("vim_tiny", MODEL_KWARGS, 32, 10)
    steps_counter = 4 * len(shapes)  # Adam's step tensor per parameter, not in the formula

    for engine in ("ddp", "fsdp"):
        per_rank = {k: _ints(rows[engine][f"{k}_bytes_per_rank"]) for k in zc.KINDS}
        for rank in (0, 1):
            n = sum(zc.fsdp_shard_numel(s, rank, 2) if engine == "fsdp" else zc.fsdp_shard_numel(s, 0, 1)
                    for s in shapes)
            assert per_rank["param"][rank] == 4 * n
            assert per_rank["grad"][rank] == 4 * n
            assert per_rank["optim"][rank] == 8 * n + steps_counter
        expected = zc.expected_baseline_bytes(engine, shapes, 2)["total"]
        assert int(rows[engine]["expected_model_state_bytes_per_rank"]) == expected
        assert int(rows[engine]["model_state_bytes_per_rank"]) == expected + steps_counter
    # DDP holds what ZeRO-0 holds in fp32; FSDP about half of it (rounded up per tensor)
    assert rows["ddp"]["model_state_bytes_per_rank"] == rows["zero0"]["model_state_bytes_per_rank"]
    fsdp, ddp = int(rows["fsdp"]["model_state_bytes_per_rank"]), int(rows["ddp"]["model_state_bytes_per_rank"])
    assert 0.5 * ddp <= fsdp <= 0.55 * ddp
    # negative control of the byte check: unsharded (DDP's) bytes do not pass as FSDP's
    assert ddp != zc.expected_baseline_bytes("fsdp", shapes, 2)["total"] + steps_counter

    # per-step losses agree with ZeRO-0 within the fp32 tolerance, over all 4 steps
    _, base = zc.read_run(str(out / "runs" / "zero0"))
    assert sorted(base) == [1, 2, 3, 4]
    for engine in ("ddp", "fsdp"):
        _, losses = zc.read_run(str(out / "runs" / engine))
        assert sorted(losses) == sorted(base)
        assert zc.max_rel_diff(losses, base) <= zc.LOSS_TOLERANCE["fp32"]
        assert rows[engine]["loss_flag"] == "False"
    # the steps changed the loss (the comparison saw real updates)
    assert max(base.values()) - min(base.values()) > 1e-2
    md = (out / "report.md").read_text()
    assert "## Baselines" in md and "| fsdp | - |" in md and "all agree" in md


@pytest.mark.slow
def test_a_baseline_with_another_lr_is_flagged(report, tmp_path):
    """Negative control: the DDP baseline with the lr doubled, else the same launch, disagrees with ZeRO-0 by more
    than the tolerance. Its job is the suite's real torchrun under `launched_runs` (this process sends nothing to
    the preloaded server)."""
    from vim_ds.runtime.launched_runs import run_train_config

    out, _ = report
    run_dir = tmp_path / "ddp_lr2"
    res = run_train_config("zero0", nproc=2, launcher="torchrun", model="vim_tiny", model_kwargs=MODEL_KWARGS,
                           input_size=32, batch_size=4, steps=3, warmup=1, precision="fp32", workers=0,
                           out_dir=str(run_dir), nb_classes=10, timeout=600,
                           extra_args=["--lr", 2 * LR, "--warmup-epochs", 0, "--no-model-ema", "--engine", "ddp"])
    assert not res.get("error"), res
    _, losses = zc.read_run(str(run_dir))
    _, base = zc.read_run(str(out / "runs" / "zero0"))
    assert losses[1] == pytest.approx(base[1], rel=1e-6)  # the first loss is before any update
    assert zc.max_rel_diff(losses, base) > 10 * zc.LOSS_TOLERANCE["fp32"]
    with open(run_dir / "metrics.jsonl") as f:
        summary = [json.loads(line) for line in f if '"summary"' in line][-1]
    assert summary["engine"] == "ddp"
