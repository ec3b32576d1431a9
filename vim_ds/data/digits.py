"""scikit-learn's bundled handwritten digits as an ImageNet-layout folder (the command: `vim-ds data digits`).

1,797 real 8x8 grayscale images of 10 classes ship inside scikit-learn, so a real image-classification run
(decode, augment, train, evaluate) works on a machine with no network and no ImageNet.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image


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
    # scikit-learn here, not at the top: seconds of start-up, for writing the data set only
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


# The files `vim-ds data digits` and `vim-ds data photos` write in a split: `<class>/<n>.png` (write_digits) and
# `<class>/<split>_<n>.jpg` (photos.write_photos)
_WRITTEN = re.compile(r"[^/]+/(?:\d{4}\.png|(?:train|val)_\d{5}\.jpg)")


def _not_written(split: Path) -> str | None:
    """The first entry of a split folder that the data writers would not have written (a file of another name, a
    link, a file where a folder belongs), or None."""
    if split.is_symlink() or not split.is_dir():
        return str(split)
    for root, folders, files in os.walk(split):
        for name in files + [f for f in folders if os.path.islink(os.path.join(root, f))]:
            path = os.path.join(root, name)
            if os.path.islink(path) or not _WRITTEN.fullmatch(os.path.relpath(path, split).replace(os.sep, "/")):
                return path
    return None


def clear_output_folder(out: Path, force: bool) -> str | None:
    """Make `out` ready for a data set writer: why not (a file; a non-empty folder without `force`; with `force`, a
    train/ or val/ holding files these writers did not write), or None after removing its train/ and val/ (with
    `force`: the files these writers name as they do, then the folders left empty; nothing else in it is touched)."""
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    if out.is_dir() and any(out.iterdir()):
        if not force:
            return f"{out} exists and is not empty; pass --force to replace its train/ and val/"
        splits = [out / split for split in ("train", "val") if os.path.lexists(out / split)]
        for split in splits:
            foreign = _not_written(split)
            if foreign:
                return (f"{split} holds files vim-ds data did not write (e.g. {foreign}); --force replaces only what "
                        f"it wrote: move them away or give another --out")
        for split in splits:
            for root, folders, files in os.walk(split, topdown=False):
                for name in files:
                    os.remove(os.path.join(root, name))
                for name in folders:
                    os.rmdir(os.path.join(root, name))
            os.rmdir(split)
    return None
