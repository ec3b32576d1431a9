"""An ImageNet-like folder of real photographs, for measuring the input pipeline (the command: `vim-ds data photos`).

What a data-loading benchmark measures depends on the files: decoding a 500x375 JPEG of a photograph costs far
more than decoding the 8x8 digits, and JPEG decoding time depends on the picture's content (its entropy), not only
its size. This writes JPEGs made from the real photographs that ship with scikit-learn
(`sklearn.datasets.load_sample_images()`: two 640x427 photos), each a different random crop, mirrored or not,
colour-shifted, with a little sensor-like noise, resized to one of ImageNet's most common sizes and saved at JPEG
quality 90 with 4:2:0 chroma subsampling (what most ImageNet files use). Labels carry no meaning beyond their
folder: the data set is for timing, not for learning.

Every image is a pure function of (seed, split, class, index): the same seed writes the same bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# ImageNet-1k's most common training-image sizes (width x height); ~40% of its files are exactly 500x375 or 375x500
DEFAULT_SIZES = ((500, 375), (500, 333), (375, 500), (500, 400), (333, 500))
DEFAULT_QUALITY = 90
SPLITS = ("train", "val")


def _source_photos() -> list[np.ndarray]:
    # scikit-learn here, not at the top: seconds of start-up, for writing the photos only
    from sklearn.datasets import load_sample_images

    return [np.asarray(image, dtype=np.uint8) for image in load_sample_images().images]


def make_photo(source: np.ndarray, size: tuple[int, int], rng: np.random.Generator, tint: np.ndarray):
    """One PIL image of `size` (width, height) from `source` (H, W, 3 uint8): a random crop of the source's aspect
    -matched window (at least 40% of its largest area), mirrored half the time, per-channel gains (`tint` x a
    random jitter), a random gamma and mild Gaussian noise."""
    width, height = size
    src_h, src_w = source.shape[:2]
    aspect = width / height
    # the largest window of the target's aspect that fits the source
    max_w = min(src_w, int(src_h * aspect))
    max_h = min(src_h, int(max_w / aspect))
    side = np.sqrt(rng.uniform(0.4, 1.0))
    crop_w, crop_h = max(8, int(max_w * side)), max(8, int(max_h * side))
    x0 = int(rng.integers(0, src_w - crop_w + 1))
    y0 = int(rng.integers(0, src_h - crop_h + 1))
    patch = source[y0:y0 + crop_h, x0:x0 + crop_w]
    if rng.random() < 0.5:
        patch = patch[:, ::-1]
    image = Image.fromarray(np.ascontiguousarray(patch)).resize((width, height), Image.Resampling.LANCZOS)
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    gains = tint * rng.uniform(0.9, 1.1, size=3)
    pixels = np.clip(pixels * gains, 0.0, 1.0) ** rng.uniform(0.8, 1.25)
    pixels = pixels * 255.0 + rng.normal(0.0, 2.0, size=pixels.shape)
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))


def class_name(index: int) -> str:
    return f"c{index:03d}"


def write_photos(out_dir, *, classes: int = 10, per_class: int = 50, val_per_class: int | None = None,
                 seed: int = 0, quality: int = DEFAULT_QUALITY, sizes=DEFAULT_SIZES) -> dict:
    """Write `out_dir/{train,val}/c<k>/<split>_<n>.jpg`; return the counts. Class k starts from source photo
    k mod 2 with its own colour tint; every image is its own crop, flip, colour shift and size (picked from
    `sizes`, (width, height) pairs)."""
    if classes < 1 or per_class < 1:
        raise ValueError(f"--classes and --per-class must be at least 1, got {classes} and {per_class}")
    val_per_class = max(1, per_class // 5) if val_per_class is None else val_per_class
    if val_per_class < 1:
        raise ValueError(f"--val-per-class must be at least 1, got {val_per_class}")
    if not 1 <= quality <= 100:
        raise ValueError(f"--quality must be between 1 and 100, got {quality}")
    sources = _source_photos()
    counts = {"train": 0, "val": 0, "classes": classes}
    for k in range(classes):
        tint = np.random.default_rng([seed, k, 0]).uniform(0.8, 1.2, size=3)
        for split_id, (split, n) in enumerate((("train", per_class), ("val", val_per_class))):
            folder = Path(out_dir) / split / class_name(k)
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                rng = np.random.default_rng([seed, k, 1 + split_id, i])
                size = tuple(sizes[int(rng.integers(len(sizes)))])
                image = make_photo(sources[k % len(sources)], size, rng, tint)
                image.save(folder / f"{split}_{i:05d}.jpg", format="JPEG", quality=quality, subsampling="4:2:0")
            counts[split] += n
    return counts
