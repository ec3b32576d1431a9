"""A checkpoint written by timm's train.py (`timm.utils.CheckpointSaver`: `state_dict`, `state_dict_ema`, the
optimizer, the args Namespace) is read wherever a weights file is: `--finetune`, `vim-ds eval --resume FILE`,
`vim-ds predict --weights` and `vim-ds export --weights`, its EMA weights chosen by `--ema` as a
`{'model', 'model_ema'}` file's are. The file is written by timm's own saver after a real optimizer step."""
from __future__ import annotations

import argparse
import glob
import os

import pytest
import torch

from train_utils import QUIET_AUG, TINY, config, evals, run_train

TINY_KWARGS = dict(num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)


def tiny_model():
    import timm

    import vim_ds  # noqa: F401  (registers the Vim variants)

    return timm.create_model("vim_tiny", **TINY_KWARGS)


def assert_same_tensors(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def timm_files(tmp_path_factory):
    """timm's CheckpointSaver run on a tiny Vim after one AdamW step and one EMA update (decay 0.5: the EMA is
    halfway between the initial and the trained weights), and the same weights written in our format.
    Returns (model_best.pth.tar, ours.pth, weights, EMA weights)."""
    from timm.utils import CheckpointSaver, ModelEmaV3

    torch.manual_seed(0)
    model = tiny_model()
    ema = ModelEmaV3(model, decay=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(4, 3, 32, 32)).logsumexp(-1).mean().backward()
    optimizer.step()
    ema.update(model)
    directory = tmp_path_factory.mktemp("timm_run")
    args = argparse.Namespace(model="vim_tiny", lr=0.05, epochs=1, model_ema=True, output=str(directory))
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(directory),
                            recovery_dir=str(directory))
    saver.save_checkpoint(0, metric=12.5)
    best = directory / "model_best.pth.tar"
    assert best.is_file() and (directory / "checkpoint-0.pth.tar").is_file()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ema_weights = {k: v.detach().clone() for k, v in ema.module.state_dict().items()}
    assert differs(weights, ema_weights)
    ours = directory / "ours.pth"
    torch.save({"model": weights, "model_ema": ema_weights}, ours)
    return str(best), str(ours), weights, ema_weights


def test_the_shared_loader_gives_the_savers_weights_and_ema(timm_files):
    from vim_ds.checkpoint import load_model_weights, load_weights_file
    from vim_ds.checkpoint.files import split_weights

    best, _, weights, ema_weights = timm_files
    obj = load_weights_file(best)  # weights_only, with timm's args Namespace and optimizer state in it
    assert {"state_dict", "state_dict_ema", "optimizer", "args", "epoch", "metric"} <= set(obj), sorted(obj)
    assert isinstance(obj["args"], argparse.Namespace) and obj["metric"] == 12.5
    got, got_ema = split_weights(obj, best)
    assert_same_tensors(got, weights)
    assert_same_tensors(got_ema, ema_weights)
    assert_same_tensors(load_model_weights(tiny_model(), best).state_dict(), weights)
    assert_same_tensors(load_model_weights(tiny_model(), best, ema=True).state_dict(), ema_weights)


def test_a_ddp_module_prefix_is_dropped(timm_files, tmp_path):
    from vim_ds.checkpoint import load_model_weights

    _, _, weights, ema_weights = timm_files
    path = tmp_path / "ddp.pth.tar"
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights.items()},
                "state_dict_ema": {f"module.{k}": v for k, v in ema_weights.items()}}, path)
    assert_same_tensors(load_model_weights(tiny_model(), path, ema=True).state_dict(), ema_weights)


def test_a_file_without_weights_or_ema_is_a_one_line_error(timm_files, tmp_path):
    from timm.utils import CheckpointSaver

    from vim_ds.checkpoint import CheckpointError, load_model_weights

    best, _, _, _ = timm_files
    neither = tmp_path / "optimizer_only.pth"
    torch.save({"epoch": 3, "optimizer": {"state": {}, "param_groups": []}, "args": argparse.Namespace(lr=1.0)},
               neither)
    with pytest.raises(CheckpointError) as info:
        load_model_weights(tiny_model(), neither)
    message = str(info.value)
    assert "\n" not in message and str(neither) in message, message
    assert "entries: epoch, optimizer, args" in message and "'state_dict'" in message and "'model'" in message

    model = tiny_model()  # a timm run without --model-ema: no state_dict_ema
    CheckpointSaver(model, torch.optim.SGD(model.parameters(), lr=0.1), args=argparse.Namespace(model="vim_tiny"),
                    checkpoint_dir=str(tmp_path)).save_checkpoint(0, metric=1.0)
    no_ema = str(tmp_path / "model_best.pth.tar")
    load_model_weights(tiny_model(), no_ema)
    with pytest.raises(CheckpointError, match=r"has no EMA weights \(no 'model_ema' or 'state_dict_ema' entry\)$"):
        load_model_weights(tiny_model(), no_ema, ema=True)


ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]


def predict_lines(capsys, weights: str, images: list[str], *extra) -> list[str]:
    from vim_ds.cli.predict import main

    code = main([*images, "--weights", weights, *extra, *ARCH])  # images first: --model-kwargs takes the rest
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip().splitlines()


def test_predict_reads_the_timm_file_and_its_ema(timm_files, digits, capsys):
    best, ours, _, _ = timm_files
    images = [sorted(glob.glob(os.path.join(digits, "val", c, "*.png")))[0] for c in ("3", "7")]
    plain, ema = predict_lines(capsys, best, images), predict_lines(capsys, best, images, "--ema")
    assert len(plain) == len(ema) == 2 and plain[0].startswith(f"{images[0]}: "), plain
    assert plain == predict_lines(capsys, ours, images)
    assert ema == predict_lines(capsys, ours, images, "--ema")
    assert ema != plain  # the control: --ema loads other weights

    from vim_ds.cli.predict import main

    neither = os.path.join(os.path.dirname(best), "neither.pth")
    torch.save({"epoch": 3}, neither)
    assert main([images[0], "--weights", neither, *ARCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vim-ds predict: error: ") and "'state_dict'" in err[0], err


def test_export_of_the_timm_files_ema_gives_its_logits(timm_files, tmp_path):
    from vim_ds.cli.export import main

    best, _, weights, ema_weights = timm_files
    out = str(tmp_path / "model.pt2")
    assert main(["--weights", best, "--out", out, *ARCH, "--ema"]) == 0
    program = torch.export.load(out).module()
    x = torch.randn(3, 3, 32, 32)
    want, other = tiny_model().eval(), tiny_model().eval()
    want.load_state_dict(ema_weights)
    other.load_state_dict(weights)
    with torch.no_grad():
        got = program(x)
        torch.testing.assert_close(got, want(x), rtol=1e-5, atol=1e-6)
        assert (got - other(x)).abs().max() > 1e-3  # the control: not the non-EMA weights


def test_eval_scores_the_timm_file_and_its_ema_as_our_format(timm_files, digits, tmp_path):
    best, ours, _, _ = timm_files
    records = []
    for name, path in (("timm", best), ("ours", ours)):
        out = str(tmp_path / name)
        run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0", *TINY,
                   "--precision", "fp32", "--resume", path], module="vim_ds.eval")
        records.append(evals(out)[-1])
    timm_record, ours_record = records
    assert timm_record["source"] == best
    for key in ("eval_acc1", "eval_acc5", "eval_loss", "ema_eval_acc1", "ema_eval_loss"):
        assert timm_record[key] == pytest.approx(ours_record[key], rel=1e-6, abs=1e-9), key
    assert timm_record["eval_loss"] != pytest.approx(timm_record["ema_eval_loss"], rel=1e-4)  # two weight sets


def test_finetune_starts_from_the_timm_files_weights(timm_files, digits, tmp_path):
    from vim_ds.checkpoint.consolidate import fp32_state_dict

    best, _, weights, ema_weights = timm_files
    out = str(tmp_path / "ft")
    run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0",
               "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32",
               "--finetune", best, "--batch-size", "16", "--max-steps", "1", "--lr", "1e-12", "--unscale-lr",
               "--warmup-lr", "1e-12", "--no-model-ema"])
    trained = fp32_state_dict(os.path.join(out, "checkpoints"), "global_step1")
    assert trained.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-6, atol=1e-8, msg=name)
    assert differs(trained, ema_weights)  # the control: the non-EMA weights, as for a {'model', 'model_ema'} file
