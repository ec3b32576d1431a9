"""`vim-ds data shard` and `--data-set shards`: WebDataset tar shards of an ImageNet-layout folder, an index of
member offsets, the folder's samples in the folder's order, and one-line refusals of damaged shards."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile

import pytest
import torch

import preloaded
from data_options import dataset_config
from train_utils import QUIET_AUG, ROOT, TINY, config, records, run_train, step_losses

from vim_ds.data import build_dataset
from vim_ds.data.datasets import DataError
from vim_ds.data.shards import check_shards, index_path, parse_size, write_shards

SMALL_SHARDS = 200_000  # digits: ~3 MB of train shards, so several shards per split


@pytest.fixture(scope="module")
def shards(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "digits"
    write_shards(digits, str(out), SMALL_SHARDS)
    return str(out)


def columns(root, split):
    with open(index_path(root, split)) as f:
        return json.loads(f.readline()), json.loads(f.readline())


def data_config(kind, path):
    return dataset_config(data_set=kind, data_path=str(path), input_size=32)


def test_sizes_parse(capsys):
    assert parse_size("1GB") == 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("4096") == 4096
    assert parse_size("1.5 kB") == 1500 and parse_size("2g") == 2 * 10**9
    for bad in ("", "GB", "1 parsec", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    # the command reports the library's reason as an option error
    from vim_ds.cli.data_commands.shard import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-path", "DIR", "--out", "SHARDS", "--shard-size", "1 parsec"])
    assert "error: argument --shard-size: not a size: '1 parsec'" in capsys.readouterr().err


def test_shards_read_back_with_tarfile_and_the_index_points_at_each_files_bytes(digits, shards):
    for split in ("train", "val"):
        header, cols = columns(shards, split)
        folder = build_dataset(data_config("folder", digits), is_train=split == "train")[0]
        assert header["classes"] == folder.classes and cols["label"] == folder.targets
        assert cols["path"] == [os.path.relpath(p, digits) for p, _ in folder.samples]
        assert len(header["shards"]) > 1 and [s["file"] for s in header["shards"]] == \
            [f"{split}-{n:06d}.tar" for n in range(len(header["shards"]))]
        read = []  # every member through Python's tarfile, in shard order
        for shard in header["shards"]:
            path = os.path.join(shards, shard["file"])
            assert os.path.getsize(path) == shard["bytes"] <= SMALL_SHARDS + tarfile.RECORDSIZE
            with tarfile.open(path) as tar:
                members = tar.getmembers()
                assert len(members) == 2 * shard["samples"]
                for image, cls in zip(members[::2], members[1::2]):
                    key, ext = image.name.split(".", 1)
                    assert cls.name == f"{key}.cls" and ext in ("png", "jpg")
                    read.append((key, tar.extractfile(image).read(), int(tar.extractfile(cls).read()),
                                 shard["file"], image.offset_data, image.size))
        assert [r[0] for r in read] == [f"{i:08d}" for i in range(len(folder))]
        for i, (key, data, label, file, offset, size) in enumerate(read):
            with open(folder.samples[i][0], "rb") as f:
                assert data == f.read()  # the file's bytes, unchanged
            assert label == folder.targets[i]
            assert (header["shards"][cols["shard"][i]]["file"], cols["offset"][i], cols["size"][i]) == \
                (file, offset, size)
    with open(os.path.join(shards, "_info.json")) as f:  # timm's `wds` reader's split info
        info = json.load(f)
    header, _ = columns(shards, "train")
    assert info["splits"]["train"]["filenames"] == [s["file"] for s in header["shards"]]
    assert sum(info["splits"]["train"]["shard_lengths"]) == info["splits"]["train"]["num_samples"] == 1437


def test_webdataset_and_timms_wds_reader_read_the_shards(digits, shards):
    wds = pytest.importorskip("webdataset")  # not a dependency of vim_ds; the test extra installs it
    header, cols = columns(shards, "val")
    urls = [os.path.join(shards, s["file"]) for s in header["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(header["num_samples"])]
    assert [int(s["cls"]) for s in samples] == cols["label"]
    assert all(("png" in s or "jpg" in s) for s in samples)
    # timm's own WebDataset reader (`wds/NAME`), which finds the split through _info.json
    from timm.data import create_dataset

    timm_val = create_dataset("wds/digits", root=str(shards), split="val", is_training=False, batch_size=1)
    assert [int(target) for _, target in timm_val] == cols["label"]


def test_the_shard_dataset_is_the_folder_dataset_sample_by_sample(digits, shards):
    for is_train in (True, False):
        folder, n_folder = build_dataset(data_config("folder", digits), is_train=is_train)
        sharded, n_sharded = build_dataset(data_config("shards", shards), is_train=is_train)
        assert (len(sharded), n_sharded, sharded.classes, sharded.targets) == \
            (len(folder), n_folder, folder.classes, folder.targets)
        for index in (0, 1, 700 % len(folder), len(folder) - 1):
            a, b = folder[(index, 1234 + index)], sharded[(index, 1234 + index)]
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:], index


def test_the_command_writes_and_refuses_to_overwrite(digits, tmp_path, capsys):
    from vim_ds.cli import main

    out = tmp_path / "s"
    argv = ["data", "shard", "--data-path", digits, "--out", str(out), "--shard-size", "1MB"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "train: 1437 images of 10 classes" in printed and "val: 360 images" in printed
    check_shards(str(out))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds split 'train'" in err and "--force" in err, err
    # one folder of class folders, written as one split of its own
    one = tmp_path / "one"
    write_shards(os.path.join(digits, "val"), str(one), split="val")
    assert sorted(n for n in os.listdir(one) if n.endswith(".jsonl")) == ["val.index.jsonl"]
    assert columns(str(one), "val")[1]["path"][0] == os.path.join("0", sorted(os.listdir(f"{digits}/val/0"))[0])


@pytest.fixture
def damaged(shards, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(shards, out)
    return out


def test_truncated_or_mismatched_shards_and_indexes_are_one_line_errors(damaged):
    with pytest.raises(DataError, match=r"train-000002\.tar is truncated: .* the index says"):
        with open(damaged / "train-000002.tar", "r+b") as f:
            f.truncate(50_000)
        check_shards(str(damaged))
    os.remove(damaged / "train-000002.tar")
    with pytest.raises(DataError, match=r"train-000002\.tar is missing"):
        check_shards(str(damaged))
    os.remove(damaged / "val.index.jsonl")
    with pytest.raises(DataError, match=r"val\.index\.jsonl is missing"):
        check_shards(str(damaged), need_train=False)


def test_an_index_pointing_past_the_end_of_its_shard_is_refused(damaged):
    header, cols = columns(str(damaged), "val")
    cols["offset"][5] = header["shards"][cols["shard"][5]]["bytes"] - 10
    with open(index_path(str(damaged), "val"), "w") as f:
        f.write(json.dumps(header) + "\n" + json.dumps(cols) + "\n")
    for check in (lambda: check_shards(str(damaged)), lambda: build_dataset(data_config("shards", damaged), False)):
        with pytest.raises(DataError, match=r"sample 5 \(val/.*\) points at bytes .* which has .*write the shards"):
            check()


def test_undecodable_members_are_skipped_as_undecodable_files_in_the_folder(digits, tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    files = sorted((data / "train" / "2").glob("*.png"))
    files[0].write_bytes(files[0].read_bytes()[:60])  # a truncated PNG
    files[3].write_text("this is not an image\n")
    files[4].write_bytes(b"")
    out = tmp_path / "shards"
    write_shards(str(data), str(out), SMALL_SHARDS)
    folder, _ = build_dataset(data_config("folder", data), is_train=True)
    sharded, _ = build_dataset(data_config("shards", out), is_train=True)
    first = folder.samples.index((str(files[0]), 2))
    for index in range(first - 1, first + 6):
        a, b = folder[(index, 99)], sharded[(index, 99)]
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], index
    assert [sharded[i][2] for i in range(first, first + 5)] == [0, 1, 1, 0, 0]
    warned = [r.getMessage() for r in caplog.records if "cannot decode" in r.getMessage()]
    member = f"train-{sharded.shard[first]:06d}.tar:{first:08d}.png (train/2/{files[0].name})"
    assert any(member in line for line in warned), warned
    assert any("(empty file)" in line and f"{first + 4:08d}.png" in line for line in warned), warned


def shard_train_args(kind, data, out, *extra):
    return ["--data-set", kind, "--data-path", data, "--output_dir", str(out), "--num_workers", "0", "--seed", "3",
            *TINY, *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32", "--batch-size", "8",
            "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0", "--no-model-ema", *extra]


@pytest.mark.slow  # four real training runs of 2-4 steps: 1-4 min on 2 shared cores
def test_training_from_shards_gives_the_losses_of_training_from_the_folder_and_resumes_mid_epoch(digits, shards,
                                                                                                 tmp_path):
    losses = {}
    for kind, data in (("folder", digits), ("shards", shards)):
        run_train(shard_train_args(kind, data, tmp_path / kind, "--max-steps", "4", "--save-interval", "0"))
        losses[kind] = step_losses(tmp_path / kind)
    assert sorted(losses["shards"]) == [1, 2, 3, 4]
    assert max(abs(losses["folder"][s] - losses["shards"][s]) for s in losses["folder"]) <= 1e-6, losses
    # stopped after step 2 of 179 in the epoch, resumed from its checkpoint: steps 3 and 4 as in the straight run
    split = tmp_path / "split"
    run_train(shard_train_args("shards", shards, split, "--max-steps", "2"))
    run_train(shard_train_args("shards", shards, split, "--max-steps", "4", "--resume", "auto"))
    resumed = step_losses(split)
    assert [r["step"] for r in records(split) if "loss" in r and "summary" not in r] == [1, 2, 3, 4]  # no rerun
    assert max(abs(losses["folder"][s] - resumed[s]) for s in (3, 4)) <= 1e-6, (resumed, losses)


@pytest.mark.parametrize("fault", ["truncated shard", "index past the end"])
def test_the_trainer_refuses_damaged_shards_before_deepspeed_with_one_line_and_exit_2(damaged, tmp_path, fault):
    if fault == "truncated shard":
        with open(damaged / "val-000001.tar", "r+b") as f:
            f.truncate(1000)
        expected = "val-000001.tar is truncated: 1000 bytes"
    else:
        header, cols = columns(str(damaged), "train")
        cols["offset"][-1] += 10**6
        with open(index_path(str(damaged), "train"), "w") as f:
            f.write(json.dumps(header) + "\n" + json.dumps(cols) + "\n")
        expected = f"sample {len(cols['offset']) - 1} (train/9/"
    proc = run_train(shard_train_args("shards", damaged, tmp_path / "out", "--max-steps", "1"), check=False,
                     timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vim-ds train: error")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in lines[0], lines
    assert "DeepSpeed" not in proc.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()

def run_bench_data(*args):
    return preloaded.run([sys.executable, "-m", "vim_ds.bench", "data", *map(str, args)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow  # two benchmark runs: about 1 min on 2 busy cores
def test_bench_data_times_the_shards_beside_the_folder(digits, shards, tmp_path):
    quick = ["--data-path", digits, "--workers", "1", "--batch-size", "4", "--batches", "2", "--warmup-batches", "1",
             "--rounds", "1", "--sample", "8", "--no-eval", "--train-args", "--input-size 32"]
    for given in ([shards], []):  # shards written before, and written by the benchmark into a temporary folder
        out = tmp_path / "bench.json"
        proc = run_bench_data(*quick, "--shards", *given, "--json", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("shards vs folder")]
        assert len(line) == 1 and "images/s per core" in line[0] and "from the shards" in line[0], proc.stdout
        result = json.loads(out.read_text())["shards"]
        for name in ("folder", "shards"):
            (row,) = result[name]["loader"]
            assert row["images"] == 8 and row["worker_processes"] == 1 and result[name]["images_per_sec_per_core"]
            assert result["read_us_per_image"][name] > 0
    assert not [p for p in os.listdir(tempfile_dir()) if p.startswith("vim-ds-bench-shards-")]  # cleaned up
    other = tmp_path / "val-only"
    write_shards(os.path.join(digits, "val"), str(other), split="val")
    proc = run_bench_data(*quick, "--shards", other)
    assert proc.returncode != 0 and "train.index.jsonl is missing" in proc.stderr and "Traceback" not in proc.stderr


def tempfile_dir():
    import tempfile

    return tempfile.gettempdir()
