"""Data pipeline: the digits writer, folder and synthetic datasets with real files, per-sample seeding, bad images,
one-line data errors, and the batch samplers' split-independence."""
import dataclasses
import logging
import os
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vim_ds.data import (DataError, GlobalBatchSampler, ShardedEvalSampler, build_dataset, build_transform,
                         write_digits)

import preloaded
from data_options import dataset_config


def data_config(**overrides):
    """The data config of a run with these options (by dest) on top of the recipe's defaults."""
    return dataset_config(**{"data_set": "folder", "data_path": None, "input_size": 32, "nb_classes": 10,
                             "synthetic_size": 64, **overrides})


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The digits folder, written once through the command line as a user would (`python -m vim_ds.data`)."""
    out = tmp_path_factory.mktemp("digits") / "digits"
    proc = preloaded.run([sys.executable, "-m", "vim_ds.data", "digits", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    return out, proc


def write_folder(root, layout, size=12):
    """layout: {split: {class: n_images}} of small random RGB PNGs."""
    rng = np.random.default_rng(0)
    for split, classes in layout.items():
        for cls, n in classes.items():
            folder = Path(root) / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


# ---------------------------------------------------------------------------------------------------------- digits

def test_digits_cli_writes_a_stratified_imagefolder(digits):
    out, proc = digits
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote 1437 training and 360 validation images of 10 classes to {out}"
    from sklearn.datasets import load_digits

    class_sizes = np.bincount(load_digits().target)
    for split, total in (("train", 1437), ("val", 360)):
        classes = sorted(p.name for p in (out / split).iterdir())
        assert classes == [str(d) for d in range(10)]
        per_class = np.array([len(list((out / split / c).glob("*.png"))) for c in classes])
        assert per_class.sum() == total
        share = class_sizes * (0.2 if split == "val" else 0.8)  # stratified: each class split 80/20, rounded
        assert np.all(np.abs(per_class - share) < 1), (per_class, share)
    train = {p.name for p in (out / "train").rglob("*.png")}
    val = {p.name for p in (out / "val").rglob("*.png")}
    assert not train & val and len(train | val) == 1797
    with Image.open(next((out / "val" / "7").glob("*.png"))) as im:
        assert im.size == (8, 8) and im.mode == "L"
        assert np.asarray(im).max() > 16  # 0..16 scaled to 0..255


def test_digits_split_is_deterministic_and_cli_refuses_non_empty_dir(digits, tmp_path, capsys):
    from sklearn.datasets import load_digits

    import vim_ds.cli

    out, _ = digits
    again = tmp_path / "again"
    assert vim_ds.cli.main(["data", "digits", "--out", str(again)]) == 0
    assert "wrote 1437 training and 360 validation" in capsys.readouterr().out
    listing = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*.png"))  # noqa: E731
    assert listing(again) == listing(out)
    # file n.png holds image n of load_digits(), scaled 0..16 -> 0..255, in the folder of its label
    ref = load_digits()
    some = next((again / "train" / "3").glob("*.png"))
    n = int(some.stem)
    assert ref.target[n] == 3
    assert np.array_equal(np.asarray(Image.open(some)), np.rint(ref.images[n] * 255 / 16).astype(np.uint8))

    assert vim_ds.cli.main(["data", "digits", "--out", str(again)]) == 2
    assert "not empty" in capsys.readouterr().err
    (again / "keep.txt").write_text("mine")
    counts = write_digits(tmp_path / "other", val_fraction=0.5, seed=1)
    assert counts == {"train": 898, "val": 899, "classes": 10}
    assert vim_ds.cli.main(["data", "digits", "--out", str(again), "--force", "--val-fraction", "0.5",
                            "--seed", "1"]) == 0
    assert listing(again) == listing(tmp_path / "other") and (again / "keep.txt").read_text() == "mine"


def test_data_force_replaces_only_what_vim_ds_data_wrote(tmp_path, capsys):
    """`--force` removed the whole train/ and val/ of --out, whoever wrote them (`vim-ds data digits --out
    ~/data/imagenet --force` took ImageNet's training images). Now it removes the files these commands write and
    refuses, before removing anything, a split holding anything else: a file of another name, or (the variant) a
    link to a folder elsewhere, whose files it would have removed through the link. The control: the files both
    writers name (digits' `<class>/<n>.png`, photos' `<class>/<split>_<n>.jpg`) go, with their folders; nothing
    else of --out is touched."""
    import vim_ds.cli
    from vim_ds.data.digits import clear_output_folder

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    for rel in ("train/3/0001.png", "val/3/0002.png", "train/c0/train_00001.jpg", "val/c0/val_00001.jpg",
                "train/n01440764/n01440764_10026.JPEG", "keep.txt", "../elsewhere/0003.png"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(rel.encode())

    def files(root):
        return sorted(str(p.relative_to(root)) for p in root.rglob("*"))

    before = files(tmp_path)
    assert vim_ds.cli.main(["data", "digits", "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"vim-ds data digits: error: {out / 'train'} holds files vim-ds data did not write (e.g. "
        f"{out / 'train' / 'n01440764' / 'n01440764_10026.JPEG'}); --force replaces only what it wrote: move them "
        f"away or give another --out"]
    os.remove(out / "train" / "n01440764" / "n01440764_10026.JPEG")
    os.symlink(elsewhere, out / "val" / "7")
    assert clear_output_folder(out, force=True) == (
        f"{out / 'val'} holds files vim-ds data did not write (e.g. {out / 'val' / '7'}); --force replaces only what "
        f"it wrote: move them away or give another --out")
    assert files(tmp_path) == sorted({*before, "out/val/7"} - {"out/train/n01440764/n01440764_10026.JPEG"})
    os.remove(out / "val" / "7")
    assert clear_output_folder(out, force=True) is None
    assert files(out) == ["keep.txt"] and files(elsewhere) == ["0003.png"]


def test_data_command_usage(capsys):
    import vim_ds.cli

    assert vim_ds.cli.main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vim-ds data <command> [options]")
    assert all(f"  {name}  " in out for name in ("digits", "shard", "photos")), out
    assert vim_ds.cli.main(["data", "frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("vim-ds data: unknown command 'frobnicate'")


# ---------------------------------------------------------------------------------------------- folder datasets

def test_folder_dataset_on_digits(digits):
    out, _ = digits
    train, n_train = build_dataset(data_config(data_path=str(out)), is_train=True)
    val, n_val = build_dataset(data_config(data_path=str(out), data_set="IMNET"), is_train=False)
    assert n_train == n_val == 10 and train.classes == val.classes == [str(d) for d in range(10)]
    assert len(train) == len(train.samples) == 1437 and len(val) == 360
    path, target = train.samples[0]
    assert Path(path).parent.name == train.classes[target]
    image, target, ok = train[(5, 123)]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and ok == 1
    assert target == train.samples[5][1]
    a, b = val[3], val[3]
    assert a[0].shape == (3, 32, 32) and torch.equal(a[0], b[0]) and a[1:] == b[1:] == (val.samples[3][1], 1)
    # the eval transform is a deterministic resize + centre crop, whatever the global RNG does
    torch.manual_seed(1)
    c = val[(3, 99)]
    assert torch.equal(a[0], c[0])


def test_sample_seed_makes_augmentation_a_pure_function_and_leaves_global_rngs_alone(digits):
    out, _ = digits
    train, _ = build_dataset(data_config(data_path=str(out), reprob=1.0, input_size=24), is_train=True)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    first = train[(10, 2**62 + 5)][0]
    again = train[(10, 2**62 + 5)][0]
    other = [train[(10, s)][0] for s in (1, 2, 3)]
    assert torch.equal(first, again)
    assert all(not torch.equal(first, o) for o in other)
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    # unseeded access keeps the ordinary behaviour: it draws from the global RNGs
    train[10]
    assert not torch.equal(torch.get_rng_state(), before[2])


def test_bad_images_are_skipped_with_a_warning(tmp_path, caplog):
    root = write_folder(tmp_path / "data", {"train": {"a": 3, "b": 2}, "val": {"a": 1, "b": 1}})
    empty = root / "train" / "a" / "1.png"
    empty.write_bytes(b"")
    jpeg = root / "train" / "b" / "0.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(jpeg, quality=95)
    jpeg.write_bytes(jpeg.read_bytes()[:400])  # truncated
    (root / "train" / "b" / "2.png").write_text("not an image at all")
    dataset, _ = build_dataset(data_config(data_path=str(root)), is_train=True)
    index = {p: i for i, (p, _) in enumerate(dataset.samples)}
    with caplog.at_level(logging.WARNING):
        results = {p: dataset[(i, 42)] for p, i in index.items()}
        dataset[(index[str(empty)], 43)]  # a second read of a bad file warns no more
    bad = {str(empty), str(jpeg), str(root / "train" / "b" / "2.png")}
    for path, (image, target, ok) in results.items():
        assert image.shape == (3, 32, 32) and torch.isfinite(image).all()
        assert ok == (0 if path in bad else 1)
    # a skipped sample is replaced by the next decodable one: a/1.png -> a/2.png (same seed, same image)
    substitute = dataset[(index[str(root / "train" / "a" / "2.png")], 42)]
    assert torch.equal(results[str(empty)][0], substitute[0]) and results[str(empty)][1] == substitute[1]
    messages = [r.getMessage() for r in caplog.records]
    for path in bad:
        assert sum(path in m for m in messages) == 1, messages
    assert any(m == f"warning: cannot decode {empty} (empty file); skipped" for m in messages)
    assert any(str(jpeg) in m and "truncated" in m.lower() for m in messages)


def test_nothing_decodable_is_a_data_error(tmp_path):
    root = write_folder(tmp_path / "data", {"train": {"a": 0}, "val": {"a": 1}})
    (root / "train" / "a" / "x.png").write_bytes(b"")
    dataset, _ = build_dataset(data_config(data_path=str(root)), is_train=True)
    with pytest.raises(DataError, match="cannot be decoded"):
        dataset[0]


def _error(config, is_train=True):
    with pytest.raises(DataError) as info:
        build_dataset(config, is_train)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_data_errors_are_one_line_and_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    assert str(missing) in _error(data_config(data_path=str(missing))) and "does not exist" in _error(
        data_config(data_path=str(missing)))
    assert "--data-path" in _error(data_config(data_path=None))

    root = write_folder(tmp_path / "d1", {"train": {"a": 1, "b": 1}})
    message = _error(data_config(data_path=str(root)), is_train=False)
    assert str(root / "val") in message and "missing" in message
    (root / "val").mkdir()
    message = _error(data_config(data_path=str(root)), is_train=False)
    assert str(root / "val") in message and "no class folders" in message

    write_folder(root, {"val": {"a": 1, "c": 1}})
    message = _error(data_config(data_path=str(root)), is_train=False)
    assert "'b' is in train/ but not in val/" in message

    root2 = write_folder(tmp_path / "d2", {"train": {"a": 2, "b": 0}, "val": {"a": 1, "b": 1}})
    (root2 / "train" / "b" / "notes.txt").write_text("no images here")
    message = _error(data_config(data_path=str(root2)))
    assert str(root2 / "train" / "b") in message and "no image files" in message

    assert "unknown --data-set" in _error(data_config(data_set="CIFAR"))


def test_synthetic_dataset_is_deterministic_per_index():
    config = data_config(data_set="synthetic", synthetic_size=50, nb_classes=7, input_size=16, seed=3)
    train, classes = build_dataset(config, is_train=True)
    val, _ = build_dataset(config, is_train=False)
    assert classes == 7 and len(train) == 50 and len(val) == 5
    image, target, ok = train[4]
    assert image.shape == (3, 16, 16) and ok == 1 and 0 <= target < 7
    assert torch.equal(train[(4, 11)][0], image) and torch.equal(build_dataset(config, True)[0][4][0], image)
    assert not torch.equal(val[4][0], image) and not torch.equal(train[5][0], image)
    assert not torch.equal(build_dataset(dataclasses.replace(config, seed=4), True)[0][4][0], image)
    assert set(int(train[i][1]) for i in range(50)) == set(range(7))


def test_train_transform_options_reach_timm():
    train = build_transform(data_config(aa="none", reprob=0.0, input_size=48).transform, is_train=True)
    names = [type(t).__name__ for t in train.transforms]
    assert "RandAugment" not in names and "RandomErasing" not in names and "ColorJitter" in names
    names = [type(t).__name__ for t in build_transform(data_config().transform, is_train=True).transforms]
    assert "RandAugment" in names and "RandomErasing" in names
    image = Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))
    assert train(image).shape == (3, 48, 48)
    assert build_transform(data_config(input_size=224).transform, is_train=False)(image).shape == (3, 224, 224)


# ---------------------------------------------------------------------------------------------------- samplers

def step_multisets(num_samples, *, micro, accum, world, seed=0, epoch=0, repeats=3):
    """For each optimizer step: the multiset of (index, sample_seed) keys read by all ranks and micro steps."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(num_samples, micro_batch=micro, accum_steps=accum, rank=rank,
                                     world_size=world, seed=seed, repeats=repeats)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == sampler.steps_per_epoch * accum
        assert all(len(b) == micro for b in batches)
        per_rank.append(batches)
    steps = len(per_rank[0]) // accum
    return [Counter(key for batches in per_rank for b in batches[s * accum:(s + 1) * accum] for key in b)
            for s in range(steps)]


@pytest.mark.parametrize("repeats", [1, 3])
def test_every_split_of_the_global_batch_reads_the_same_samples(repeats):
    splits = [(8, 1, 1), (4, 1, 2), (4, 2, 1), (2, 1, 4), (1, 4, 2), (2, 2, 2), (1, 1, 8)]  # (micro, accum, world)
    reference = step_multisets(100, micro=8, accum=1, world=1, repeats=repeats)
    assert len(reference) == 12
    for micro, accum, world in splits[1:]:
        assert step_multisets(100, micro=micro, accum=accum, world=world, repeats=repeats) == reference
    keys = [k for step in reference for k in step.elements()]
    assert len({seed for _, seed in keys}) == len(keys)  # every position has its own augmentation seed
    indices = [i for i, _ in keys]
    assert len(set(indices)) == (96 if repeats == 1 else 32)  # DeiT: repeats cut back to one epoch's length


def test_resume_mid_epoch_and_epochs_differ():
    def run(epoch, start_step=0, rank=1):
        sampler = GlobalBatchSampler(50, micro_batch=3, accum_steps=2, rank=rank, world_size=2, seed=5)
        sampler.set_epoch(epoch, start_step=start_step)
        return list(sampler), len(sampler)

    full, n_full = run(0)
    tail, n_tail = run(0, start_step=3)
    assert n_full == 8 and n_tail == 2 and tail == full[3 * 2:]
    assert run(0, start_step=4)[0] == []
    other, _ = run(1)
    assert [i for b in other for i, _ in b] != [i for b in full for i, _ in b]
    assert not {s for b in other for _, s in b} & {s for b in full for _, s in b}
    with pytest.raises(ValueError, match="start_step"):
        run(0, start_step=5)


def test_unshuffled_order_and_repeats_on_different_ranks():
    world = 3
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(36, micro_batch=2, accum_steps=2, rank=rank, world_size=world, seed=0,
                                     repeats=3, shuffle=False)
        per_rank.append([i for b in sampler for i, _ in b])
    # positions 0,1,2 hold image 0 three times and go to ranks 0,1,2
    for rank in range(world):
        assert len(set(per_rank[rank])) == len(per_rank[rank]) == 12
    assert [per_rank[r][0] for r in range(world)] == [0, 0, 0]
    shuffled = GlobalBatchSampler(36, micro_batch=2, accum_steps=2, rank=0, world_size=world, seed=0, repeats=3)
    order = shuffled.epoch_order().tolist()
    assert order[0::3] == order[1::3] == order[2::3] and sorted(order[0::3]) != order[0::3]


def test_too_small_dataset_for_one_global_batch():
    with pytest.raises(DataError) as info:
        GlobalBatchSampler(15, micro_batch=4, accum_steps=2, rank=0, world_size=2, seed=0)
    message = str(info.value)
    assert "has 15 images, fewer than one global batch of 16" in message and "--batch-size" in message
    with pytest.raises(ValueError, match="rank 2"):
        GlobalBatchSampler(100, micro_batch=4, accum_steps=1, rank=2, world_size=2, seed=0)


@pytest.mark.parametrize("num_samples,world,batch", [(10, 3, 2), (7, 4, 3), (2, 4, 1), (360, 2, 64)])
def test_sharded_eval_sampler_reads_every_index_once(num_samples, world, batch):
    seen = []
    for rank in range(world):
        sampler = ShardedEvalSampler(num_samples, batch_size=batch, rank=rank, world_size=world)
        batches = list(sampler)
        assert len(batches) == len(sampler) and all(0 < len(b) <= batch for b in batches)
        seen += [i for b in batches for i in b]
    assert sorted(seen) == list(range(num_samples))


def test_dataloader_with_both_samplers(digits):
    out, _ = digits
    train, _ = build_dataset(data_config(data_path=str(out), input_size=16), is_train=True)
    sampler = GlobalBatchSampler(len(train), micro_batch=4, accum_steps=1, rank=0, world_size=1, seed=0)
    images, targets, ok = next(iter(torch.utils.data.DataLoader(train, batch_sampler=sampler)))
    assert images.shape == (4, 3, 16, 16) and targets.dtype == torch.int64 and ok.tolist() == [1, 1, 1, 1]
    # augmentations do not depend on the worker count: worker processes see the same sample seeds
    workers = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=2)
    assert torch.equal(next(iter(workers))[0], images)
    val, _ = build_dataset(data_config(data_path=str(out), input_size=16), is_train=False)
    loader = torch.utils.data.DataLoader(val, batch_sampler=ShardedEvalSampler(len(val), batch_size=128, rank=1,
                                                                              world_size=2))
    assert sum(len(t) for _, t, _ in loader) == 180


def test_randaugment_posterize_at_full_strength_does_not_crash():
    """Pillow >= 11 refuses posterize(bits=0), which RandAugment inc1 asks for at its strongest level."""
    from PIL import Image
    from timm.data.auto_augment import AugmentOp

    import vim_ds.data.transforms  # noqa: F401  (installs the safe op)

    op = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10, hparams={"magnitude_max": 10})
    img = Image.new("RGB", (8, 8), (200, 100, 50))
    out = op(img)
    assert out.size == (8, 8) and out.getextrema() == ((0, 0), (0, 0), (0, 0))
