"""Faults that used to end in a traceback or a wrong cause: each is one line on stderr naming the real cause, a
non-zero exit (2: bad input), found before the first training step where it can be, and nothing lost or left
behind. Real runs of the trainer (one rank), real checkpoints, real files and mounts."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import pytest
import torch

import preloaded
from train_utils import QUIET_AUG, TINY, config, run_train

ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]


def train_args(data, out, cfg="zero1", *extra) -> list:
    return ["--data-set", "folder", "--data-path", data, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", cfg if cfg.endswith(".json") else config(cfg),
            "--precision", "fp32", "--batch-size", "8", "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0",
            "--no-model-ema", *extra]


def only_error_line(proc, prog: str = "vim-ds train") -> str:
    """The one error line of a run that failed: exactly one `PROG: error` line, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def snapshot(folder) -> dict:
    """Every file under `folder` with its size and modification time (but the output folder's lock, which each run
    takes and empties)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name == ".vim_ds.lock":
                continue
            stat = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def zero1_run(digits, tmp_path_factory):
    """One step of ZeRO-1 fp32 on one rank, checkpointed (global_step1)."""
    out = tmp_path_factory.mktemp("zero1") / "run"
    run_train(train_args(digits, out, "zero1", "--max-steps", "1"))
    return out


def resumed_copy(zero1_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(zero1_run, out, ignore=shutil.ignore_patterns(".vim_ds.lock"))
    return out, str(out / "checkpoints" / "global_step1")


# -- 1. resuming a checkpoint of another ZeRO stage, precision or model -----------------------------------------


@pytest.mark.slow
def test_resume_with_another_stage_precision_or_model_is_one_line_before_deepspeed_loads(zero1_run, digits,
                                                                                          tmp_path):
    out, tag = resumed_copy(zero1_run, tmp_path)
    before = snapshot(out)
    # DeepSpeed said: AssertionError
    proc = run_train(train_args(digits, out, "zero3", "--max-steps", "2", "--resume", "auto"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (
        f"vim-ds train: error (rank 0): {tag} was saved by ZeRO-1 fp32 on 1 rank; this run uses ZeRO-3 fp32, and "
        f"DeepSpeed cannot load the optimizer state of one into the other: resume with a ZeRO-1 --deepspeed_config")
    # DeepSpeed said: No such file or directory: .../bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt
    proc = run_train(train_args(digits, out, "zero1", "--max-steps", "2", "--resume", tag, "--precision", "bf16"),
                     check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (
        f"vim-ds train: error (rank 0): {tag} was saved by ZeRO-1 fp32 on 1 rank; this run uses ZeRO-1 bf16, and "
        f"DeepSpeed cannot load the optimizer state of one into the other: resume with a ZeRO-1 --deepspeed_config "
        f"and --precision fp32, or convert it with `vim-ds convert --universal {tag}` and resume {tag}_universal")
    # DeepSpeed said: Error(s) in loading state_dict for VisionMamba: (the rest cut off)
    wider = ["--model-kwargs", "depth=2", "embed_dim=48", "patch_size=4", "stride=4"]
    proc = run_train(train_args(digits, out, "zero1", "--max-steps", "2", "--resume", "auto", *wider), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (
        f"vim-ds train: error (rank 0): {tag} holds another model (cls_token: (1, 1, 32) there, (1, 1, 48) in this "
        f"run and 39 more): it was vim_tiny depth=2 embed_dim=32 patch_size=4 stride=4, 10 classes, input size 32; "
        f"this run builds vim_tiny depth=2 embed_dim=48 patch_size=4 stride=4, 10 classes, input size 32; resume "
        f"with its --model, --model-kwargs, --input-size and data")
    assert snapshot(out) == before  # nothing written: no metrics, no universal copy, the checkpoint untouched

    # the controls: what DeepSpeed does load is not refused (ZeRO-1 and ZeRO-2 share their optimizer in fp32), and
    # the conversion the message proposes resumes in bf16
    proc = run_train(train_args(digits, out, "zero2", "--max-steps", "2", "--resume", "auto"))
    assert "at epoch 0, step 1" in proc.stdout
    preloaded.run([sys.executable, "-m", "vim_ds.convert", "--universal", tag], check=True, capture_output=True)
    proc = run_train(train_args(digits, tmp_path / "bf16", "zero1", "--max-steps", "2", "--resume", f"{tag}_universal",
                                "--precision", "bf16"))
    assert "at epoch 0, step 1" in proc.stdout


@pytest.mark.parametrize("saved, run, world, refused", [
    ((1, "fp32"), (2, "fp32"), 1, False),      # one optimizer (DeepSpeedZeroOptimizer), one file name
    ((2, "fp32"), (1, "autocast-bf16"), 1, False),
    ((1, "bf16"), (2, "bf16"), 1, False),      # BF16_Optimizer keeps DeepSpeedZeroOptimizer's keys
    ((1, "fp32"), (3, "fp32"), 1, True),
    ((3, "fp32"), (1, "fp32"), 1, True),
    ((0, "fp32"), (1, "fp32"), 1, True),
    ((2, "fp32"), (2, "bf16"), 1, True),       # bf16 on reads bf16_zero_pp_rank_* files only
    ((3, "bf16"), (3, "fp32"), 1, True),
    ((1, "bf16"), (1, "fp32"), 1, True),
    ((1, "fp32"), (1, "bf16"), 2, False),      # another rank count: through the universal checkpoint, any precision
    ((1, "bf16"), (2, "fp32"), 2, False),
    ((1, "fp32"), (3, "fp32"), 2, True),       # ... which ZeRO-3 cannot load
    ((3, "fp32"), (3, "bf16"), 2, False),
    ((0, "bf16"), (0, "bf16"), 2, False),      # ZeRO-0 state is whole: any rank count
])
def test_which_stage_and_precision_changes_are_refused(tmp_path, saved, run, world, refused):
    """The table behind the refusals (each refused pair fails inside DeepSpeed 0.19.8's loader; each allowed one
    loads: tried on CPU)."""
    from vim_ds.engine.resume_check import _optimizer_refusal

    state = {"zero_stage": saved[0], "precision": saved[1], "world_size": 1}
    universal = world != state["world_size"] and saved[0] > 0  # as parts.plan_resume decides
    problem = _optimizer_refusal(str(tmp_path), state, run[0], run[1], universal)
    assert bool(problem) == refused, problem
    if problem:
        assert "\n" not in problem and f"resume with a ZeRO-{saved[0]} --deepspeed_config" in problem


# -- 2. a DeepSpeed config whose optimizer DeepSpeed would fail on ------------------------------------------------


@pytest.mark.slow
def test_an_unsupported_optimizer_or_a_string_lr_is_one_line_before_the_engine(digits, tmp_path):
    base = json.load(open(config("zero1")))
    lion, text_lr = tmp_path / "lion.json", tmp_path / "text_lr.json"
    json.dump({**base, "optimizer": {"type": "Lion", "params": {"lr": "auto"}}}, open(lion, "w"))
    json.dump({**base, "optimizer": {"type": "AdamW", "params": {**base["optimizer"]["params"], "lr": "0.001"}}},
              open(text_lr, "w"))
    proc = run_train(train_args(digits, tmp_path / "a", str(lion), "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (
        f"vim-ds train: error (rank 0): {lion}: optimizer.type \"Lion\" is not supported; use \"AdamW\" (or "
        f"\"Adam\"): vim_ds's recipe, its ddp/fsdp baselines and its resume checks are built on Adam's moments")
    proc = run_train(train_args(digits, tmp_path / "b", str(text_lr), "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (f"vim-ds train: error (rank 0): {text_lr}: optimizer.params.lr must be a number "
                                     f"or \"auto\", not \"0.001\"")
    assert not os.path.exists(tmp_path / "b" / "metrics.jsonl")  # refused before anything trained


# -- 3. a decompression bomb among the images given to predict ----------------------------------------------------


def png_declaring(width: int, height: int) -> bytes:
    """A 119-byte PNG whose header declares width x height 1-bit pixels: PIL refuses it when it is opened."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * (1 + width // 8) * 16)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A classifier's weights ({"model": state_dict}, 10 classes) and the same without its head (a backbone)."""
    import timm

    import vim_ds  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)
    folder = tmp_path_factory.mktemp("weights")
    state = model.state_dict()
    torch.save({"model": state}, folder / "classifier.pth")
    torch.save({"model": {k: v for k, v in state.items() if not k.startswith("head.")}}, folder / "backbone.pth")
    return str(folder / "classifier.pth"), str(folder / "backbone.pth")


def test_a_decompression_bomb_is_one_unreadable_image_and_the_others_are_predicted(weights, digits, tmp_path, capsys):
    from PIL import Image

    from vim_ds.cli.predict import main

    bomb = tmp_path / "bomb.png"
    side = 20000  # 4e8 pixels: more than twice PIL's limit, which makes it an error rather than a warning
    assert side * side > 2 * Image.MAX_IMAGE_PIXELS
    bomb.write_bytes(png_declaring(side, side))
    good = [os.path.join(digits, "val", c, sorted(os.listdir(os.path.join(digits, "val", c)))[0]) for c in "37"]
    assert main([good[0], str(bomb), good[1], "--weights", weights[0], *ARCH]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"vim-ds predict: error: cannot read image {bomb} (DecompressionBombError: Image size ({side * side} pixels) "
        f"exceeds limit of {2 * Image.MAX_IMAGE_PIXELS} pixels, could be decompression bomb DOS attack.)"]
    assert [line.split(": ")[0] for line in out.splitlines()] == good  # the others, in order


# -- 4. a --data-path that is a file -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_data_path_that_is_a_file_says_so(digits, tmp_path):
    archive = tmp_path / "digits.tar"
    archive.write_bytes(b"not a folder")
    proc = run_train(train_args(str(archive), tmp_path / "out", "zero0", "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (f"vim-ds train: error (rank 0): data path {archive} is a file, not a folder "
                                     f"(expected {archive}/train/<class>/* and {archive}/val/<class>/*)")


# -- 5. checkpoints that cannot be written -------------------------------------------------------------------------


@pytest.fixture
def read_only_checkpoints(tmp_path):
    """OUT/checkpoints as a read-only bind mount of itself: refused to root too (chmod is not), as a read-only
    disk or a full quota would be. Mounting needs root (CI and this machine have it); elsewhere the test skips."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for command in (["mount", "--bind", str(folder), str(folder)],
                    ["mount", "-o", "remount,bind,ro", str(folder), str(folder)]):
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {proc.stderr.strip()}")
    yield tmp_path / "run"
    subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_unwritable_checkpoints_are_refused_before_the_first_step(digits, read_only_checkpoints):
    out = read_only_checkpoints
    with pytest.raises(OSError):  # the fault is real
        (out / "checkpoints" / "x").write_text("x")
    proc = run_train(train_args(digits, out, "zero0", "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (f"vim-ds train: error (rank 0): cannot write checkpoints to {out}/checkpoints: "
                                     f"Read-only file system; give a writable --output_dir")
    assert not os.path.exists(out / "metrics.jsonl")  # no step was trained for nothing


@pytest.mark.slow
def test_a_file_named_checkpoints_is_refused_before_the_first_step(digits, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("notes")
    proc = run_train(train_args(digits, out, "zero0", "--max-steps", "1"), check=False)
    assert proc.returncode == 2
    assert only_error_line(proc) == (f"vim-ds train: error (rank 0): {out}/checkpoints is a file, not a folder; move "
                                     f"it away or give another --output_dir")
    assert (out / "checkpoints").read_text() == "notes" and not os.path.exists(out / "metrics.jsonl")


# -- 6. convert into an existing folder ----------------------------------------------------------------------------


@pytest.mark.slow
def test_convert_into_a_folder_is_refused_and_leaves_nothing(zero1_run, tmp_path):
    target = tmp_path / "weights"
    target.mkdir()
    proc = preloaded.run([sys.executable, "-m", "vim_ds.convert", str(zero1_run), str(target)], capture_output=True,
                         text=True)
    assert proc.returncode == 2
    assert only_error_line(proc, "vim-ds convert") == (
        f"vim-ds convert: error: {target} is a folder: OUT is the file to write, e.g. {target}/weights.pth")
    assert sorted(os.listdir(tmp_path)) == ["weights"] and not os.listdir(target)  # no temporary file left


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """Whatever fails while the file is written (here: a folder where the file goes), the temporary is removed."""
    from vim_ds.checkpoint.convert import write_weights_file
    from vim_ds.checkpoint.files import CheckpointError

    (tmp_path / "out.pth").mkdir()
    with pytest.raises(CheckpointError, match=f"^cannot write {tmp_path / 'out.pth'}: Is a directory$"):
        write_weights_file(str(tmp_path / "out.pth"), {"w": torch.zeros(2)}, {"model": "vim_tiny"})
    assert os.listdir(tmp_path) == ["out.pth"]


# -- 7. weights without a classification head ----------------------------------------------------------------------


def test_weights_without_a_head_are_refused_by_predict_and_export(weights, digits, tmp_path, capsys):
    from vim_ds.cli.export import main as export
    from vim_ds.cli.predict import main as predict

    backbone = weights[1]
    image = os.path.join(digits, "val", "0", sorted(os.listdir(os.path.join(digits, "val", "0")))[0])
    assert predict([image, "--weights", backbone, *ARCH]) == 2
    out, err = capsys.readouterr()
    assert not out and err.splitlines() == [
        f"vim-ds predict: error: {backbone} has no classification head (no head.weight): it holds a backbone, and a "
        f"random head would classify in its place; give the weights of a trained classifier"]
    program = tmp_path / "model.pt2"
    assert export(["--weights", backbone, "--out", str(program), *ARCH]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vim-ds export: error: {backbone} has no classification head (no head.weight): it holds a backbone, and a "
        f"random head would classify in its place; give the weights of a trained classifier; or pass "
        f"--num-classes 0 to export the backbone's features"]
    assert not program.exists()
    # the control: asked for explicitly, the backbone's features are exported
    assert export(["--weights", backbone, "--out", str(program), "--num-classes", "0", *ARCH]) == 0
    assert "-> pooled features (no head)" in capsys.readouterr().out
    features = torch.export.load(str(program)).module()(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, 32)


# -- issue 50, item 13: VIM_DS_* variables with a value they do not accept ----------------------------------------

def test_a_junk_fault_injection_is_one_line_before_anything_starts(tmp_path):
    """VIM_DS_INJECT=garbage was a ValueError traceback of an import (the variable was read when the trainer's modules
    were imported); now every rank says it in one line before anything starts, and nothing is written."""
    out = tmp_path / "run"
    proc = run_train(["--data-set", "synthetic", "--synthetic-size", 16, "--nb-classes", 4, *TINY, "--num_workers",
                      0, "--output_dir", out], check=False, env={"VIM_DS_INJECT": "garbage"})
    assert proc.returncode == 2
    assert only_error_line(proc).startswith(
        "vim-ds train: error (rank 0): VIM_DS_INJECT: cannot read 'garbage' (expected FAULT@STEP[:RANK], FAULT one "
        "of nan_loss, ")
    assert not out.exists() and "DeepSpeed" not in proc.stdout


JUNK = {  # variable: (a value it does not accept, what the one line says it accepts)
    "VIM_DS_SCAN": ("fast", "VIM_DS_SCAN='fast' is not a scan backend; choose one of ref, cpu, cuda, mamba"),
    "VIM_DS_NORM": ("fused", "VIM_DS_NORM=fused: expected ref (PyTorch's composition) or triton (the fused kernel), "
                             "or leave it unset"),
    "VIM_DS_CPU_ISA": ("avx9000", "VIM_DS_CPU_ISA=avx9000: selective_scan (cpu): instruction set 'avx9000' is not "
                                  "available on this CPU; choose auto or "),
    "VIM_DS_JIT": ("no", "VIM_DS_JIT=no: expected 0 or 1 (0: never JIT-build a missing kernel), or leave it unset"),
    "VIM_DS_JIT_VERBOSE": ("yes", "VIM_DS_JIT_VERBOSE=yes: expected 0 or 1 (1: show the compiler's output of a JIT "
                                  "build)"),
    "VIM_DS_NO_TMPFILE": ("true", "VIM_DS_NO_TMPFILE=true: expected 0 or 1 (1: write files through a named temporary "
                                  "instead of O_TMPFILE)"),
    "VIM_DS_TRACEBACK": ("on", "VIM_DS_TRACEBACK=on: expected 0 or 1 (1: print the traceback above a one-line "
                               "error)"),
    "VIM_DS_INJECT": ("nan_loss@five", "VIM_DS_INJECT: cannot read 'nan_loss@five' (expected FAULT@STEP[:RANK]"),
    "VIM_DS_INJECT_SIGNAL": ("SIGKILL", "VIM_DS_INJECT_SIGNAL: cannot read SIGKILL (expected SIGTERM or SIGINT, "
                                        "optionally followed by :rank)"),
    "VIM_DS_CACHE": (None, "is a file: it names a folder (where JIT-built kernels are kept)"),
    "VIM_DS_RECORD_BATCHES": (None, "is a file: it names a folder (where each training micro batch is saved)"),
}


def test_every_vim_ds_variable_names_what_it_accepts(tmp_path, monkeypatch):
    """Each variable vim_ds reads, with a junk value, is one line naming it and what it accepts (a folder given as
    a file: the file); every value it accepts passes (the CPU kernel's `auto`: a check that loads the kernel applies
    the variable, for this whole process)."""
    from vim_ds.runtime import env_vars

    assert sorted(JUNK) == sorted(env_vars.VARIABLES)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for name, (junk, words) in JUNK.items():
        monkeypatch.setenv(name, str(a_file) if junk is None else junk)
        assert words in (env_vars.problem() or ""), name
        monkeypatch.delenv(name)
    accepted = {"VIM_DS_SCAN": "ref", "VIM_DS_NORM": "triton", "VIM_DS_CPU_ISA": "auto", "VIM_DS_JIT": "0",
                "VIM_DS_JIT_VERBOSE": "1", "VIM_DS_NO_TMPFILE": "1", "VIM_DS_TRACEBACK": "0",
                "VIM_DS_INJECT": "nan_loss@5,hang@3:1",
                "VIM_DS_INJECT_SIGNAL": "SIGINT:rank", "VIM_DS_CACHE": str(tmp_path / "new"),
                "VIM_DS_RECORD_BATCHES": str(tmp_path)}
    for name, value in accepted.items():
        monkeypatch.setenv(name, value)
    assert env_vars.problem() is None


def test_a_junk_switch_is_refused_by_the_command_that_reads_it(tmp_path, monkeypatch, capsys):
    """The variant: VIM_DS_NO_TMPFILE=yes, which `vim-ds convert` read as off without a word, is its one-line error
    now, before anything is read (the checkpoint folder is not even looked at) or written."""
    from vim_ds.cli.convert import main as convert

    monkeypatch.setenv("VIM_DS_NO_TMPFILE", "yes")
    assert convert([str(tmp_path / "checkpoints"), str(tmp_path / "w.pth")]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == ["vim-ds convert: error: VIM_DS_NO_TMPFILE=yes: expected 0 or 1 (1: write files "
                                "through a named temporary instead of O_TMPFILE), or leave it unset"]
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv("VIM_DS_NO_TMPFILE", "1")  # the control: accepted, and convert goes on to its own checks
    assert convert([str(tmp_path / "checkpoints"), str(tmp_path / "w.pth")]) == 2
    assert "VIM_DS_NO_TMPFILE" not in capsys.readouterr().err
