"""Image transforms for training and evaluation (DeiT's recipe, built from timm's library functions)."""
from __future__ import annotations

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


def build_transform(args, is_train: bool):
    """The transform for one split, from the trainer's argparse namespace.

    Training: timm's ImageNet training pipeline (RandomResizedCrop with `scale`/`ratio`, horizontal flip,
    RandAugment `aa` or else colour jitter — timm applies colour jitter only when auto-augment is off —, then
    normalisation and random erasing). Evaluation: resize the short side to input_size / eval_crop_ratio (bicubic),
    centre-crop input_size. Unlike DeiT, small inputs are not special-cased: every image goes through the resize,
    which is what makes 8x8 digits usable at 32 px or 224 px.
    """
    size = int(getattr(args, "input_size", 224))
    if is_train:
        return create_transform(
            size,
            is_training=True,
            color_jitter=getattr(args, "color_jitter", 0.3),
            auto_augment=_auto_augment(getattr(args, "aa", "rand-m9-mstd0.5-inc1")),
            interpolation=getattr(args, "train_interpolation", "bicubic"),
            re_prob=getattr(args, "reprob", 0.25),
            re_mode=getattr(args, "remode", "pixel"),
            re_count=getattr(args, "recount", 1),
            scale=tuple(getattr(args, "scale", (0.08, 1.0))),
            ratio=tuple(getattr(args, "ratio", (3.0 / 4.0, 4.0 / 3.0))),
            hflip=getattr(args, "hflip", 0.5),
            mean=IMAGENET_DEFAULT_MEAN,
            std=IMAGENET_DEFAULT_STD,
        )
    resize = int(size / getattr(args, "eval_crop_ratio", 0.875))
    return T.Compose([
        T.Resize(resize, interpolation=InterpolationMode.BICUBIC),
        T.CenterCrop(size),
        T.ToTensor(),
        T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
