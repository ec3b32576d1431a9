"""Labels that would silently mean other classes: a class folder renamed (`train/3` and `val/3` to `z3`: the same
count of classes, another sorted order) between a run and what uses its weights again. The class names are recorded
in every checkpoint and converted file and compared, name by name and in order, on resume, finetune, eval and
predict: one line that shows the difference, exit 2, nothing written. Real 2-rank runs (the suite's shared ZeRO-0
run), real conversions, the real commands."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from train_utils import TINY, config_run_args, digits80, run_train

DIGITS = [str(i) for i in range(10)]
SHIFTED = ["0", "1", "2", "4", "5", "6", "7", "8", "9", "z3"]


def only_error_line(proc, prog: str = "vim-ds train") -> str:
    """The one error line of a refused command (every rank that prints one prints the same line), no traceback."""
    lines = {line.split("): ", 1)[-1] for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error")}
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines.pop()


def snapshot(folder) -> dict:
    """Every file under `folder` with its size and modification time (but the output folder's lock)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name != ".vim_ds.lock":
                stat = os.stat(os.path.join(root, name))
                out[os.path.relpath(os.path.join(root, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def renamed_copy(digits, root, rename: tuple | None = ("3", "z3"), drop: str | None = None) -> str:
    """A small copy of the digits (digits80) with a class renamed (or one removed) in train/ and val/, as a user
    would."""
    data = digits80(digits, root)
    for split in ("train", "val"):
        if rename:
            os.rename(os.path.join(data, split, rename[0]), os.path.join(data, split, rename[1]))
        if drop:
            shutil.rmtree(os.path.join(data, split, drop))
    return data


@pytest.fixture(scope="module")
def zero0(config_run):
    """The suite's shared 3-step 2-rank ZeRO-0 run on the digits (a checkpoint after every step)."""
    return config_run("zero0")


@pytest.fixture(scope="module")
def converted(zero0, tmp_path_factory):
    """Its last checkpoint converted by `vim-ds convert` (in-process: the same function), .pth and .safetensors."""
    from vim_ds.checkpoint.convert import convert

    folder = tmp_path_factory.mktemp("converted")
    files = {}
    for ext in ("pth", "safetensors"):
        files[ext] = str(folder / f"w.{ext}")
        convert(os.path.join(zero0, "checkpoints"), files[ext])
    return files


# -- the message ---------------------------------------------------------------------------------------------------


def test_the_difference_is_shown_by_name_and_by_what_it_does_to_the_labels():
    from vim_ds.checkpoint.class_names import refusal

    fix = "resume with the data it was trained on"
    assert refusal("T", DIGITS, "--data-path D", SHIFTED, fix) == (
        "T was trained on 10 classes 0..9; --data-path D has 0,1,2,4..9,z3: class 3 is missing here and z3 is new "
        "(labels 3-9 would shift by one); resume with the data it was trained on")
    # the same names in another order (a --classes file, an edited shard index): a folder always sorts them
    assert refusal("T", DIGITS, "--classes F", ["1", "0", *DIGITS[2:]], fix) == (
        "T was trained on 10 classes 0..9; --classes F has 1,0,2..9: the same 10 names in another order (label 0 "
        "was 0, here 1, and 1 more label differs); resume with the data it was trained on")
    # renamed where it sorts in the same place: no label moves, but label 3 now has another name
    assert "class 3 is missing here and 3b is new (label 3 was 3, here 3b)" in \
        refusal("T", DIGITS, "D", [*DIGITS[:3], "3b", *DIGITS[4:]], fix)
    assert "D has 9 classes 0..8: class 9 is missing here;" in refusal("T", DIGITS, "D", DIGITS[:9], fix)
    # nothing to compare: the same names, or a checkpoint that records none (older vim_ds, published files)
    assert refusal("T", DIGITS, "D", list(DIGITS), fix) is None and refusal("T", None, "D", DIGITS, fix) is None


# -- resume --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resume_onto_renamed_class_folders_is_refused_before_the_engine(zero0, digits, tmp_path):
    from vim_ds.checkpoint.convert import client_state
    from vim_ds.data.shards import write_shards

    assert client_state(os.path.join(zero0, "checkpoints", "global_step3"), mmap=True)["classes"] == DIGITS
    out = tmp_path / "run"
    shutil.copytree(zero0, out, ignore=shutil.ignore_patterns(".vim_ds.lock"))
    tag = out / "checkpoints" / "global_step3"
    data = renamed_copy(digits, tmp_path / "renamed")
    before = snapshot(out)
    # before: resumed at step 3 and trained on, labels 3-9 meaning the next class
    proc = run_train(config_run_args(data, out, "zero0", "--max-steps", 4, "--resume", "auto"), nproc=2, check=False)
    assert proc.returncode != 0  # torchrun's 1: its ranks' 2 (bad input)
    assert only_error_line(proc) == (
        f"{tag} was trained on 10 classes 0..9; --data-path {data} has 0,1,2,4..9,z3: class 3 is missing here and "
        f"z3 is new (labels 3-9 would shift by one); resume with the data it was trained on")
    # the variant: the same renamed data read from shards (`vim-ds data shard`), another reader, the same labels
    shards = str(tmp_path / "shards")
    write_shards(data, shards)
    proc = run_train(config_run_args(shards, out, "zero0", "--data-set", "shards", "--max-steps", 4,
                                     "--resume", str(tag)), nproc=2, check=False)
    assert proc.returncode != 0
    assert only_error_line(proc) == (
        f"{tag} was trained on 10 classes 0..9; --data-path {shards} has 0,1,2,4..9,z3: class 3 is missing here "
        f"and z3 is new (labels 3-9 would shift by one); resume with the data it was trained on")
    assert snapshot(out) == before  # nothing written: no metrics, no options, the checkpoints untouched


def test_a_checkpoint_without_recorded_names_resumes_with_one_note(zero0, digits, tmp_path):
    """A checkpoint of vim_ds before the names were recorded: compared as before (model, stage), with a note."""
    import argparse

    from vim_ds.checkpoint.convert import client_state
    from vim_ds.engine.resume_check import check
    from vim_ds.models import ModelConfig

    tag = tmp_path / "global_step3"
    shutil.copytree(os.path.join(zero0, "checkpoints", "global_step3"), tag)
    state_file = tag / "mp_rank_00_model_states.pt"
    state = torch.load(state_file, weights_only=False)
    del state["classes"]
    torch.save(state, state_file)
    model = ModelConfig("vim_tiny", 10, 32, client_state(str(tag))["model_kwargs"])
    source = f"--data-path {tmp_path / 'renamed'}"
    ds = argparse.Namespace(zero_stage=0, precision="fp32")  # what check reads of the prepared DeepSpeed config
    note = check(str(tag), model, source, ds, universal=False, classes=SHIFTED)
    assert note == (f"note: {tag} records no class names (saved by an earlier vim_ds): {source} "
                    f"is taken to have the classes it was trained on, in the same order; its checkpoints from now on "
                    f"record them")
    # a caller without the data's names: no note
    assert check(str(tag), model, source, ds, universal=False, classes=None) is None


# -- convert and predict -------------------------------------------------------------------------------------------


def test_convert_records_the_names_and_predict_checks_them(converted, digits, tmp_path, capsys):
    from safetensors import safe_open

    from vim_ds.checkpoint.convert import read_vim_ds_meta, write_weights_file
    from vim_ds.cli.predict import main as predict

    assert torch.load(converted["pth"], weights_only=True)["vim_ds"]["classes"] == DIGITS
    with safe_open(converted["safetensors"], framework="pt") as f:
        assert json.loads(f.metadata()["classes"]) == DIGITS
    assert read_vim_ds_meta(converted["safetensors"])["classes"] == DIGITS
    images = [os.path.join(digits, "val", c, sorted(os.listdir(os.path.join(digits, "val", c)))[0]) for c in "37"]

    # the folder it was trained on: accepted; a renamed one: refused, for either file
    assert predict([*images, "--weights", converted["pth"], "--classes", os.path.join(digits, "train")]) == 0
    right = capsys.readouterr().out
    renamed = os.path.join(renamed_copy(digits, tmp_path / "renamed"), "train")
    for path in converted.values():
        assert predict([*images, "--weights", path, "--classes", renamed]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"vim-ds predict: error: {path} was trained on 10 classes 0..9; --classes {renamed} has 0,1,2,4..9,z3: "
            f"class 3 is missing here and z3 is new (labels 3-9 would shift by one); give --classes the classes it "
            f"was trained on, or leave --classes out (the file records their names)"]
    # the variant: a file of the same names in another order
    names = tmp_path / "names.txt"
    names.write_text("\n".join(["1", "0", *DIGITS[2:]]) + "\n")
    assert predict([*images, "--weights", converted["pth"], "--classes", str(names)]) == 2
    assert "the same 10 names in another order (label 0 was 0, here 1, and 1 more label differs)" in \
        capsys.readouterr().err

    # without --classes: the names the file records (here: a file as convert writes it, with names not its indices)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    state = torch.load(converted["pth"], weights_only=True)
    named = str(tmp_path / "named.safetensors")
    write_weights_file(named, state["model"], {**state["vim_ds"], "classes": words})
    assert predict([*images, "--weights", named]) == 0
    out = capsys.readouterr().out
    assert [[entry.rsplit(" ", 1)[0] for entry in line.split(": ", 1)[1].split(", ")] for line in out.splitlines()] \
        == [[words[int(name)] for name in [e.rsplit(" ", 1)[0] for e in line.split(": ", 1)[1].split(", ")]]
            for line in right.splitlines()]
    # a file of other names altogether (display names) is taken in label order, with a note
    (tmp_path / "display.txt").write_text("\n".join(n.upper() for n in words) + "\n")
    assert predict([*images, "--weights", named, "--classes", str(tmp_path / "display.txt")]) == 0
    out, err = capsys.readouterr()
    assert "ZERO" in out or "THREE" in out
    assert err.startswith(f"note: --classes {tmp_path / 'display.txt'} names none of the classes {named} records")
    # a file without recorded names (converted before, published, timm's): as before, the folder is not compared
    old = str(tmp_path / "old.pth")
    torch.save({"model": state["model"], "vim_ds": {k: v for k, v in state["vim_ds"].items() if k != "classes"}}, old)
    assert predict([*images, "--weights", old, "--classes", renamed]) == 0
    published = str(tmp_path / "published.pth")  # no description at all: the model from the options
    torch.save({"model": state["model"]}, published)
    assert predict([*images, "--weights", published, "--classes", renamed, "--model", "vim_tiny", "--model-kwargs",
                    "depth=2", "embed_dim=32", "patch_size=4", "stride=4", "--input-size", "32"]) == 0
    assert capsys.readouterr().err == ""


# -- eval ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_on_renamed_class_folders_is_refused(zero0, converted, digits, tmp_path):
    data = renamed_copy(digits, tmp_path / "renamed")
    tag = os.path.join(zero0, "checkpoints", "global_step3")
    for source in (tag, converted["safetensors"]):  # a checkpoint, and (the variant) a converted file
        proc = run_train(["--data-set", "folder", "--data-path", data, "--output_dir", str(tmp_path / "eval"),
                          "--num_workers", "0", *TINY, "--precision", "fp32", "--resume", source], nproc=1,
                         module="vim_ds.eval", check=False)
        assert proc.returncode == 2
        assert only_error_line(proc, "vim-ds eval") == (
            f"{source} was trained on 10 classes 0..9; --data-path {data} has 0,1,2,4..9,z3: class 3 is missing here "
            f"and z3 is new (labels 3-9 would shift by one); evaluate it on the data it was trained on")
    assert not os.path.exists(tmp_path / "eval" / "metrics.jsonl")  # no score of other classes' images


# -- finetune ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_finetune_onto_renamed_classes_is_refused_and_onto_another_count_starts_a_fresh_head(converted, digits,
                                                                                             tmp_path):
    from vim_ds.checkpoint.convert import client_state

    def finetune(data, out, *extra):
        return run_train(config_run_args(data, out, "zero0", "--max-steps", 1, "--finetune", converted["pth"],
                                         "--no-model-ema", *extra), nproc=1, check=False)

    renamed = renamed_copy(digits, tmp_path / "renamed")
    proc = finetune(renamed, tmp_path / "refused")
    assert proc.returncode == 2
    assert only_error_line(proc) == (
        f"--finetune {converted['pth']} was trained on 10 classes 0..9; --data-path {renamed} has 0,1,2,4..9,z3: "
        f"class 3 is missing here and z3 is new (labels 3-9 would shift by one); its head's rows would start on "
        f"other classes; finetune on data with its class names in its order (rename the folders back)")
    assert not os.path.exists(tmp_path / "refused")  # a refused run leaves no folder
    # another class count: the head is re-initialised (as before), and the run records its own names
    nine = renamed_copy(digits, tmp_path / "nine", rename=None, drop="9")
    proc = finetune(nine, tmp_path / "nine_run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert client_state(str(tmp_path / "nine_run" / "checkpoints" / "global_step1"), mmap=True)["classes"] == \
        DIGITS[:9]


def test_finetune_onto_other_names_of_the_same_count_starts_a_fresh_head(converted):
    """Another task with as many classes (no name in common): the file's head rows mean nothing there; the head
    starts afresh, as for another count, and a note says so."""
    import timm

    import vim_ds  # noqa: F401
    from vim_ds.checkpoint.class_names import load_finetune_weights

    def model():
        torch.manual_seed(0)
        return timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4,
                                 stride=4)

    saved = torch.load(converted["pth"], weights_only=True)["model"]
    letters = list("abcdefghij")
    fresh = model()
    note = load_finetune_weights(fresh, converted["pth"], letters, "--data-path L")
    assert note == (f"note: --finetune {converted['pth']} was trained on other classes (0..9) than --data-path L "
                    f"has (a,b,c,d,e,f,g,h,i,j): its head is not used, the head starts afresh")
    assert not torch.equal(fresh.head.weight, saved["head.weight"])
    assert torch.equal(fresh.patch_embed.proj.weight, saved["patch_embed.proj.weight"])  # the rest: the file's
    same = model()
    assert load_finetune_weights(same, converted["pth"], DIGITS, "--data-path D") is None  # its own names: all kept
    assert torch.equal(same.head.weight, saved["head.weight"])


# -- names listed twice, names that print alike, --classes files as editors write them (issue 50) --------------------


def test_a_name_listed_twice_or_printing_alike_is_said_so():
    """11 names for 10 classes used to be `the same 10 names in another order`; a name in NFD where the checkpoint
    has it in NFC was `class zéro is missing here and zéro is new`."""
    from vim_ds.checkpoint.class_names import refusal

    fix = "give --classes the classes it was trained on"
    assert refusal("T", DIGITS, "--classes F", [*DIGITS[:4], "3", *DIGITS[4:]], fix) == (
        "T was trained on 10 classes 0..9; --classes F has 11 classes 0..3,3..9: 3 is listed twice (labels 4-9 would "
        "shift by one); give --classes the classes it was trained on")
    # the variant: as many names as classes, one of them twice and so one missing
    assert refusal("T", DIGITS, "D", [*DIGITS[:4], "3", *DIGITS[5:]], fix) == (
        "T was trained on 10 classes 0..9; D has 0..3,3,5..9: class 4 is missing here and 3 is listed twice (label 4 "
        "was 4, here 3); give --classes the classes it was trained on")
    nfc, nfd = "z\u00e9ro", "ze\u0301ro"
    assert refusal("T", [*DIGITS[:9], nfc], "--data-path D", [*DIGITS[:9], nfd], fix) == (
        "T was trained on 10 classes 0..8,z\u00e9ro; --data-path D has 0..8,'ze\\u0301ro': 'ze\\u0301ro' here and "
        "z\u00e9ro there are the same letters in two Unicode forms (NFD and NFC; macOS writes names in NFD) (label 9 "
        "was z\u00e9ro, here 'ze\\u0301ro'); give --classes the classes it was trained on")
    # negative control: the same names in another order are said to be so
    assert "the same 10 names in another order" in refusal("T", DIGITS, "D", DIGITS[::-1], fix)


@pytest.fixture(scope="module")
def named_weights(tmp_path_factory):
    """A small random classifier whose file records the class names 0..9 (as `vim-ds convert` writes them), and an
    image to predict."""
    import numpy as np
    import timm
    from PIL import Image

    import vim_ds  # noqa: F401

    kwargs = {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4}
    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, **kwargs)
    folder = tmp_path_factory.mktemp("named")
    path, image = str(folder / "w.pth"), str(folder / "x.png")
    torch.save({"model": model.state_dict(), "vim_ds": {"model": "vim_tiny", "model_kwargs": kwargs,
                                                         "num_classes": 10, "input_size": 32, "classes": DIGITS}},
               path)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    return path, image


def predict_with(named_weights, classes_file, capsys) -> tuple[int, str, str]:
    from vim_ds.cli.predict import main as predict

    weights, image = named_weights
    code = predict([image, "--weights", weights, "--classes", str(classes_file)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("encoding,bom", [("utf-8", b"\xef\xbb\xbf"), ("utf-16-le", b"\xff\xfe")],
                         ids=["utf-8 BOM", "utf-16 (Notepad's Unicode)"])
def test_a_classes_file_with_a_byte_order_mark_is_read_without_it(named_weights, tmp_path, capsys, encoding, bom):
    """A BOM (Windows editors write one) used to become part of the first name: `\\ufeff0` is not class 0, and the
    file of the recorded names was refused as `class 0 is missing here and 0 is new`."""
    names = tmp_path / "names.txt"
    names.write_bytes(bom + "\r\n".join(DIGITS).encode(encoding))
    code, out, err = predict_with(named_weights, names, capsys)
    assert (code, err) == (0, "") and out.count(" 0.") == 5, out + err
    names.write_bytes("\r\n".join(DIGITS).encode(encoding))  # negative control: without its BOM, UTF-16 is no UTF-8
    code, out, err = predict_with(named_weights, names, capsys)
    if encoding == "utf-8":
        assert (code, err) == (0, "")
    else:
        assert code == 2 and err == (f"vim-ds predict: error: --classes {names} holds NUL bytes: UTF-16 without a "
                                     f"byte-order mark, or not text at all; save it as UTF-8\n")


def test_a_classes_file_in_another_encoding_is_refused_in_one_line(named_weights, tmp_path, capsys):
    """Latin-1 (an older Windows editor): before, `'utf-8' codec can't decode byte 0xe9 in position 4: invalid
    continuation byte`, naming neither the file nor what to do."""
    names = tmp_path / "names.txt"
    names.write_bytes("\n".join(["cat", "dog", "z\u00e9ro", *"abcdefg"]).encode("latin-1"))
    assert predict_with(named_weights, names, capsys) == (
        2, "", f"vim-ds predict: error: --classes {names} is not UTF-8 text (byte 0xe9 at offset 9); save it as "
               f"UTF-8\n")
    names.write_text("\n".join(["cat", "dog", "z\u00e9ro", *"abcdefg"]), encoding="utf-8")  # negative control
    assert predict_with(named_weights, names, capsys)[0] == 0


@pytest.mark.parametrize("second,said", [
    ("cat", "names 'cat' twice"),  # the case
    ("cat ", "names 'cat' twice"),  # spaces at the ends are left out: the same name
    ("cat\u200b", "names 'cat' and 'cat\\u200b', the same name but for invisible characters,"),  # the variants:
    ("CAT", None),  # negative control: another name                                            # they print alike
], ids=["twice", "with a space", "zero-width space", "CAT"])
def test_a_classes_file_naming_two_labels_alike_is_refused(named_weights, tmp_path, capsys, second, said):
    """Display names (they share no name with the recorded ones): `cat` shown for two labels was accepted."""
    names = tmp_path / "names.txt"
    names.write_text("\n".join(["cat", second, "dog", *"abcdefg"]) + "\n")
    code, out, err = predict_with(named_weights, names, capsys)
    if said is None:
        assert code == 0 and err.startswith(f"note: --classes {names} names none of the classes"), err
        return
    assert (code, out) == (2, "")
    assert err == (f"vim-ds predict: error: --classes {names} {said} on lines 1 and 2: two labels would be shown "
                   f"alike; give each class a name of its own\n")


def test_a_classes_file_in_nfd_is_told_apart_from_its_nfc_twin(named_weights, tmp_path, capsys):
    nfc, nfd = "z\u00e9ro", "ze\u0301ro"
    names = tmp_path / "names.txt"
    names.write_text("\n".join([nfc, nfd, *"abcdefgh"]) + "\n", encoding="utf-8")
    code, _, err = predict_with(named_weights, names, capsys)
    assert code == 2 and err == (
        f"vim-ds predict: error: --classes {names} names 'z\u00e9ro' and 'ze\\u0301ro', the same letters in two "
        f"Unicode forms (NFC and NFD; macOS writes names in NFD), on lines 1 and 2: two labels would be shown alike; "
        f"give each class a name of its own\n")
