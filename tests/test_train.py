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

SPLITS = {  # name -> (ranks, per-rank micro batch, accumulation, config, lr): all a global batch of 16
    "zero0": (2, 8, 1, "zero0", "2e-3"), "zero1": (2, 8, 1, "zero1", "2e-3"), "zero2": (2, 8, 1, "zero2", "2e-3"),
    "zero3": (2, 8, 1, "zero3", "2e-3"), "1rank_accum2": (1, 8, 2, "zero0", "2e-3"),
    # the negative control: the same recipe with an optimizer that does not move the weights (lr 1e-12), as a
    # ZeRO stage whose optimizer never stepped or an EMA that was never updated would look; every comparison below
    # must tell it apart from the real runs by at least 10x its tolerance (one process: the cheapest layout)
    "control": (1, 8, 2, "zero0", "1e-12"),
}
# lr 2e-3 as it is (--unscale-lr; the batch-scaled 2e-3 x 16/512 moved the loss by only 0.24 % in 10 steps, less
# than the bf16 tolerance). Measured on 2 CPU cores, 10 steps (max relative difference to ZeRO-0 per step):
#   bf16  loss: ZeRO-1/2/3 3.9e-3, 1 rank x accumulation 2 1.3e-4, control 5.3e-2
#         grad norm: ZeRO-1/2/3 3.5e-2, 1 rank 1.2e-3, control 0.55
#   (in bf16, ZeRO-1/2/3 run DeepSpeed's ZeRO optimizer, agree with each other to 1e-6 and with the fp32 runs to
#   4 digits; without ZeRO DeepSpeed wraps the optimizer in its bf16 FP16_Optimizer with bf16 gradient
#   accumulation, whose rounding moves the trajectory by the 3.9e-3 above)
#   fp32  loss: every layout <= 1.1e-7, control 5.6e-2; grad norm: every layout <= 1.6e-7, control 0.59
# Each tolerance is ~1.3x (bf16) or ~7x (fp32) the worst measured rounding, and the control sits >= 10x above it.
LOSS_TOLERANCE = {"fp32": 1e-6, "bf16": 5e-3}
NORM_TOLERANCE = {"fp32": 1e-6, "bf16": 5e-2}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def stage_runs(request, digits, tmp_path_factory):
    precision = request.param
    runs = {}
    for name, (ranks, micro, accum, cfg, lr) in SPLITS.items():
        out = str(tmp_path_factory.mktemp(f"{name}_{precision}"))
        run_train(common(digits, out, *QUIET_AUG, "--deepspeed_config", config(cfg), "--precision", precision,
                         "--batch-size", micro, "--accum-steps", accum, "--max-steps", 10, "--lr", lr, "--unscale-lr",
                         "--warmup-epochs", "0", "--model-ema-decay", "0.8", "--clip-grad", "1.0"),
                  nproc=ranks)
        runs[name] = out
    return precision, runs


def grad_norms(out) -> list:
    return [r["grad_norm"] for r in records(out) if "loss" in r]


def norm_diff(a: list, b: list) -> float:
    return max(abs(x - y) / y for x, y in zip(a, b))


def test_zero_stages_and_accumulation_give_the_same_losses(stage_runs):
    precision, runs = stage_runs
    runs = dict(runs)
    control = runs.pop("control")
    tolerance, norm_tolerance = LOSS_TOLERANCE[precision], NORM_TOLERANCE[precision]
    reference = step_losses(runs["zero0"])
    assert sorted(reference) == list(range(1, 11))
    assert all(math.isfinite(v) for v in reference.values())
    for name, out in runs.items():
        losses = step_losses(out)
        assert rel_diff(reference, losses) <= tolerance, (name, reference, losses)
    # every stage reports the gradient norm (DeepSpeed's own for ZeRO 1-3, the trainer's for ZeRO-0), and they agree
    norms = {name: grad_norms(out) for name, out in runs.items()}
    for name, values in norms.items():
        assert len(values) == 10 and all(v is not None and v > 0 for v in values), (name, values)
        assert norm_diff(values, norms["zero0"]) <= norm_tolerance, (name, values, norms["zero0"])

    # negative control: weights that do not move must fail both comparisons by a wide margin, so the tolerances
    # guard real optimizer steps (a stage that never stepped would land here)
    still = step_losses(control)
    assert rel_diff(reference, still) >= 10 * tolerance, (reference, still)
    assert norm_diff(grad_norms(control), norms["zero0"]) >= 10 * norm_tolerance
    # the runs really learn something in 10 steps: the validation accuracy rises above the unmoved weights' one
    trained, unmoved = evals(runs["zero0"])[-1], evals(control)[-1]
    assert trained["eval_acc1"] >= unmoved["eval_acc1"] + 2.0, (trained, unmoved)


def ema_state(out) -> dict:
    return torch.load(os.path.join(out, "checkpoints", "global_step10", "ema.pt"), weights_only=True)


def worst_ratio(got: dict, want: dict, rtol: float, atol: float) -> float:
    """max |got - want| / (atol + rtol |want|) over all tensors: <= 1 is torch.testing.assert_close passing."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs() / (atol + rtol * want[n].abs())).max().item() for n in want)


def test_ema_under_zero3_equals_ema_under_zero0(stage_runs):
    """The EMA kept on ZeRO-3's partitioned parameters equals the EMA of whole parameters. In bf16 the reference is
    ZeRO-2 (whole parameters, the same DeepSpeed optimizer): ZeRO-0 in bf16 runs DeepSpeed's other bf16 optimizer,
    whose trajectory differs from ZeRO-1/2/3's by 23 % of the EMA's own movement in 10 steps (measured)."""
    precision, runs = stage_runs
    # measured: the two EMAs differ by at most 2.4e-7 (fp32) and 7.6e-7 (bf16) per element (summation order in
    # the EMA's fp32 accumulation); the EMA itself moves by ~1e-2 from the initial weights in these 10 steps
    rtol, atol = 0.0, 2e-6
    reference = ema_state(runs["zero0" if precision == "fp32" else "zero2"])
    z3 = ema_state(runs["zero3"])
    assert z3.keys() == reference.keys()
    for name in reference:
        assert z3[name].shape == reference[name].shape, name
        torch.testing.assert_close(z3[name], reference[name], rtol=rtol, atol=atol, msg=name)
    # negative control: an EMA that was never updated (the unmoved run's: its weights stayed the initial ones) is
    # outside the tolerance by far
    assert worst_ratio(ema_state(runs["control"]), reference, rtol, atol) >= 10
    # the EMA is an average, not a copy of the final weights, and it was evaluated alongside the model
    from vim_ds.checkpoint.consolidate import fp32_state_dict

    final = fp32_state_dict(os.path.join(runs["zero3"], "checkpoints"), "global_step10")
    assert max((final[n] - z3[n]).abs().max().item() for n in z3) > 1e-4
    last_eval = evals(runs["zero3"])[-1]
    assert {"ema_eval_acc1", "ema_eval_acc5", "ema_eval_loss"} <= last_eval.keys()


# -- convergence on real images ----------------------------------------------------------------------------------

def test_readme_main_job_learns_digits_to_95_percent_with_zero2_on_two_ranks(digits, tmp_path):
    """`bash launch/train_digits.sh` (the README's main job): the deepspeed launcher, 2 ranks, ZeRO-2 (fp32 on a CPU
    without bf16 instructions, bf16 otherwise), a depth-6 width-96 Vim on the real digits images reaches >= 95 %
    validation top-1."""
    import subprocess

    out = str(tmp_path / "run")
    env = {**os.environ, "DATA": digits, "OUT": out, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", "launch/train_digits.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = evals(out)[-1]
    assert final["eval_images"] == 360 and final["step"] == 12 * 11
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
