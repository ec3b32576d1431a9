"""Datasets: ImageNet-layout folders and synthetic images, with per-sample seeding and bad-image skipping.

Every dataset here answers `dataset[index]` or `dataset[(index, sample_seed)]` with `(image, target, ok)`:

* With a sample seed, Python's `random`, NumPy's global RNG and torch's CPU RNG are seeded from it while that
  sample is loaded and augmented, and restored afterwards. Augmentation is then a pure function of the seed that
  the sampler assigns to a position in the epoch, so a run gives the same batches whatever the number of ranks,
  data-loader workers or the order in which workers finish — and resuming mid-epoch replays the same samples.
* A file that cannot be decoded is skipped instead of killing a days-long run: `ok` is 0 and the image and target
  are those of the next decodable index, so the batch keeps its shape. The trainer counts `ok == 0` (and fails
  above a threshold); the evaluator masks those samples out.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import os
import random
from collections import Counter

import numpy as np
import torch
from PIL import UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from .transforms import build_transform

log = logging.getLogger(__name__)

MAX_BAD_IN_A_ROW = 100  # more consecutive undecodable files than this is a broken data set, not a few bad files


class DataError(ValueError):
    """The data is unusable; the message is one line that names the path (or the number) at fault."""


def derive_seed(*parts) -> int:
    """A 63-bit seed from a tuple of ints/strings (blake2b): well mixed, stable across processes and Python runs."""
    parts = tuple(p if isinstance(p, str) else int(p) for p in parts)  # numpy ints would repr differently
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@contextlib.contextmanager
def seeded_rngs(seed: int):
    """Seed `random`, `numpy.random` and torch's CPU generator from `seed`; restore their states on exit.

    Only the CPU generator is touched (`torch.manual_seed` would also reseed the CUDA generators, which the main
    process uses for dropout and which data loading must not disturb).
    """
    saved = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.default_generator.set_state(saved[2])


class BadImage(Exception):
    """Raised by `SeededDataset.load` for a file that cannot be decoded."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


_warned: set = set()  # per process: one warning per bad file, however many epochs read it


def _warn_bad(bad: BadImage) -> None:
    if bad.path not in _warned:
        _warned.add(bad.path)
        log.warning("warning: cannot decode %s (%s); skipped", bad.path, bad.reason)


class SeededDataset(Dataset):
    """Base class: key parsing, per-sample seeding and skipping of undecodable files. Subclasses implement
    `__len__` and `load(index) -> (image_tensor, target)`, raising `BadImage` for a file that cannot be decoded."""

    def load(self, index: int):
        raise NotImplementedError

    def __getitem__(self, key):
        index, sample_seed = key if isinstance(key, tuple) else (key, None)
        n = len(self)
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        seeding = seeded_rngs(int(sample_seed)) if sample_seed is not None else contextlib.nullcontext()
        with seeding:
            for step in range(min(MAX_BAD_IN_A_ROW, n)):
                try:
                    image, target = self.load((index + step) % n)
                except BadImage as bad:
                    _warn_bad(bad)
                    continue
                return image, target, int(step == 0)
        raise DataError(f"{min(MAX_BAD_IN_A_ROW, n)} consecutive images from {self.describe(index % n)} "
                        f"cannot be decoded; the data set looks broken")

    def describe(self, index: int) -> str:
        return f"index {index}"


def _decode_failure(path: str, exc: Exception) -> str:
    """A short reason: PIL's own messages repeat the file object, which the warning already names."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
    except OSError:
        pass
    if isinstance(exc, FileNotFoundError):
        return "the file is gone: deleted or moved after the data set was listed"
    if isinstance(exc, UnidentifiedImageError):
        return "not an image PIL can identify"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class FolderDataset(SeededDataset):
    """One split of an ImageNet-layout folder (`root/<class>/<image>`), on top of torchvision's ImageFolder.

    Files are decoded here rather than in `ImageFolder.__getitem__`, so that decoding failures (skipped) are told
    apart from transform failures (bugs, raised).
    """

    def __init__(self, root: str, transform):
        ignored = {"count": 0, "example": None}

        def is_image(path: str) -> bool:
            if has_file_allowed_extension(path, IMG_EXTENSIONS):
                return True
            ignored["count"] += 1
            ignored["example"] = ignored["example"] or path
            return False

        # allow_empty: the class list (and so every class index) comes from the folder names alone
        self.folder = ImageFolder(root, transform=transform, is_valid_file=is_image, allow_empty=True)
        self.ignored_files, self.ignored_example = ignored["count"], ignored["example"]

    root = property(lambda self: self.folder.root)
    transform = property(lambda self: self.folder.transform)
    classes = property(lambda self: self.folder.classes)
    class_to_idx = property(lambda self: self.folder.class_to_idx)
    samples = property(lambda self: self.folder.samples)
    targets = property(lambda self: self.folder.targets)

    def __len__(self) -> int:
        return len(self.folder.samples)

    def describe(self, index: int) -> str:
        return self.folder.samples[index][0]

    def load(self, index: int):
        path, target = self.folder.samples[index]
        try:
            image = self.folder.loader(path)
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, EOFError ... for broken files
            raise BadImage(path, _decode_failure(path, exc)) from exc
        return self.folder.transform(image), target


class SyntheticDataset(SeededDataset):
    """Standard-normal images and uniform labels; sample i is a pure function of (seed, split, i). No disk."""

    def __init__(self, size: int, input_size: int, num_classes: int, seed: int, is_train: bool):
        self.size, self.input_size, self.num_classes = int(size), int(input_size), int(num_classes)
        self.seed, self.split = int(seed), "train" if is_train else "val"
        self.classes = [str(c) for c in range(self.num_classes)]

    def __len__(self) -> int:
        return self.size

    def load(self, index: int):
        g = torch.Generator().manual_seed(derive_seed("synthetic", self.seed, self.split, index))
        image = torch.randn(3, self.input_size, self.input_size, generator=g)
        return image, int(torch.randint(self.num_classes, (), generator=g))


def _class_folders(split_dir: str) -> list:
    """Class folders as ImageFolder finds them (sorted directory names), so the two lists agree."""
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def _checked_split(root, split: str) -> list:
    """Check `root/split/<class>/` exists; return its class folder names."""
    if not root:
        raise DataError("no --data-path given: it must hold train/<class>/* and val/<class>/* (the ImageNet layout)")
    if not os.path.isdir(root):
        raise DataError(f"data path {root} does not exist (expected {root}/train/<class>/* and {root}/val/<class>/*)")
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise DataError(f"{split_dir} is missing: the data path must hold train/<class>/* and val/<class>/*")
    classes = _class_folders(split_dir)
    if not classes:
        raise DataError(f"{split_dir} has no class folders (expected {split_dir}/<class>/<image files>)")
    return classes


def _folder_dataset(root: str, is_train: bool, transform) -> FolderDataset:
    split = "train" if is_train else "val"
    train_classes = _checked_split(root, "train")
    classes = train_classes if is_train else _checked_split(root, "val")
    if classes != train_classes:  # both sorted: equal sets give equal lists
        first = sorted(set(train_classes) ^ set(classes))[0]
        has, lacks = ("train", "val") if first in train_classes else ("val", "train")
        raise DataError(f"class folders of {os.path.join(root, 'train')} and {os.path.join(root, 'val')} differ: "
                        f"{first!r} is in {has}/ but not in {lacks}/")
    dataset = FolderDataset(os.path.join(root, split), transform)
    if dataset.ignored_files and _is_rank0():
        log.warning("warning: ignored %d file(s) in %s without an image extension (%s), e.g. %s",
                    dataset.ignored_files, dataset.root, " ".join(IMG_EXTENSIONS), dataset.ignored_example)
    counts = Counter(dataset.targets)
    for idx, name in enumerate(dataset.classes):
        if counts[idx]:
            continue
        folder = os.path.join(root, split, name)
        if is_train:  # a class the model could never learn: almost always a failed copy or extraction
            raise DataError(f"class folder {folder} has no image files ({' '.join(IMG_EXTENSIONS)}); add its "
                            f"images, or remove the folder (which renumbers the classes after it)")
        if _is_rank0():  # still a class of the head: its index (and every later one) stays where training put it
            log.warning("warning: class folder %s has no image files; class %d (%s) is not evaluated",
                        folder, idx, name)
    return dataset


def _is_rank0() -> bool:
    """Data-set warnings are the same on every rank: only the first says them (RANK is set by the launchers)."""
    return os.environ.get("RANK", "0") == "0"


def build_dataset(args, is_train: bool):
    """(dataset, num_classes) for the trainer's `--data-set`:

    * `IMNET`, `folder`: `data_path/train/<class>/*` and `data_path/val/<class>/*` (class index = sorted folder name;
      the val split must have exactly the train split's classes).
    * `synthetic`: `synthetic_size` training images (default 1280) and max(1, synthetic_size // 10) validation
      images of `nb_classes` classes at `input_size`, generated on the fly (no augmentation: they are noise).
    """
    kind = getattr(args, "data_set", "IMNET")
    if kind == "synthetic":
        size = int(getattr(args, "synthetic_size", 1280))
        if not is_train:
            size = max(1, size // 10)
        classes = int(getattr(args, "nb_classes", 1000))
        dataset = SyntheticDataset(size, getattr(args, "input_size", 224), classes, getattr(args, "seed", 0), is_train)
        return dataset, classes
    if kind in ("IMNET", "folder"):
        dataset = _folder_dataset(getattr(args, "data_path", None), is_train, build_transform(args, is_train))
        return dataset, len(dataset.classes)
    raise DataError(f"unknown --data-set {kind!r}: choose IMNET or folder (ImageNet layout) or synthetic")
