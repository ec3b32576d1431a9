"""A weights file is recognised by its content, not its name: a safetensors file renamed `.pth` (torch.load said
`Unsupported operand 184`) and a torch file named `.safetensors` (safetensors said `header too large`) load as what
they are, through `--finetune`, `vim-ds predict --weights` and `vim-ds eval --resume FILE`; a converted safetensors
file renamed `.pth` still describes its model to predict. A file that is neither is refused with one line naming
what it looks like. A weights file under any name given to `--resume` is pointed to `--finetune`."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from train_utils import QUIET_AUG, TINY, config, digits80, error_line, evals, run_train

from vim_ds.checkpoint.files import CheckpointError, load_weights_file, sniff

ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]
KWARGS = {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4}
CLASSES = [str(n) for n in range(10)]  # the digits' class folders, recorded in the converted file


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 10-class tiny Vim's weights as a torch file (`{"model": ...}`), a converted safetensors file (with the model
    description in its metadata), each also under the other's extension, and a legacy-format pickle."""
    import timm

    import vim_ds  # noqa: F401
    from vim_ds.checkpoint.convert import write_weights_file

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, **KWARGS)
    folder = tmp_path_factory.mktemp("weights")
    paths = {"torch": str(folder / "w.pth"), "safetensors": str(folder / "w.safetensors"),
             "legacy": str(folder / "legacy.pth")}
    torch.save({"model": model.state_dict()}, paths["torch"])
    torch.save({"model": model.state_dict()}, paths["legacy"], _use_new_zipfile_serialization=False)
    write_weights_file(paths["safetensors"], model.state_dict(),
                       {"model": "vim_tiny", "model_kwargs": KWARGS, "num_classes": 10, "input_size": 32,
                        "classes": CLASSES}, safetensors=True)
    paths["safetensors_as_pth"] = str(folder / "st.pth")
    paths["torch_as_safetensors"] = str(folder / "torch.safetensors")
    paths["legacy_as_safetensors"] = str(folder / "legacy.safetensors")
    shutil.copy(paths["safetensors"], paths["safetensors_as_pth"])
    shutil.copy(paths["torch"], paths["torch_as_safetensors"])
    shutil.copy(paths["legacy"], paths["legacy_as_safetensors"])
    paths["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return paths


def test_each_file_loads_as_what_it_holds_whatever_its_name(files):
    state = files["state"]
    for name in ("safetensors_as_pth", "torch_as_safetensors", "legacy_as_safetensors"):
        obj = load_weights_file(files[name])
        weights = obj.get("model", obj)
        assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state), name
    assert sniff(files["safetensors_as_pth"])[0] == "safetensors" and sniff(files["torch_as_safetensors"])[0] == "torch"
    # the class names a converted safetensors file records (checked by eval and --finetune) survive a rename too
    from vim_ds.checkpoint.class_names import of_file

    renamed = files["safetensors_as_pth"]
    assert of_file(renamed, load_weights_file(renamed)) == of_file(files["safetensors"]) == CLASSES
    # the controls: what each library says when it is handed the other's file (the old choice by extension)
    with pytest.raises(Exception, match="Unsupported operand"):
        torch.load(files["safetensors_as_pth"], weights_only=True)
    from safetensors.torch import load_file

    with pytest.raises(Exception):
        load_file(files["torch_as_safetensors"])


NEITHER = [  # (name, content, what the error says it looks like)
    ("page.pth", b"<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n",
     "an HTML page (a download that returned a web page instead of the file?)"),
    ("lfs.safetensors", b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 28000000\n",
     "a Git LFS pointer, not the file it points to (run `git lfs pull`)"),
    ("empty.pth", b"", "an empty file"),
    ("archive.pth", b"\x1f\x8b\x08\x00" + bytes(40), "a gzip-compressed file (unpack it first)"),
    ("notes.bin", b"epoch 300, top-1 76.1\n", "a text file (it starts 'epoch 300, top-1 76.1')"),
]


@pytest.mark.parametrize("name, content, what", NEITHER, ids=[n[0] for n in NEITHER])
def test_a_file_that_is_neither_is_refused_naming_what_it_looks_like(name, content, what, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as refused:
        load_weights_file(path)
    assert str(refused.value) == f"{path} is neither a PyTorch checkpoint nor a safetensors file: it looks like {what}"


def test_a_safetensors_file_cut_short_is_named_so(files, tmp_path):
    path = tmp_path / "cut.pth"
    path.write_bytes(open(files["safetensors"], "rb").read()[:100])
    with pytest.raises(CheckpointError, match=r"it looks like a safetensors file cut short \(its header alone is \d+ "
                                              r"bytes, the file 100\)$"):
        load_weights_file(path)


def test_predict_loads_either_format_under_the_others_name(files, digits, tmp_path, capsys):
    from vim_ds.cli.predict import main, parse_args, predict

    image = os.path.join(digits, "val", "3", sorted(os.listdir(os.path.join(digits, "val", "3")))[0])

    def run(weights, *arch):
        return predict(parse_args([image, "--weights", weights, "--topk", "10", *arch]))[0][1]

    expected = run(files["torch"], *ARCH)
    assert run(files["safetensors"]) == expected  # a converted file describes its model: no --model needed
    assert run(files["safetensors_as_pth"]) == expected  # ... also renamed
    assert run(files["torch_as_safetensors"], *ARCH) == expected
    page = tmp_path / "vim_t_midclstok_76p1acc.pth"
    page.write_bytes(NEITHER[0][1])
    assert main([image, "--weights", str(page), *ARCH]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vim-ds predict: error: {page} is neither a PyTorch checkpoint nor a safetensors file: it looks like an HTML "
        f"page (a download that returned a web page instead of the file?)")


def train_args(data, out, *extra):
    return ["--data-set", "folder", "--data-path", data, "--output_dir", str(out), "--num_workers", "0", *TINY,
            *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32", "--batch-size", "8",
            "--no-model-ema", "--no-repeated-aug", *extra]


@pytest.mark.slow  # two short training runs and an evaluation: ~12 s on 2 busy cores
@pytest.mark.parametrize("name", ["safetensors_as_pth", "torch_as_safetensors"])
def test_finetune_from_either_format_under_the_others_name(files, digits, tmp_path, name):
    from vim_ds.checkpoint.consolidate import fp32_state_dict

    data = digits80(digits, tmp_path / "data")
    out = tmp_path / "ft"
    run_train(train_args(data, out, "--finetune", files[name], "--max-steps", "1", "--lr", "1e-12", "--unscale-lr",
                         "--warmup-epochs", "0", "--save-interval", "1"))
    trained = fp32_state_dict(str(out / "checkpoints"), "global_step1")
    state = files["state"]
    for key in ("layers.1.mixer.in_proj.weight", "patch_embed.proj.weight", "head.weight", "pos_embed"):
        torch.testing.assert_close(trained[key], state[key], rtol=1e-6, atol=1e-8, msg=key)
    if name == "safetensors_as_pth":  # and eval --resume FILE, the same file: the same scores as the original
        scores = []
        for weights in (files["safetensors"], files[name]):
            scored = tmp_path / f"eval_{os.path.basename(weights)}"
            run_train(["--data-set", "folder", "--data-path", data, "--output_dir", scored, "--num_workers", "0",
                       *TINY, "--resume", weights], module="vim_ds.eval")
            scores.append({k: v for k, v in evals(scored)[-1].items() if k.startswith("eval_")})
        assert scores[0] == scores[1] and scores[0]["eval_images"] == 30


def test_a_weights_file_under_another_name_given_to_resume_is_pointed_to_finetune(files, digits, tmp_path):
    """A variant: --resume decided by the name alone that a `.ckpt` file was a missing checkpoint directory."""
    renamed = tmp_path / "vim_t.ckpt"
    shutil.copy(files["safetensors"], renamed)
    proc = run_train(train_args(digits, tmp_path / "out", "--resume", renamed, "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert error_line(proc) == (f"vim-ds train: error (rank 0): --resume {renamed}: a weights file has no optimizer "
                                f"state; use --finetune {renamed} to start from it (or --eval to evaluate it)")
