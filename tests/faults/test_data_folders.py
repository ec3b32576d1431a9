"""Data folders cannot mislabel (issue 27): real symlinks and hidden files in a copy of the digits ImageFolder.

A symlink loop (`ln -s .. train/0/loop` took 1,437 training images to 58,917, most labelled 0, with exit 0) and a
folder reached twice (a link into another class would list its images under two labels) are refused with one
line naming the link; links to other places (a file, a folder outside the data set, a whole class folder) are
followed once. Hidden names (`.ipynb_checkpoints`, `.DS_Store`, `._x.png`) are neither classes nor images: they
are skipped and counted in one warning, and shift no label. On a clean folder the classes and the sample order are
torchvision's ImageFolder's."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
from torchvision.datasets import ImageFolder

from data_options import dataset_config
from train_utils import QUIET_AUG, TINY, config, error_line, run_train
from vim_ds.data import DataError, build_dataset

DIGITS = [str(d) for d in range(10)]


@pytest.fixture
def data(digits, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(digits, root, symlinks=True)
    return root


def build(root, is_train=True):
    dataset, num_classes = build_dataset(dataset_config(data_set="folder", data_path=str(root), input_size=32),
                                         is_train)
    assert num_classes == len(dataset.classes)
    return dataset


def refused(root, is_train=True) -> str:
    with pytest.raises(DataError) as info:
        build(root, is_train)
    message = str(info.value)
    assert "\n" not in message
    return message


def first_images(folder, n):
    return sorted(folder.glob("*.png"))[:n]


def test_a_clean_copy_lists_what_imagefolder_lists(data, caplog):
    with caplog.at_level(logging.WARNING):
        train, val = build(data), build(data, is_train=False)
    assert train.classes == val.classes == DIGITS and len(train) == 1437 and len(val) == 360
    for dataset, split in ((train, "train"), (val, "val")):
        reference = ImageFolder(str(data / split))
        assert dataset.samples == reference.samples and dataset.class_to_idx == reference.class_to_idx
    assert not caplog.records


# ------------------------------------------------------------------------------------------------- symlink loops

@pytest.mark.parametrize("link,target,holder", [
    ("train/0/loop", "..", "train"),                  # the user's report: a link to the split folder
    ("train/0/self", ".", "train/0"),                 # a link to the folder it is in
    ("train/0/up", "../..", ""),                      # a link to the data path
    ("train/0/sub/back", "../..", "train"),           # from a sub-folder, two levels up
    ("train/zz", ".", "train"),                       # a class folder that is the split folder
    ("train/3/out", "../../..", ".."),                # a link to the folder that holds the data path
])
def test_a_link_to_a_folder_that_holds_it_is_refused(data, link, target, holder):
    path = data / link
    path.parent.mkdir(exist_ok=True)
    os.symlink(target, path)
    message = refused(data)
    # the split folder and those above it are named by their real paths, folders inside it as they were reached
    expected = str(data / holder) if holder.startswith("train/") else os.path.realpath(data / holder)
    assert message == (f"symlink loop: {path} (a symlink to {target}) leads back to {expected}, which holds it, so "
                       f"its images would be listed over and over; remove the link")
    path.unlink()  # negative control: the same folder without the link
    assert len(build(data)) == 1437


def test_a_loop_through_a_folder_outside_the_data_set_is_refused(data, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(data / "train", outside / "back")
    os.symlink(outside, data / "train" / "4" / "more")
    message = refused(data)
    assert message.startswith(f"symlink loop: {data}/train/4/more/back (a symlink to {data}/train) leads back to ")
    (outside / "back").unlink()
    assert len(build(data)) == 1437  # the outside folder holds no images now


@pytest.mark.parametrize("where", ["train/0", "train"])
def test_links_that_never_resolve_are_refused(data, where):
    folder = data / where
    os.symlink("self", folder / "self")  # a link to itself
    message = refused(data)
    assert message == f"symlink loop: {folder}/self (a symlink to self) never reaches a file or folder; remove the link"
    (folder / "self").unlink()
    os.symlink("b", folder / "a")  # two links pointing at each other
    os.symlink("a", folder / "b")
    message = refused(data)
    assert message.startswith("symlink loop: ") and "never reaches a file or folder" in message
    assert f"{folder}/a (a symlink to b)" in message or f"{folder}/b (a symlink to a)" in message
    (folder / "a").unlink()
    (folder / "b").unlink()
    assert len(build(data)) == 1437


def test_a_folder_reached_twice_is_refused(data, tmp_path):
    ones = data / "train" / "1"
    os.symlink("../1", data / "train" / "0" / "ones")  # into a sibling class: every 1 would also be labelled 0
    assert refused(data) == (f"{data}/train/0/ones (a symlink to ../1) is the same folder as {ones}: its images "
                             f"would be listed twice, under classes '1' and '0'; remove the link or copy the folder")
    (data / "train" / "0" / "ones").unlink()

    (ones / "sub").mkdir()  # into a sub-folder of a sibling class, found when that class is listed
    for image in first_images(ones, 5):
        image.rename(ones / "sub" / image.name)
    os.symlink("../1/sub", data / "train" / "0" / "x")
    assert refused(data) == (f"{ones}/sub is the same folder as {data}/train/0/x (a symlink to ../1/sub): its "
                             f"images would be listed twice, under classes '0' and '1'; remove the link or copy the "
                             f"folder")
    (data / "train" / "0" / "x").unlink()
    assert len(build(data)) == 1437  # the moved images still count once, in class 1

    outside = tmp_path / "outside"  # one outside folder linked from two places of one class
    outside.mkdir()
    os.symlink(outside, data / "train" / "5" / "a")
    os.symlink(outside, data / "train" / "5" / "b")
    message = refused(data)
    assert "is the same folder as" in message and "in class '5'" in message
    assert f"{data}/train/5/a (a symlink to {outside})" in message and f"{data}/train/5/b" in message


# -------------------------------------------------------------------------------------- links followed once

def test_links_to_other_places_are_followed_once(data, tmp_path):
    clean = build(data)
    outside = tmp_path / "outside"
    shutil.move(data / "train" / "9", outside / "nine")  # a class folder kept elsewhere, linked in
    os.symlink(outside / "nine", data / "train" / "9")
    extra = outside / "extra_threes"  # more images of a class, in a folder outside the data set
    extra.mkdir()
    for i, image in enumerate(first_images(data / "val" / "3", 4)):
        shutil.copy(image, extra / f"x{i}.png")
    os.symlink(extra, data / "train" / "3" / "extra")
    some_five = first_images(data / "val" / "5", 1)[0]  # one file linked in
    os.symlink(some_five, data / "train" / "5" / "linked.png")

    train = build(data)
    assert train.classes == DIGITS and len(train) == 1437 + 4 + 1
    added = {path: target for path, target in train.samples if path not in dict(clean.samples)}
    assert added == {**{f"{data}/train/3/extra/x{i}.png": 3 for i in range(4)}, f"{data}/train/5/linked.png": 5}
    assert [s for s in train.samples if s[0] not in added] == clean.samples  # same paths, labels and order
    image, target, ok = train[train.samples.index((f"{data}/train/5/linked.png", 5))]
    assert image.shape == (3, 32, 32) and (target, ok) == (5, 1)


# ------------------------------------------------------------------------------------------------ hidden names

def test_hidden_files_and_folders_are_skipped_counted_and_shift_no_label(data, caplog, monkeypatch):
    clean_train, clean_val = build(data), build(data, is_train=False)
    seven = first_images(data / "train" / "7", 1)[0]
    for split in ("train", "val"):  # a checkpoint folder of a notebook beside the classes: it would be class 0
        (data / split / ".ipynb_checkpoints").mkdir()
        shutil.copy(seven, data / split / ".ipynb_checkpoints" / "seven-checkpoint.png")
    (data / "train" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (data / "train" / "2" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (data / "train" / "2" / "._0.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")  # a resource fork
    (data / "train" / "7" / ".ipynb_checkpoints").mkdir()  # and one inside a class: a second copy of an image
    shutil.copy(seven, data / "train" / "7" / ".ipynb_checkpoints" / seven.name)
    monkeypatch.setenv("RANK", "0")

    with caplog.at_level(logging.WARNING):
        train, val = build(data), build(data, is_train=False)
    assert train.classes == val.classes == DIGITS
    assert train.samples == clean_train.samples and val.samples == clean_val.samples  # every label as before
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"warning: skipped 5 hidden file(s) and folder(s) in {data}/train (names starting with '.' are neither "
        f"classes nor images), e.g. {data}/train/.DS_Store",
        f"warning: skipped 1 hidden file(s) and folder(s) in {data}/val (names starting with '.' are neither "
        f"classes nor images), e.g. {data}/val/.ipynb_checkpoints"]

    caplog.clear()  # the other ranks say nothing (every rank sees the same folder)
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING):
        assert build(data).samples == clean_train.samples
    assert not caplog.records


# ---------------------------------------------------------------------------------------- through the trainer

@pytest.mark.slow  # two real single-process runs
def test_the_trainer_refuses_a_loop_with_one_line_and_exit_2(data, tmp_path):
    os.symlink("..", data / "train" / "0" / "loop")
    (data / "train" / ".ipynb_checkpoints").mkdir()
    shutil.copy(first_images(data / "train" / "7", 1)[0], data / "train" / ".ipynb_checkpoints" / "x.png")
    args = ["--data-set", "folder", "--data-path", data, "--deepspeed_config", config("zero0"), "--precision",
            "fp32", "--max-steps", "1", "--num_workers", "0", "--batch-size", "8", "--no-model-ema",
            "--warmup-epochs", "0", *TINY, *QUIET_AUG]
    proc = run_train([*args, "--output_dir", tmp_path / "out1"], check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc) == (f"vim-ds train: error (rank 0): symlink loop: {data}/train/0/loop (a symlink to ..) "
                                f"leads back to {os.path.realpath(data / 'train')}, which holds it, so its images "
                                f"would be listed over and over; remove the link"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    (data / "train" / "0" / "loop").unlink()  # negative control: the same command trains
    proc = run_train([*args, "--output_dir", tmp_path / "out2"], timeout=300)
    hidden = [line for line in proc.stderr.splitlines() if "hidden file(s)" in line]
    assert len(hidden) == 1 and f"skipped 1 hidden file(s) and folder(s) in {data}/train " in hidden[0], proc.stderr
