"""Options that no other test would miss if they were ignored or misread (issue 21, item 5: the option audit in
tests/README.md names this file for them). Each test gives the option a value other than its default and checks
its effect, without a training run: what reaches the function that does the work (convert, zero-compare's runs),
or what the command prints or writes (predict, export), or what the parsed options build (dataset, model)."""
from __future__ import annotations

import os

import pytest
import timm
import torch
from PIL import Image

import vim_ds  # noqa: F401  (registers the Vim variants in timm)

ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A published-format file ({"model": state_dict}) of a 10-class tiny Vim, and an image to classify."""
    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4,
                              stride=4).eval()
    root = tmp_path_factory.mktemp("wiring")
    path = str(root / "vim.pth")
    torch.save({"model": model.state_dict()}, path)
    y, x = torch.meshgrid(torch.arange(48), torch.arange(40), indexing="ij")
    pixels = torch.stack([x * 6, y * 5, (x * y) % 256], -1).to(torch.uint8).numpy()  # detail up to the border
    image = str(root / "image.png")
    Image.fromarray(pixels).save(image)
    return path, image


# -- predict ----------------------------------------------------------------------------------------------------

def predict_line(capsys, weights, *extra) -> list[tuple[str, str]]:
    from vim_ds.cli.predict import main

    path, image = weights
    assert main([image, "--weights", path, *extra, *ARCH]) == 0  # the image first: --model-kwargs takes the rest
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{image}: "), line
    return [tuple(entry.rsplit(" ", 1)) for entry in line.split(": ", 1)[1].split(", ")]


def test_predict_topk_classes_and_eval_crop_ratio(weights, capsys, tmp_path):
    default = predict_line(capsys, weights)
    assert len(default) == 5  # --topk's default
    assert len(predict_line(capsys, weights, "--topk", "3")) == 3
    names = tmp_path / "names.txt"
    names.write_text("".join(f"class-{i}\n" for i in range(10)))
    named = predict_line(capsys, weights, "--classes", str(names))
    assert [n for n, _ in named] == [f"class-{n}" for n, _ in default]  # the same classes, by the file's names
    # another crop of the same image: other probabilities (the control: the default crop again gives the same)
    assert predict_line(capsys, weights, "--eval-crop-ratio", "0.875") == default
    assert predict_line(capsys, weights, "--eval-crop-ratio", "0.5") != default


# -- export -----------------------------------------------------------------------------------------------------

def test_export_static_batch_fixes_the_batch_size(weights, tmp_path, capsys):
    from vim_ds.cli.export import main

    path, _ = weights
    programs = {}
    for name, extra in (("dynamic", []), ("static", ["--static-batch"])):
        out = str(tmp_path / f"{name}.pt2")
        assert main(["--weights", path, "--out", out, *ARCH, *extra]) == 0, capsys.readouterr().err
        programs[name] = torch.export.load(out).module()
    three = torch.randn(3, 3, 32, 32)
    assert programs["dynamic"](three).shape == (3, 10)  # the control: a batch of 3 runs without --static-batch
    assert programs["static"](three[:2]).shape == (2, 10)
    with pytest.raises(Exception):  # noqa: B017 - torch.export's guard error type differs between versions
        programs["static"](three)


# -- convert ----------------------------------------------------------------------------------------------------

def test_convert_passes_tag_ema_and_safetensors_on(monkeypatch, tmp_path, capsys):
    """What `vim-ds convert` asks of vim_ds.checkpoint.convert.convert (whose own tests check that it honours each
    argument: tests/test_convert.py)."""
    from vim_ds.checkpoint import convert as library
    from vim_ds.cli import convert as cli

    calls = []

    def fake(checkpoint, out, **kwargs):
        calls.append((checkpoint, out, {k: v for k, v in kwargs.items() if k not in ("progress", "stall")}))
        return {"out": out, "format": "pth", "model": "vim_tiny", "weights": "model", "has_ema": False, "tensors": 1,
                "parameters": 1, "num_classes": 10, "step": 2, "zero_stage": 0, "precision": "fp32", "source": "x"}

    monkeypatch.setattr(library, "convert", fake)
    assert cli.main(["ckpt", "out.bin"]) == 0
    assert cli.main(["ckpt", "out.bin", "--tag", "global_step2", "--ema", "--safetensors"]) == 0
    assert calls == [("ckpt", "out.bin", dict(tag=None, ema=False, safetensors=None)),
                     ("ckpt", "out.bin", dict(tag="global_step2", ema=True, safetensors=True))]


# -- zero-compare -----------------------------------------------------------------------------------------------

def test_zero_compare_passes_every_option_to_its_runs(monkeypatch, tmp_path, capsys):
    """Each option of `vim-ds zero-compare` at a value other than its default reaches the training runs it launches
    (runtime.launched_runs.run_train_config, replaced here: no run starts) or the report it writes."""
    from vim_ds.cli import zero_compare
    from vim_ds.runtime import launched_runs as runner

    launched = []

    def fake_run(config, **kwargs):
        launched.append((config, kwargs))
        return {"config": config, "error": "not launched in this test"}

    monkeypatch.setattr(runner, "run_train_config", fake_run)
    out = tmp_path / "report"
    code = zero_compare.main(["--model", "vim_small", "--model-kwargs", "depth=1", "patch_size=8", "stride=8",
                              "--input-size", "32", "--stages", "1", "3", "--offload", "--precision", "fp32",
                              "--ranks", "3", "--steps", "5", "--batch-size", "6", "--nb-classes", "7",
                              "--num-workers", "2", "--launcher", "deepspeed", "--baselines", "ddp", "--lr", "0.01",
                              "--warmup-epochs", "0.5", "--timeout", "77", "--out", str(out)])
    assert code == 1  # every (fake) run failed
    # --stages 1 3 --offload: those stages and the offloaded ZeRO-3; --baselines ddp: zero0.json's batch and AdamW
    assert [(config, os.path.basename(kw["out_dir"])) for config, kw in launched] == [
        ("zero1", "zero1"), ("zero3", "zero3"), ("zero3_offload", "zero3_offload"), ("zero0", "ddp")]
    assert all(os.path.dirname(kw["out_dir"]) == os.path.join(str(out), "runs") for _, kw in launched)
    for config, kw in launched:
        assert kw["nproc"] == 3 and kw["launcher"] == "deepspeed" and kw["model"] == "vim_small"
        assert kw["model_kwargs"] == {"depth": 1, "patch_size": 8, "stride": 8} and kw["input_size"] == 32
        assert kw["batch_size"] == 6 and kw["steps"] + kw["warmup"] == 5 and kw["precision"] == "fp32"
        assert kw["workers"] == 2 and kw["nb_classes"] == 7 and kw["timeout"] == 77
        extra = [str(a) for a in kw["extra_args"]]
        assert extra[:4] == ["--lr", "0.01", "--warmup-epochs", "0.5"] and "--no-model-ema" in extra
    assert [str(a) for a in launched[-1][1]["extra_args"][-2:]] == ["--engine", "ddp"]
    assert (out / "report.md").is_file()


def test_zero_compare_passes_sequence_parallel_to_its_runs_and_refuses_what_cannot_split(monkeypatch, tmp_path,
                                                                                          capsys):
    """`--sequence-parallel 3` reaches every launched run (no run starts) and the report's first line; a --ranks it
    does not divide and the baselines (which do not split) are usage errors."""
    from vim_ds.cli import zero_compare
    from vim_ds.runtime import launched_runs as runner

    launched = []
    monkeypatch.setattr(runner, "run_train_config", lambda config, **kw: launched.append(kw) or
                        {"config": config, "error": "not launched in this test"})
    out = tmp_path / "report"
    common = ["--model", "vim_tiny", "--input-size", "32", "--stages", "2", "3", "--out", str(out)]
    assert zero_compare.main([*common, "--ranks", "6", "--sequence-parallel", "3"]) == 1
    assert len(launched) == 2 and all([str(a) for a in kw["extra_args"]][-2:] == ["--sequence-parallel", "3"]
                                      and kw["nproc"] == 6 for kw in launched)
    assert "each image's tokens split over groups of 3 ranks" in (out / "report.md").read_text().splitlines()[2]
    for extra, cause in ((["--ranks", "4", "--sequence-parallel", "3"], "must be at least 1 and divide --ranks 4"),
                         (["--ranks", "2", "--sequence-parallel", "2", "--baselines", "ddp"], "do not split")):
        with pytest.raises(SystemExit):
            zero_compare.main([*common, *extra])
        assert cause in capsys.readouterr().err


# -- train: what the parsed options build -----------------------------------------------------------------------

def test_synthetic_data_set_options_build_that_data_set():
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.components import dataset_config
    from vim_ds.config.run_config import RunConfig
    from vim_ds.data import build_dataset

    config = RunConfig.from_dict(vars(parse_args(["--data-set", "synthetic", "--nb-classes", "7", "--synthetic-size",
                                                  "30", "--input-size", "32"])))
    train, classes = build_dataset(dataset_config(config), is_train=True)
    val, _ = build_dataset(dataset_config(config), is_train=False)
    assert classes == 7 and len(train) == 30 and len(val) == 3
    image, target = train.load(0)
    assert image.shape == (3, 32, 32) and 0 <= target < 7


def test_model_option_builds_that_variant():
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.components import model_config
    from vim_ds.config.run_config import RunConfig

    def build(argv):
        return model_config(RunConfig.from_dict(vars(parse_args(argv))), 10).build()

    small = build(["--model", "vim_small", "--input-size", "32", "--model-kwargs", "depth=1", "patch_size=8",
                   "stride=8"])
    tiny = build(["--model-kwargs", "depth=1", "patch_size=8", "stride=8", "--input-size", "32"])
    assert small.embed_dim == 384 and tiny.embed_dim == 192  # vim_small's width; the control: the default vim_tiny


def test_repeated_aug_flags():
    from vim_ds.cli.run_options import parse_args

    assert parse_args(["--no-repeated-aug", "--repeated-aug"]).repeated_aug is True  # the last one given wins
    assert parse_args(["--repeated-aug", "--no-repeated-aug"]).repeated_aug is False


def test_log_interval_sets_which_steps_print_a_line(tmp_path, capsys):
    from vim_ds.engine.metrics import MetricsLog

    log = MetricsLog(str(tmp_path), True, total_steps=7, log_interval=3)
    for step in range(1, 8):
        log.step({"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "samples_per_sec": 1.0})
    log.close()
    printed = [line.split()[3] for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert printed == ["3/7", "6/7", "7/7"]  # every 3rd step and the last
