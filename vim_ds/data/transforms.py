"""Image transforms for training and evaluation (DeiT's recipe, built from timm's library functions)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageOps
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, auto_augment, create_transform
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode


def _posterize(img, bits_to_keep, **_):
    """timm's posterize op, defined for 0 bits too.

    RandAugment's `inc1` policies map the strongest PosterizeIncreasing level to "keep 0 bits" (a black image);
    Pillow >= 11 refuses bits=0 with a ValueError, which would kill a worker at a random step of a long run.
    """
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


for _name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
    auto_augment.NAME_TO_OP[_name] = _posterize


def _auto_augment(aa) -> str | None:
    """`--aa none` (or an empty value) turns RandAugment/AutoAugment off; timm wants None for that."""
    if aa is None or str(aa).strip().lower() in ("", "none"):
        return None
    return str(aa)


@dataclass(frozen=True)
class TransformConfig:
    """What the transforms are made from; the fields are `vim-ds train`'s options of the same names (the engine
    fills every one from them: config/components.py)."""

    input_size: int
    # evaluation: resize the short side to input_size / eval_crop_ratio, centre-crop
    eval_crop_ratio: float
    # training: timm's ImageNet pipeline
    scale: tuple[float, float]  # random-resized-crop area range
    ratio: tuple[float, float]  # random-resized-crop aspect range
    hflip: float
    aa: str | None  # RandAugment/AutoAugment policy; None, "" or "none": off
    color_jitter: float  # timm applies it only when `aa` is off
    train_interpolation: str
    reprob: float  # random erasing
    remode: str
    recount: int


def build_transform(config: TransformConfig, is_train: bool):
    """The transform for one split.

    Training: timm's ImageNet training pipeline (RandomResizedCrop with `scale`/`ratio`, horizontal flip,
    RandAugment `aa` or else colour jitter — timm applies colour jitter only when auto-augment is off —, then
    normalisation and random erasing). Evaluation: `eval_transform`.
    """
    if not is_train:
        return eval_transform(config.input_size, config.eval_crop_ratio)
    return create_transform(
        int(config.input_size),
        is_training=True,
        color_jitter=config.color_jitter,
        auto_augment=_auto_augment(config.aa),
        interpolation=config.train_interpolation,
        re_prob=config.reprob,
        re_mode=config.remode,
        re_count=config.recount,
        scale=config.scale,
        ratio=config.ratio,
        hflip=config.hflip,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    )


def eval_transform(input_size: int, eval_crop_ratio: float):
    """Resize the short side to input_size / eval_crop_ratio (bicubic), centre-crop input_size, normalise. Unlike
    DeiT, small inputs are not special-cased: every image goes through the resize, which is what makes 8x8 digits
    usable at 32 px or 224 px."""
    size = int(input_size)
    return T.Compose([
        T.Resize(int(size / eval_crop_ratio), interpolation=InterpolationMode.BICUBIC),
        T.CenterCrop(size),
        T.ToTensor(),
        T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])


# -- the hand-over split: uint8 in the workers, float in the consuming process ------------------------------------

_TO_FLOAT = ("ToTensor", "MaybeToTensor")


class Finish:
    """What runs in the process that consumes the batches, after the workers hand over uint8 images (timm's
    prefetcher idea, on the CPU): conversion to float32 and normalisation, then random erasing per sample.

    Normalising does the float operations of torchvision's `ToTensor` + `Normalize` in the same order
    (x / 255, - mean, / std), so its output equals the all-in-the-worker transform bit for bit. Erasing is timm's
    own `RandomErasing` object from the transform `create_transform` built, applied to each sample with Python's
    `random` and torch's CPU generator seeded from that sample's erase seed (see `SeededDataset`): which pixels are
    erased depends on the sample, never on the batch it landed in, the worker that made it or the rank.
    """

    def __init__(self, mean, std, erasing=None):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.erasing = erasing

    def normalize(self, images: torch.Tensor, pin_memory: bool = False) -> torch.Tensor:
        """uint8 (B, C, H, W) -> normalised float32 in a new (optionally pinned) buffer.

        One image at a time: its float32 copy (600 KB at 224 px) stays in the CPU cache through the three
        operations, so the batch is written to memory once instead of read and written three times (measured on
        2 cores of an AMD EPYC, batch 64 at 224 px: 0.26 against 0.68 ms per image, same bits)."""
        out = torch.empty(images.shape, dtype=torch.float32, pin_memory=pin_memory)
        mean, std = self.mean[0], self.std[0]
        for image, dest in zip(images, out):
            dest.copy_(image).div_(255).sub_(mean).div_(std)
        return out

    def erase(self, images: torch.Tensor, seeds) -> torch.Tensor:
        """Random erasing in place, sample i seeded by `seeds[i]` (a negative seed: the RNGs as they are)."""
        if self.erasing is None:
            return images
        seeds = [int(s) for s in seeds]
        if all(s < 0 for s in seeds):
            for image in images:
                self.erasing(image)
            return images
        saved = random.getstate(), torch.default_generator.get_state()
        try:
            for image, seed in zip(images, seeds):
                if seed >= 0:
                    random.seed(seed)
                    torch.default_generator.manual_seed(seed)
                self.erasing(image)
        finally:
            random.setstate(saved[0])
            torch.default_generator.set_state(saved[1])
        return images

    def __call__(self, images: torch.Tensor, seeds, pin_memory: bool = False) -> torch.Tensor:
        return self.erase(self.normalize(images, pin_memory), seeds)

    def one(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        """The same for one sample (C, H, W)."""
        return self(image.unsqueeze(0), [seed])[0]


def split_transform(transform):
    """(worker part, `Finish`) of a transform made of timm/torchvision steps that ends in a to-float-tensor step,
    `Normalize` and optionally `RandomErasing` (what `build_transform` returns): the worker part keeps every step
    before the tensor conversion and converts to a uint8 tensor instead (torchvision's `PILToTensor`: 4x fewer
    bytes to collate and to pass through shared memory); the rest becomes the `Finish`. Returns (transform, None)
    for a transform of another shape."""
    steps = list(getattr(transform, "transforms", []))
    names = [type(step).__name__ for step in steps]
    tail = names[-3:] if names and names[-1] == "RandomErasing" else names[-2:]
    if len(tail) < 2 or tail[0] not in _TO_FLOAT or tail[1] != "Normalize":
        return transform, None
    normalize = steps[len(steps) - len(tail) + 1]
    erasing = steps[-1] if tail[-1] == "RandomErasing" else None
    if erasing is not None and str(getattr(erasing, "device", "cpu")) != "cpu":
        return transform, None
    worker = T.Compose([*steps[:len(steps) - len(tail)], T.PILToTensor()])
    return worker, Finish(normalize.mean, normalize.std, erasing)


def build_handover_transform(config: TransformConfig, is_train: bool):
    """`build_transform`'s pipeline split for uint8 hand-over: (worker transform -> uint8 tensor, `Finish`)."""
    return split_transform(build_transform(config, is_train))
