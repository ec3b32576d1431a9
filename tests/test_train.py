"""Real DeepSpeed training on CPU: ZeRO stage equivalence, convergence on real images, exact resume, finetuning,
EMA under ZeRO-3. Every run is a real launch (torchrun or the deepspeed launcher) of `vim_ds.train`, gloo between
2 processes, real PNG images through the real data pipeline."""
from __future__ import annotations

import argparse
import math
import os

import pytest
import torch

from train_utils import QUIET_AUG, ROOT, TINY, config, evals, records, rel_diff, run_train, step_losses

pytestmark = pytest.mark.slow




def common(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0", "--seed", "3",
            *TINY, *extra]


# -- stage equivalence ------------------------------------------------------------------------------------------

SPLITS = {  # name -> (ranks, per-rank micro batch, accumulation, config): all a global batch of 16
    "zero0": (2, 8, 1, "zero0"), "zero1": (2, 8, 1, "zero1"), "zero2": (2, 8, 1, "zero2"),
    "zero3": (2, 8, 1, "zero3"), "1rank_accum2": (1, 8, 2, "zero0"),
}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def stage_runs(request, digits, tmp_path_factory):
    precision = request.param
    runs = {}
    for name, (ranks, micro, accum, cfg) in SPLITS.items():
        out = str(tmp_path_factory.mktemp(f"{name}_{precision}"))
        run_train(common(digits, out, *QUIET_AUG, "--deepspeed_config", config(cfg), "--precision", precision,
                         "--batch-size", micro, "--accum-steps", accum, "--max-steps", 10, "--lr", "2e-3",
                         "--warmup-epochs", "0", "--model-ema-decay", "0.8", "--clip-grad", "1.0"), nproc=ranks)
        runs[name] = out
    return precision, runs


def test_zero_stages_and_accumulation_give_the_same_losses(stage_runs):
    precision, runs = stage_runs
    tolerance = 1e-5 if precision == "fp32" else 2e-2
    reference = step_losses(runs["zero0"])
    assert sorted(reference) == list(range(1, 11))
    assert all(math.isfinite(v) for v in reference.values())
    for name, out in runs.items():
        losses = step_losses(out)
        assert rel_diff(reference, losses) <= tolerance, (name, reference, losses)
    # the runs really learn something in 10 steps (so agreement is not agreement on a constant)
    assert reference[10] < reference[1]
    # every stage reports the gradient norm (DeepSpeed's own for ZeRO 1-3, the trainer's for ZeRO-0), and they agree
    norms = {name: [r["grad_norm"] for r in records(out) if "loss" in r] for name, out in runs.items()}
    for name, values in norms.items():
        assert len(values) == 10 and all(v is not None and v > 0 for v in values), (name, values)
        worst = max(abs(a - b) / b for a, b in zip(values, norms["zero0"]))
        assert worst <= (1e-4 if precision == "fp32" else 5e-2), (name, values, norms["zero0"])


def test_ema_under_zero3_equals_ema_under_zero0(stage_runs):
    precision, runs = stage_runs
    tolerance = 1e-5 if precision == "fp32" else 2e-2

    def ema(out):
        return torch.load(os.path.join(out, "checkpoints", "global_step10", "ema.pt"), weights_only=True)

    z0, z3 = ema(runs["zero0"]), ema(runs["zero3"])
    assert z0.keys() == z3.keys()
    for name in z0:
        assert z0[name].shape == z3[name].shape, name
        torch.testing.assert_close(z3[name], z0[name], rtol=tolerance, atol=tolerance * 1e-1, msg=name)
    # the EMA is an average, not a copy of the final weights, and it was evaluated alongside the model
    from vim_ds.checkpoint.consolidate import fp32_state_dict

    final = fp32_state_dict(os.path.join(runs["zero3"], "checkpoints"), "global_step10")
    assert max((final[n] - z3[n]).abs().max().item() for n in z3) > 1e-4
    last_eval = evals(runs["zero3"])[-1]
    assert {"ema_eval_acc1", "ema_eval_acc5", "ema_eval_loss"} <= last_eval.keys()


# -- convergence on real images ----------------------------------------------------------------------------------

def test_readme_main_job_learns_digits_to_95_percent_with_zero2_on_two_ranks(digits, tmp_path):
    """`bash launch/train_digits.sh` (the README's main job): the deepspeed launcher, 2 ranks, ZeRO-2, bf16, a
    depth-6 width-96 Vim on the real digits images reaches >= 95 % validation top-1."""
    import subprocess

    out = str(tmp_path / "run")
    env = {**os.environ, "DATA": digits, "OUT": out, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", "launch/train_digits.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = evals(out)[-1]
    assert final["eval_images"] == 360 and final["step"] == 20 * 11
    assert final["eval_acc1"] >= 95.0, final
    assert f"validation top-1 {final['eval_acc1']:.2f}%" in proc.stdout


# -- exact resume ------------------------------------------------------------------------------------------------

def test_resume_continues_exactly_and_skips_an_interrupted_save(digits, tmp_path):
    """The full recipe (RandAugment, Mixup/CutMix, random erasing, drop path, EMA, repeated augmentation) under
    ZeRO-3 on 2 ranks: 24 steps straight == 12 steps, stop, resume, 12 more (crossing an epoch end)."""
    recipe = ["--deepspeed_config", config("zero3"), "--precision", "fp32", "--batch-size", "32", "--epochs", "3",
              "--lr", "2e-3", "--warmup-epochs", "1", "--model-ema-decay", "0.9", "--drop-path", "0.1"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_train(common(digits, straight, *recipe, "--max-steps", "24", "--keep-checkpoints", "0"), nproc=2)
    run_train(common(digits, split, *recipe, "--max-steps", "12"), nproc=2)
    proc = run_train(common(digits, split, *recipe, "--max-steps", "24", "--resume", "auto"), nproc=2)
    assert "at epoch 0, step 12" in proc.stdout
    a, b = step_losses(straight), step_losses(split)
    assert sorted(a) == list(range(1, 25))
    assert rel_diff(a, b) <= 1e-6, (a, b)
    ema_a = torch.load(os.path.join(straight, "checkpoints", "global_step24", "ema.pt"), weights_only=True)
    ema_b = torch.load(os.path.join(split, "checkpoints", "global_step24", "ema.pt"), weights_only=True)
    for name in ema_a:
        torch.testing.assert_close(ema_b[name], ema_a[name], rtol=1e-5, atol=1e-7, msg=name)

    # `vim-ds eval` on one process scores the 2-rank ZeRO-3 checkpoint (reassembled by zero_to_fp32) exactly as the
    # training run scored it at its end, EMA included.
    scored = str(tmp_path / "scored")
    run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", scored, "--num_workers", "0", *TINY,
               "--precision", "fp32", "--batch-size", "32", "--resume", os.path.join(straight, "checkpoints")],
              module="vim_ds.eval")
    trained, evaluated = evals(straight)[-1], evals(scored)[-1]
    assert trained["step"] == 24 and evaluated["eval_images"] == trained["eval_images"] == 360
    for key in ("eval_acc1", "eval_acc5", "ema_eval_acc1"):
        assert evaluated[key] == trained[key], key
    for key in ("eval_loss", "ema_eval_loss"):
        assert evaluated[key] == pytest.approx(trained[key], rel=1e-5), key

    # A save that was interrupted (no completion marker) is never resumed, even though `latest` names it.
    save_dir = os.path.join(straight, "checkpoints")
    assert open(os.path.join(save_dir, "latest")).read().strip() == "global_step24"
    os.remove(os.path.join(save_dir, "global_step24", "vim_ds_complete.json"))
    os.remove(os.path.join(straight, "metrics.jsonl"))
    proc = run_train(common(digits, straight, *recipe, "--max-steps", "24", "--resume", "auto"), nproc=2)
    assert "at epoch 1, step 22" in proc.stdout  # the epoch-end checkpoint before it
    again = step_losses(straight)
    assert sorted(again) == [23, 24]
    assert rel_diff({k: a[k] for k in again}, again) <= 1e-6


# -- finetuning ---------------------------------------------------------------------------------------------------

def test_finetune_from_a_published_format_checkpoint(digits, tmp_path):
    """A {'model': state_dict, 'args': Namespace} file for 1000 classes at 64 px starts a 10-class run at 32 px:
    position embeddings are resampled, the head is reset, everything else is loaded."""
    import timm

    import vim_ds  # noqa: F401
    from vim_ds.checkpoint.consolidate import fp32_state_dict

    published = timm.create_model("vim_tiny", num_classes=1000, img_size=64, depth=2, embed_dim=32, patch_size=4,
                                  stride=4)
    path = str(tmp_path / "vim_published.pth")
    torch.save({"model": published.state_dict(), "args": argparse.Namespace(model="vim_tiny"), "epoch": 299}, path)
    out = str(tmp_path / "ft")
    run_train(common(digits, out, *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32",
                     "--finetune", path, "--batch-size", "16", "--max-steps", "2", "--lr", "1e-12", "--unscale-lr",
                     "--warmup-lr", "1e-12", "--no-model-ema"))
    trained = fp32_state_dict(os.path.join(out, "checkpoints"), "global_step2")
    assert trained["pos_embed"].shape == (1, 65, 32) and published.pos_embed.shape == (1, 257, 32)
    assert trained["head.weight"].shape == (10, 32)
    source = published.state_dict()
    for name in ("layers.1.mixer.in_proj.weight", "layers.0.mixer.A_b_log", "patch_embed.proj.weight", "norm_f.weight"):
        torch.testing.assert_close(trained[name], source[name], rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_resume_on_another_rank_count_through_a_universal_checkpoint(digits, tmp_path, stage):
    """Saved by 2 ranks, resumed by 1 rank with accumulation 2 (the same global batch): DeepSpeed's universal
    checkpoint re-partitions the optimizer states, the rank-independent sample order does the rest."""
    recipe = ["--deepspeed_config", config(stage), "--precision", "fp32", "--epochs", "2", "--lr", "2e-3",
              "--warmup-epochs", "1", "--model-ema-decay", "0.9", *QUIET_AUG]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_train(common(digits, straight, *recipe, "--batch-size", "16", "--max-steps", "8"), nproc=2)
    run_train(common(digits, split, *recipe, "--batch-size", "16", "--max-steps", "4"), nproc=2)
    proc = run_train(common(digits, split, *recipe, "--batch-size", "16", "--accum-steps", "2", "--max-steps", "8",
                            "--resume", "auto"), nproc=1)
    assert "universal checkpoint" in proc.stdout and "at epoch 0, step 4" in proc.stdout
    a, b = step_losses(straight), step_losses(split)
    assert sorted(b) == list(range(1, 9))
    assert rel_diff(a, b) <= 1e-5, (a, b)

    # the same by hand: `vim-ds convert --universal`, then resume the universal tag on 1 rank
    import subprocess
    import sys

    converted = str(tmp_path / "converted")
    run_train(common(digits, converted, *recipe, "--batch-size", "16", "--max-steps", "4"), nproc=2)
    proc = subprocess.run([sys.executable, "-m", "vim_ds.convert", "--universal",
                           os.path.join(converted, "checkpoints")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    universal = os.path.join(converted, "checkpoints", "global_step4_universal")
    assert universal in proc.stdout and os.path.isdir(os.path.join(universal, "zero"))
    run_train(common(digits, converted, *recipe, "--batch-size", "32", "--max-steps", "8", "--resume", universal),
              nproc=1)
    assert rel_diff(a, step_losses(converted)) <= 1e-5
