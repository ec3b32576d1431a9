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
import tempfile

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


# ------------------------------------------------------------------------- class folders that cannot be read (issue 50)

def without_root_powers(fn, *args):
    """`fn(*args)` in a thread that the kernel holds to file permissions as it holds any user: as root, the thread
    drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its effective capabilities (Linux keeps them per thread,
    so the rest of the process keeps them). Returns what `fn` returns, raises what it raises."""
    import ctypes
    import threading

    outcome = {}

    def run():
        try:
            if os.geteuid() == 0:
                class Header(ctypes.Structure):
                    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

                class Data(ctypes.Structure):
                    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                                ("inheritable", ctypes.c_uint32)]

                libc = ctypes.CDLL(None, use_errno=True)
                header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
                assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
                data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
                assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def every_reader(root, capsys) -> dict:
    """What each reader of a data folder makes of `root`: the preflight (`vim-ds train`'s check before anything
    starts), the training and evaluation data sets, `vim-ds data shard` (its exit code and error line) and
    `predict --classes ROOT/train` (its class names): a refusal's one line, or what it read."""
    from data_options import run_config
    from vim_ds.cli.data_commands.shard import main as shard
    from vim_ds.engine import preflight
    from vim_ds.cli.predict import class_names

    def outcome(read):
        try:
            return read()
        except DataError as exc:
            assert "\n" not in str(exc)
            return f"refused: {exc}"

    config = run_config(data_set="folder", data_path=str(root))
    seen = {"preflight": outcome(lambda: preflight._data(config)),
            "train": outcome(lambda: build(root).classes),
            "eval": outcome(lambda: build(root, is_train=False).classes),
            "predict --classes": outcome(lambda: class_names(str(root / "train"), 10))}
    capsys.readouterr()
    code = shard(["--data-path", str(root), "--out", tempfile.mkdtemp(prefix="shards", dir=root.parent)])
    seen["vim-ds data shard"] = (code, capsys.readouterr().err)
    return seen


def refused_everywhere(seen: dict, message: str) -> None:
    assert seen == {"preflight": f"refused: {message}", "train": f"refused: {message}",
                    "eval": f"refused: {message}", "predict --classes": f"refused: {message}",
                    "vim-ds data shard": (2, f"vim-ds data shard: error: {message}\n")}


def read_everywhere(seen: dict, classes: list) -> None:
    assert seen["preflight"] is None and seen["train"] == seen["eval"] == seen["predict --classes"] == classes
    assert seen["vim-ds data shard"][0] == 0, seen


def test_a_class_folder_on_a_disk_not_mounted_is_refused_by_name_in_every_reader(data, tmp_path, capsys):
    """The issue's case: train/7 and val/7 are links to a disk that is not mounted. Before: every reader skipped
    them as files, and the run trained on 9 classes, 8 and 9 labelled 7 and 8."""
    disk = tmp_path / "disk"
    for split in ("train", "val"):
        shutil.move(data / split / "7", disk / split / "7")
        os.symlink(disk / split / "7", data / split / "7")
    disk.rename(tmp_path / "unmounted")
    message = (f"{data}/train/7 (a symlink to {disk}/train/7) leads nowhere: {disk}/train/7 does not exist (a disk "
               f"not mounted? moved?); a class folder there would be left out, and the classes after it renumbered; "
               f"mount or restore it, or remove the link")
    seen = every_reader(data, capsys)
    # the preflight meets val/ first (the split every command reads)
    assert seen["preflight"] == "refused: " + message.replace("/train/", "/val/")
    seen["preflight"] = "refused: " + message
    refused_everywhere(seen, message)
    # the variant: only train/7 lost (val/7 there): named as `ls` shows it, not "'7' is in val/ but not in train/"
    (tmp_path / "unmounted" / "val" / "7").rename(data / "val" / "7.real")
    (data / "val" / "7").unlink()
    (data / "val" / "7.real").rename(data / "val" / "7")
    refused_everywhere(every_reader(data, capsys), message)

    (tmp_path / "unmounted").rename(disk)  # negative control: the disk mounted again, every reader reads 10 classes
    read_everywhere(every_reader(data, capsys), DIGITS)
    assert build(data).samples == ImageFolder(str(data / "train")).samples


def test_a_class_folder_that_cannot_be_read_is_refused_by_name(data, capsys):
    """No read/execute permission for the user running vim-ds (for root: a thread without the capabilities that
    override file permissions). Before: the preflight passed, the run stopped in its data set with a bare
    `[Errno 13] Permission denied`, `vim-ds data shard` with a traceback, and predict took the folder as a class."""
    seven = data / "train" / "7"
    seven.chmod(0o300)  # write and execute: it cannot be listed
    message = (f"class folder {seven} cannot be read (Permission denied): give the user running vim-ds read and "
               f"execute permission on it (chmod a+rx)")
    refused_everywhere(without_root_powers(every_reader, data, capsys), message)
    # the variant: a folder inside a class (more images of class 3) that cannot be read: named the same way
    seven.chmod(0o755)
    more = data / "train" / "3" / "more"
    more.mkdir()
    shutil.copy(first_images(data / "val" / "3", 1)[0], more / "x.png")
    more.chmod(0o000)
    with pytest.raises(DataError) as info:
        without_root_powers(build, data)
    assert str(info.value) == (f"folder {more} cannot be read (Permission denied): give the user running vim-ds read "
                               f"and execute permission on it (chmod a+rx)")
    more.chmod(0o755)  # negative control: readable again, read by every reader
    read_everywhere(without_root_powers(every_reader, data, capsys), DIGITS)
    assert len(build(data)) == 1437 + 1


def test_a_link_leading_nowhere_inside_a_class_is_refused_unless_it_names_an_image(data, caplog):
    """Below the class folders a link to nothing may be a folder of images on a disk not mounted (refused), or an
    image that is gone (listed, and skipped when read, with its link named)."""
    os.symlink("/mnt/not-mounted/more-threes", data / "train" / "3" / "more")
    assert refused(data) == (f"{data}/train/3/more (a symlink to /mnt/not-mounted/more-threes) leads nowhere: "
                             f"/mnt/not-mounted/more-threes does not exist (a disk not mounted? moved?); the images "
                             f"of a folder there would be left out; mount or restore it, or remove the link")
    (data / "train" / "3" / "more").unlink()
    gone = data / "train" / "3" / "gone.png"
    os.symlink("/mnt/not-mounted/gone.png", gone)
    dataset = build(data)
    with caplog.at_level(logging.WARNING):
        _, _, ok = dataset[dataset.samples.index((str(gone), 3))]
    assert ok == 0 and caplog.messages == [
        f"warning: cannot decode {gone} (a symlink to /mnt/not-mounted/gone.png, which does not exist); skipped"]


# ---------------------------------------------------------------------- names a user cannot tell apart (issue 50)

def check_layout_message(root) -> str:
    from vim_ds.data.datasets import check_layout

    with pytest.raises(DataError) as info:
        check_layout(str(root))
    return str(info.value)


def test_a_file_where_the_other_split_has_a_folder_is_named_as_a_file(data):
    shutil.rmtree(data / "train" / "7")
    (data / "train" / "7").write_bytes(b"\x1f\x8b")  # e.g. a class's archive, not unpacked
    assert check_layout_message(data) == (f"class folders of {data}/train and {data}/val differ: train/7 is a file, "
                                          f"not a folder, so '7' is a class of val/ only")
    (data / "train" / "7").unlink()  # negative control: a class that is simply missing
    assert check_layout_message(data) == (f"class folders of {data}/train and {data}/val differ: '7' is in val/ but "
                                          f"not in train/")


NFC, NFD = "z\u00e9ro", "ze\u0301ro"  # both print as zéro


@pytest.mark.parametrize("train_name,val_name,why", [
    (NFC, NFD, "the same letters in two Unicode forms (NFC and NFD; macOS writes names in NFD)"),
    ("9", "9 ", "the same name but for spaces at an end"),  # the variant: a space a terminal does not show
    ("9", "9\u200b", "the same name but for invisible characters"),  # a zero-width space, pasted from a web page
])
def test_names_that_print_alike_are_told_apart(data, train_name, val_name, why):
    """Compared as they are (a folder name is bytes on disk; NFC and NFD sort apart, so merging them could give a
    class two labels), and shown with the code points that differ. Before: `'zéro' is in val/ but not in train/`
    while `ls` showed zéro in both."""
    (data / "train" / "9").rename(data / "train" / train_name)
    (data / "val" / "9").rename(data / "val" / val_name)
    assert check_layout_message(data) == (
        f"class folders of {data}/train and {data}/val differ: train/ has {train_name!r} where val/ has "
        f"{ascii(val_name) if val_name == NFD else repr(val_name)}: {why}; rename one like the other")
    (data / "val" / val_name).rename(data / "val" / train_name)  # negative control: the same bytes in both
    assert build(data).classes == build(data, is_train=False).classes == [*DIGITS[:9], train_name]


def test_two_class_folders_that_print_alike_are_refused(data):
    """One split holding both forms (a copy from a Mac merged into a Linux one): two classes every message and
    prediction would show as zéro."""
    (data / "train" / "9").rename(data / "train" / NFC)
    (data / "train" / "8").rename(data / "train" / NFD)
    message = (f"class folders 'ze\\u0301ro' and 'z\u00e9ro' of {data}/train look the same: the same letters in two "
               f"Unicode forms (NFD and NFC; macOS writes names in NFD); they would be two classes that every "
               f"message and prediction shows alike: merge them into one folder, or rename one")
    assert refused(data) == message
    assert check_layout_message(data) == message  # the preflight
    (data / "train" / NFD).rename(data / "train" / "8")  # negative control
    assert build(data).classes == [*DIGITS[:9], NFC]


# --------------------------------------------------------------------------- images outside any class (issue 50)

def test_images_directly_in_a_split_folder_are_named_in_a_warning(data, tmp_path, caplog, capsys, monkeypatch):
    """ImageFolder ignores them (they have no class); before, without a word."""
    from vim_ds.cli.data_commands.shard import main as shard

    monkeypatch.setenv("RANK", "0")
    for name, source in (("a.png", "3"), ("b.png", "5")):
        shutil.copy(first_images(data / "train" / source, 1)[0], data / "train" / name)
    (data / "train" / "README.txt").write_text("the digits")  # a text file beside the classes: not an image
    with caplog.at_level(logging.WARNING):
        assert len(build(data)) == 1437
    assert caplog.messages == [f"warning: ignored 2 image file(s) directly in {data}/train, outside any class folder "
                               f"(an image's class is the folder it is in: move them into one), e.g. "
                               f"{data}/train/a.png"]
    # the variant: `vim-ds data shard --split train` of a folder of class folders (another reader, the same scan)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert shard(["--data-path", str(data / "train"), "--split", "train", "--out", str(tmp_path / "s")]) == 0
    assert caplog.messages == [f"warning: ignored 2 image file(s) directly in {data}/train, outside any class folder "
                               f"(an image's class is the folder it is in: move them into one), e.g. "
                               f"{data}/train/a.png"]
    assert "train: 1437 images of 10 classes" in capsys.readouterr().out
    caplog.clear()  # negative control: the same folder without them warns of nothing
    (data / "train" / "a.png").unlink()
    (data / "train" / "b.png").unlink()
    with caplog.at_level(logging.WARNING):
        build(data)
    assert caplog.messages == []
