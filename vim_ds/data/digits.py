"""scikit-learn's bundled handwritten digits as an ImageNet-layout folder (the command: `vim-ds data digits`).

1,797 real 8x8 grayscale images of 10 classes ship inside scikit-learn, so a real image-classification run
(decode, augment, train, evaluate) works on a machine with no network and no ImageNet.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np


def _val_counts(class_sizes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Validation images per class: val_fraction of each class, rounded by largest remainder so the total is
    ceil(val_fraction × N) (scikit-learn's convention), and at least one image of each class in each split."""
    exact = class_sizes * val_fraction
    counts = np.floor(exact).astype(int)
    short = math.ceil(class_sizes.sum() * val_fraction - 1e-9) - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return np.clip(counts, 1, class_sizes - 1)


def write_digits(out_dir, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write `out_dir/{train,val}/<digit>/<n>.png` (n: the image's index in `load_digits()`); return the counts.

    Pixel values 0..16 are scaled to 0..255. The split is stratified and deterministic: per class, a permutation
    seeded by (seed, class) picks the validation images.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    labels = np.asarray(digits.target)
    num_classes = int(labels.max()) + 1
    n_val = _val_counts(np.bincount(labels, minlength=num_classes), val_fraction)
    counts = {"train": 0, "val": 0, "classes": num_classes}
    for cls in range(num_classes):
        members = np.flatnonzero(labels == cls)
        members = members[np.random.default_rng([seed, cls]).permutation(len(members))]
        for split, chosen in (("val", members[: n_val[cls]]), ("train", members[n_val[cls]:])):
            folder = Path(out_dir) / split / str(cls)
            folder.mkdir(parents=True, exist_ok=True)
            for n in sorted(chosen):
                Image.fromarray(images[n]).save(folder / f"{n:04d}.png")
            counts[split] += len(chosen)
    return counts


def clear_output_folder(out: Path, force: bool) -> str | None:
    """Make `out` ready for a data set writer: why not (a file; a non-empty folder without `force`), or None after
    removing its train/ and val/ (with `force`; nothing else in it is touched)."""
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    if out.is_dir() and any(out.iterdir()):
        if not force:
            return f"{out} exists and is not empty; pass --force to replace its train/ and val/"
        for split in ("train", "val"):
            shutil.rmtree(out / split, ignore_errors=True)
    return None
