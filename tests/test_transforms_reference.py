"""Data augmentation against timm (issue 21, item 2): what vim_ds feeds the model equals what the published recipe
(DeiT's `datasets.py::build_transform` and `main.py`, which Vim reuses) would feed it, on real images.

- Training: images decoded by `build_dataset` from a folder and transformed for a sample seed, against timm's own
  `create_transform(is_training=True, ...)` called here with the arguments the published `build_transform` passes
  (input_size, color_jitter, auto_augment, interpolation, re_prob, re_mode, re_count), plus `scale`, `ratio` and
  `hflip` for vim_ds's `--scale`/`--ratio`/`--hflip` (the published script has no such options; these are the
  timm arguments of the same names) and `vflip=0` (no vertical flip in either), with Python's `random`, NumPy's
  and torch's generators seeded alike before each image, since timm's transforms draw from all three.
- Evaluation: against timm's `create_transform(is_training=False, crop_pct=eval_crop_ratio,
  interpolation="bicubic")`, whose resize is DeiT's `int(input_size / eval_crop_ratio)` (checked too).
- Mixup/CutMix: the `Mixup` the trainer builds against one built with the published `main.py` arguments (same
  attributes, same mixed batch and soft targets for the same seed), and the criterion that goes with it.

The reference is independent of vim_ds: timm's public functions with the published arguments, parsed options
written out as literals, images decoded with PIL. vim_ds replaces timm's posterize op module-wide (Pillow >= 11
refuses 0 bits, which RandAugment's strongest `inc1` level asks for); the reference is built with timm's own op, so
the comparison also shows that the replacement changes nothing else (no image and seed here draws 0 bits: timm's
op would raise).
The options go through `vim_ds.cli.run_options.parse_args`, so a misread option name is caught as well.

Outputs are compared with `torch.equal`: both sides run the same float operations in the same order on the same
CPU, so any difference is a difference in the pipeline. Besides the published defaults, cases set every option to a
value other than its default, and each comparison has negative controls: the reference with one option changed (the
one-line bug it stands for: the option ignored, misread or swapped) gives different outputs on the same images and
seeds.

Sizes are above 32 px: at 32 px and below the published `build_transform` swaps the random-resized crop for a
padded random crop (training) and skips the resize and crop (evaluation), which vim_ds deliberately does not do
(see `vim_ds.data.transforms.build_transform`).
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD, Mixup, auto_augment, create_transform
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from vim_ds.data import build_dataset
from vim_ds.data.datasets import erase_seed
from vim_ds.data.mixup import build_mixup
from vim_ds.config.components import dataset_config, mixup_config
from vim_ds.config.run_config import RunConfig
from vim_ds.engine.parts import build_criterion
from vim_ds.cli.run_options import parse_args

SEEDS = (0, 1, 7, 2024, 31337, 29)  # sample seeds: the dataset seeds random/numpy/torch from them for each image;
# 29 flips at p = 0.3 and its erase seed (`erase_seed`) erases at p = 0.25, so the flip and erasing controls have work


@pytest.fixture(scope="module")
def image_folder(digits, tmp_path_factory):
    """An ImageNet-layout folder (train/ and val/ alike) of real files in the formats users bring: photo-like RGB
    PNG and JPEG (gradients, a disc with hard edges, noise) in non-square sizes, a grayscale PNG and two of the
    suite's handwritten 8x8 digits (grayscale PNGs, upscaled by the crop)."""
    root = tmp_path_factory.mktemp("transform_images")
    rng = np.random.default_rng(21)

    def photo(width, height):
        y, x = np.mgrid[0:height, 0:width].astype(np.float64)
        img = np.stack([255 * x / (width - 1), 255 * y / (height - 1), 128 + 100 * np.sin((x + 2 * y) / 5)], -1)
        img[(x - 0.6 * width) ** 2 + (y - 0.4 * height) ** 2 < (0.25 * min(width, height)) ** 2] = (230, 40, 60)
        img += rng.normal(0, 12, img.shape)
        return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8))

    digit_files = [os.path.join(digits, "train", cls, sorted(os.listdir(os.path.join(digits, "train", cls)))[0])
                   for cls in ("3", "8")]
    for split in ("train", "val"):
        for cls in ("a", "b"):
            os.makedirs(root / split / cls)
        photo(40, 28).save(root / split / "a" / "photo_40x28.png")
        photo(57, 83).save(root / split / "a" / "photo_57x83.jpg", quality=90)
        photo(70, 45).save(root / split / "a" / "photo_70x45.png")
        photo(31, 45).convert("L").save(root / split / "b" / "gray_31x45.png")
        for n, path in enumerate(digit_files):
            shutil.copy(path, root / split / "b" / f"digit_{n}.png")
    return str(root)


def _args(folder: str, *argv: str):
    return parse_args(["--data-set", "folder", "--data-path", folder, *argv])


def _config(folder: str, *argv: str) -> RunConfig:
    """The same options as the typed config the engine reads."""
    return RunConfig.from_dict(vars(_args(folder, *argv)))


def _decode(path: str) -> Image.Image:
    """What the published ImageFolder gives a transform: torchvision's default loader, PIL converted to RGB."""
    with Image.open(path) as image:
        return image.convert("RGB")


@contextlib.contextmanager
def _timm_own_ops():
    """Build with timm's own posterize op rather than the one vim_ds installs (see the module docstring)."""
    names = ("Posterize", "PosterizeIncreasing", "PosterizeOriginal")
    installed = {name: auto_augment.NAME_TO_OP[name] for name in names}
    auto_augment.NAME_TO_OP.update(dict.fromkeys(names, auto_augment.posterize))
    try:
        yield
    finally:
        auto_augment.NAME_TO_OP.update(installed)


def _vim_ds_train(folder: str, argv) -> tuple[list, list]:
    """vim_ds's training samples for every (image, seed): (outputs, [(path, seed)])."""
    dataset, _ = build_dataset(dataset_config(_config(folder, *argv)), is_train=True)
    keys = [(i, seed) for i in range(len(dataset)) for seed in SEEDS]
    samples = [dataset[key] for key in keys]
    assert all(ok == 1 for _, _, ok in samples)
    return [image for image, _, _ in samples], [(dataset.samples[i][0], seed) for i, seed in keys]


def _reference_train(keys, **kwargs):
    """timm's transform of each (path, seed), lazily (a control stops at its first differing image).

    Random erasing, timm's last step, runs with the generators seeded from the sample's erase seed
    (`vim_ds.data.datasets.erase_seed`, the one contract taken from vim_ds): vim_ds erases after the uint8
    hand-over, in the consuming process, so its draws cannot continue the worker's stream; the steps before it run
    as one stream seeded from the sample seed."""
    with _timm_own_ops():
        steps = list(create_transform(is_training=True, **kwargs).transforms)
    erasing = steps.pop() if type(steps[-1]).__name__ == "RandomErasing" else None
    for path, seed in keys:
        image = _decode(path)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        for step in steps:
            image = step(image)
        if erasing is not None:
            random.seed(erase_seed(seed))
            torch.manual_seed(erase_seed(seed))
            image = erasing(image)
        yield image


def _equal(ours: list, reference) -> bool:
    """Every output equal, element for element (`reference`: a list or a lazy iterable, as long as `ours`)."""
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ours, reference, strict=True))


# (vim_ds command line, the published build_transform's create_transform arguments for it, negative controls:
#  the reference with one argument changed, each a one-line bug it stands for)
TRAIN_CASES = {
    "published defaults": (
        [],
        dict(input_size=224, color_jitter=0.3, auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
             re_prob=0.25, re_mode="pixel", re_count=1, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5,
             vflip=0.0),
        [dict(re_prob=0.0), dict(interpolation="bilinear"), dict(auto_augment="rand-m7-mstd0.5-inc1"),
         dict(hflip=0.0), dict(re_mode="const")],
    ),
    "RandAugment, every option off its default": (
        ["--input-size", "48", "--aa", "rand-m7-mstd0.5-inc1-n3", "--reprob", "0.6", "--remode", "rand",
         "--recount", "3", "--scale", "0.25", "0.9", "--ratio", "0.6", "1.6", "--hflip", "0.3",
         "--train-interpolation", "bilinear", "--color-jitter", "0.45"],
        dict(input_size=48, color_jitter=0.45, auto_augment="rand-m7-mstd0.5-inc1-n3", interpolation="bilinear",
             re_prob=0.6, re_mode="rand", re_count=3, scale=(0.25, 0.9), ratio=(0.6, 1.6), hflip=0.3, vflip=0.0),
        [dict(re_prob=0.25), dict(re_prob=0.0), dict(re_mode="pixel"), dict(re_count=1), dict(scale=(0.08, 1.0)),
         dict(ratio=(3 / 4, 4 / 3)), dict(hflip=0.5), dict(hflip=0.0), dict(vflip=0.5),
         dict(interpolation="bicubic"), dict(auto_augment="rand-m9-mstd0.5-inc1-n3"),
         dict(auto_augment="rand-m7-mstd0.5-inc1"), dict(auto_augment=None), dict(input_size=64),
         dict(mean=IMAGENET_INCEPTION_MEAN, std=IMAGENET_INCEPTION_STD)],
    ),
    # timm applies colour jitter only without auto-augment: this case is where --color-jitter matters
    "colour jitter, every option off its default": (
        ["--input-size", "64", "--aa", "none", "--color-jitter", "0.45", "--reprob", "0.5", "--remode", "const",
         "--recount", "2", "--scale", "0.3", "0.8", "--ratio", "0.7", "1.4", "--hflip", "0.8",
         "--train-interpolation", "random"],
        dict(input_size=64, color_jitter=0.45, auto_augment=None, interpolation="random", re_prob=0.5,
             re_mode="const", re_count=2, scale=(0.3, 0.8), ratio=(0.7, 1.4), hflip=0.8, vflip=0.0),
        [dict(color_jitter=0.3), dict(color_jitter=0.4), dict(color_jitter=0.0),
         dict(auto_augment="rand-m9-mstd0.5-inc1"), dict(interpolation="bicubic"), dict(interpolation="bilinear"),
         dict(re_prob=0.25), dict(re_mode="pixel"), dict(re_count=1), dict(scale=(0.08, 1.0)),
         dict(ratio=(3 / 4, 4 / 3)), dict(hflip=0.5)],
    ),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_transform_equals_timm(image_folder, case):
    argv, published, controls = TRAIN_CASES[case]
    ours, keys = _vim_ds_train(image_folder, argv)
    size = published["input_size"]
    assert all(out.shape == (3, size, size) and out.dtype == torch.float32 for out in ours)
    assert _equal(ours, _reference_train(keys, **published)), f"{case}: vim_ds's training transform differs from timm's"
    for change in controls:
        assert not _equal(ours, _reference_train(keys, **{**published, **change})), \
            f"{case}: the comparison cannot tell the reference with {change} apart"


EVAL_CASES = {
    "published defaults": ([], 224, 0.875, [dict(crop_pct=0.9), dict(interpolation="bilinear")]),
    # 48 / 0.7 = 68.57: int() gives 68, round() 69; --train-interpolation must not reach evaluation
    "non-default size and crop ratio": (
        ["--input-size", "48", "--eval-crop-ratio", "0.7", "--train-interpolation", "bilinear"], 48, 0.7,
        [dict(crop_pct=0.875), dict(crop_pct=0.69), dict(crop_pct=1.0), dict(interpolation="bilinear"),
         dict(crop_mode="squash"), dict(mean=IMAGENET_INCEPTION_MEAN, std=IMAGENET_INCEPTION_STD)],
    ),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_transform_equals_timm(image_folder, case):
    argv, size, ratio, controls = EVAL_CASES[case]
    dataset, _ = build_dataset(dataset_config(_config(image_folder, *argv)), is_train=False)
    ours = [dataset[i][0] for i in range(len(dataset))]
    paths = [path for path, _ in dataset.samples]
    published = dict(input_size=size, is_training=False, interpolation="bicubic", crop_pct=ratio)
    reference = create_transform(**published)
    resize = reference.transforms[0]
    assert type(resize).__name__ == "Resize" and resize.size == int(size / ratio)  # DeiT's formula
    assert all(out.shape == (3, size, size) for out in ours)
    assert _equal(ours, [reference(_decode(path)) for path in paths]), f"{case}: vim_ds's eval transform differs"
    for change in controls:
        control = create_transform(**{**published, **change})
        assert not _equal(ours, (control(_decode(path)) for path in paths)), \
            f"{case}: the comparison cannot tell the reference with {change} apart"


MIXUP_ARGV = ["--mixup", "0.3", "--cutmix", "0.7", "--mixup-prob", "0.6", "--mixup-switch-prob", "0.3",
              "--mixup-mode", "elem", "--smoothing", "0.15"]
MIXUP_CASES = {
    # the published main.py: Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=...,
    # prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
    # label_smoothing=args.smoothing, num_classes=args.nb_classes)
    "alphas": (MIXUP_ARGV, dict(mixup_alpha=0.3, cutmix_alpha=0.7, cutmix_minmax=None, prob=0.6, switch_prob=0.3,
                                mode="elem", label_smoothing=0.15, num_classes=7),
               [dict(mixup_alpha=0.8), dict(cutmix_alpha=1.0), dict(prob=1.0), dict(switch_prob=0.5),
                dict(switch_prob=0.6), dict(mode="batch"), dict(label_smoothing=0.1), dict(num_classes=10)]),
    # the default recipe: batch mode, which vim_ds applies pair by pair on host batches (`PairwiseMixup`); the
    # seeds draw both Mixup and CutMix batches
    "batch mode, the recipe's defaults": (
        [], dict(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, prob=1.0, switch_prob=0.5, mode="batch",
                 label_smoothing=0.1, num_classes=7),
        [dict(mixup_alpha=0.5), dict(cutmix_alpha=0.5), dict(prob=0.5), dict(switch_prob=0.0),
         dict(mode="pair"), dict(label_smoothing=0.0)]),
    # cutmix_minmax (a list, as argparse's nargs gives it) overrides the cutmix alpha and enables CutMix alone
    "cutmix minmax": (["--mixup", "0", "--cutmix", "0", "--cutmix-minmax", "0.2", "0.7", "--mixup-mode", "pair",
                       "--smoothing", "0.05"],
                      dict(mixup_alpha=0.0, cutmix_alpha=0.0, cutmix_minmax=[0.2, 0.7], prob=1.0, switch_prob=0.5,
                           mode="pair", label_smoothing=0.05, num_classes=7),
                      [dict(cutmix_minmax=None, cutmix_alpha=1.0), dict(cutmix_minmax=[0.3, 0.7]),
                       dict(mode="batch"), dict(label_smoothing=0.1)]),
}


def _mixed(mixup: Mixup, seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    images, targets = torch.rand(8, 3, 16, 16, generator=g), torch.randint(0, 7, (8,), generator=g)
    np.random.seed(seed)  # timm's Mixup draws its lambdas and choices from NumPy's global generator
    return mixup(images, targets)


def _same_mixing(a: Mixup, b: Mixup) -> bool:
    return all(torch.equal(x, y) for seed in range(6) for x, y in zip(_mixed(a, seed), _mixed(b, seed)))


@pytest.mark.parametrize("case", list(MIXUP_CASES))
def test_mixup_equals_published_construction(case):
    argv, published, controls = MIXUP_CASES[case]
    args = _args("unused", *argv)
    ours = build_mixup(mixup_config(RunConfig.from_dict(vars(args))), micro_batch=8, num_classes=7)
    reference = Mixup(**published)
    assert isinstance(ours, Mixup) and vars(ours) == vars(reference)
    assert _same_mixing(ours, reference)
    for change in controls:
        control = Mixup(**{**published, **change})
        assert vars(ours) != vars(control) and not _same_mixing(ours, control), change
    # with Mixup the targets are soft (smoothing already in them): timm's SoftTargetCrossEntropy, as published
    assert type(build_criterion(args.smoothing, ours)) is SoftTargetCrossEntropy


def test_no_mixup_when_published_recipe_has_none():
    """mixup_active = mixup > 0 or cutmix > 0 or cutmix_minmax is not None; without it, label smoothing (or plain
    cross entropy at 0) as the published main.py chooses."""
    args = _args("unused", "--mixup", "0", "--cutmix", "0", "--smoothing", "0.2")
    assert build_mixup(mixup_config(RunConfig.from_dict(vars(args))), micro_batch=8, num_classes=7) is None
    criterion = build_criterion(args.smoothing, None)
    assert type(criterion) is LabelSmoothingCrossEntropy and criterion.smoothing == 0.2
    args = _args("unused", "--mixup", "0", "--cutmix", "0", "--smoothing", "0")
    assert type(build_criterion(args.smoothing, None)) is torch.nn.CrossEntropyLoss
