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
import errno
import hashlib
import logging
import operator
import os
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from PIL import UnidentifiedImageError
from torch.utils.data import Dataset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from .images import open_rgb
from .names import alike, look_alike_key, quoted
from .transforms import TransformConfig, build_handover_transform

log = logging.getLogger(__name__)

# more consecutive undecodable files than this is a broken data set, not a few bad files
MAX_BAD_IN_A_ROW = 100


class DataError(ValueError):
    """The data is unusable; the message is one line that names the path (or the number) at fault."""


def derive_seed(*parts) -> int:
    """A 63-bit seed from a tuple of ints/strings (blake2b): well mixed, stable across processes and Python runs."""
    # numpy ints would repr differently
    parts = tuple(p if isinstance(p, str) else int(p) for p in parts)
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@contextlib.contextmanager
def seeded_rngs(seed: int, restore: bool = True):
    """Seed `random`, `numpy.random` and torch's CPU generator from `seed`; restore their states on exit (unless
    `restore` is False: saving and restoring them is 90 % of the 0.18 ms this costs per sample).

    Only the CPU generator is touched (`torch.manual_seed` would also reseed the CUDA generators, which the main
    process uses for dropout and which data loading must not disturb).
    """
    saved = (random.getstate(), np.random.get_state(), torch.default_generator.get_state()) if restore else None
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.default_generator.set_state(saved[2])


def erase_seed(sample_seed) -> int:
    """The seed of a sample's random erasing (done after the hand-over, see `SeededDataset.handover_item`); -1 for
    a sample without a seed."""
    return -1 if sample_seed is None else derive_seed("erase", int(sample_seed))


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

    # a `transforms.Finish` when samples leave the workers as uint8 (see `handover_item`)
    finish = None
    # restore the global generators after a seeded sample? None: only outside data-loader workers
    restore_rngs = None

    def load(self, index: int):
        raise NotImplementedError

    def __getitem__(self, key):
        """(image, target, ok): the finished sample, as the model gets it."""
        image, target, ok, seed = self.handover_item(key)
        if self.finish is not None:
            image = self.finish.one(image, seed)
        return image, target, ok

    def handover_item(self, key):
        """(image, target, ok, erase_seed): what a data-loader worker hands over. With a `finish`, the image is
        uint8 and `finish` (normalisation, random erasing) runs in the consuming process on the collated batch,
        erasing sample i with the RNGs seeded from its `erase_seed`, derived from the sample seed (-1 when the key
        has no seed: the RNGs as they are)."""
        index, sample_seed = key if isinstance(key, tuple) else (key, None)
        image, target, ok = self._load_seeded(index, sample_seed)
        return image, target, ok, erase_seed(sample_seed)

    def _load_seeded(self, index, sample_seed):
        n = len(self)
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        # a data-loader worker's generators serve nothing but the samples, each seeded afresh: no need to restore
        restore = get_worker_info() is None if self.restore_rngs is None else self.restore_rngs
        seeding = seeded_rngs(int(sample_seed), restore=restore) if sample_seed is not None \
            else contextlib.nullcontext()
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


def decode_failure(path: str, exc: Exception) -> str:
    """A short reason: PIL's own messages repeat the file object, which the warning already names."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
    except OSError:
        pass
    if isinstance(exc, FileNotFoundError):
        if os.path.islink(path):  # listed as it is: an image whose link leads nowhere
            return f"a symlink to {os.readlink(path)}, which does not exist"
        return "the file is gone: deleted or moved after the data set was listed"
    if isinstance(exc, UnidentifiedImageError):
        return "not an image PIL can identify"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class FolderDataset(SeededDataset):
    """One split of an ImageNet-layout folder (`root/<class>/**/<image>`): the classes and the sample order of
    torchvision's ImageFolder, listed by `_FolderScan` (which also refuses symlink loops and skips hidden names)
    and decoded by `images.open_rgb` (torchvision's default loader, PIL's RGB conversion, except that 16-bit and
    other high-bit-depth images are scaled to 8 bits instead of clipped).

    Files are decoded here rather than in a transform, so that decoding failures (skipped) are told apart from
    transform failures (bugs, raised).
    """

    def __init__(self, root: str, transform, finish=None):
        scan = _FolderScan(root)
        self.root, self.transform, self.finish, self.loader = root, transform, finish, open_rgb
        self.classes, self.samples = scan.classes, scan.samples
        self.class_to_idx = {name: idx for idx, name in enumerate(self.classes)}
        self.targets = [target for _, target in self.samples]
        # counts and one example each, not the lists: the data set is pickled to every data-loader worker
        self.ignored_files, self.ignored_example = len(scan.ignored), (scan.ignored or [None])[0]
        self.hidden_entries, self.hidden_example = len(scan.hidden), (scan.hidden or [None])[0]
        self.loose_images, self.loose_example = len(scan.loose), (scan.loose or [None])[0]

    def __len__(self) -> int:
        return len(self.samples)

    def describe(self, index: int) -> str:
        return self.samples[index][0]

    def load(self, index: int):
        path, target = self.samples[index]
        try:
            image = self.loader(path)
        # PIL raises OSError, SyntaxError, ValueError, EOFError ... for broken files
        except Exception as exc:
            raise BadImage(path, decode_failure(path, exc)) from exc
        return self.transform(image), target


def _entries(folder: str, what: str = "folder", split_level: bool = False):
    """(hidden paths, sub-folder paths, file paths) of one folder, each sorted; symlinks are followed.

    Names starting with '.' are never classes or images: `.ipynb_checkpoints` (a copy of some images, which as a
    class folder would shift every label by one), macOS's `.DS_Store` and `._name.png` resource forks.

    What cannot be read is refused by name (a DataError), never skipped: a folder that cannot be listed (`what` names
    it: "class folder", "folder"), a symlink that never resolves (a loop), and a symlink that leads nowhere, which
    may be a folder on a disk not mounted: in `split_level` (the class folders' level) always, since a class left
    out would renumber the classes after it; below it, unless its name is an image's (an image file that is gone,
    skipped as any image that does not decode).
    """
    hidden, folders, files = [], [], []
    try:
        with os.scandir(folder) as listing:
            for entry in listing:
                if entry.name.startswith("."):
                    hidden.append(entry.path)
                elif _is_folder(entry, split_level):
                    folders.append(entry.path)
                else:
                    files.append(entry.path)
    except OSError as exc:
        raise _cannot_read(folder, exc, what) from None
    return sorted(hidden), sorted(folders), sorted(files)


_LEFT_OUT = {True: "a class folder there would be left out, and the classes after it renumbered",
             False: "the images of a folder there would be left out"}


def _is_folder(entry: os.DirEntry, split_level: bool) -> bool:
    """Whether `entry` is (or links to) a folder; a DataError for a link that never resolves or leads nowhere."""
    try:
        if entry.is_dir():  # follows a symlink
            return True
        if entry.is_symlink():
            os.stat(entry.path)  # a link to a file; raises for one that leads nowhere
        return False
    except FileNotFoundError:
        if not split_level and has_file_allowed_extension(entry.name, IMG_EXTENSIONS):
            return False  # an image that is gone: skipped, with its link's target, when it is read
        raise DataError(_leads_nowhere(entry.path, _LEFT_OUT[split_level])) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link to itself, or links that point at each other
            raise DataError(f"symlink loop: {_named(entry.path)} never reaches a file or folder; "
                            f"remove the link") from None
        # only a link is followed here (a plain entry's type comes with the listing): one to a place it cannot see
        raise _cannot_read(_named(entry.path), exc, "the target of") from None


def _leads_nowhere(path: str, lost: str | None) -> str:
    """The refusal of the symlink `path` to something that does not exist; `lost`: what skipping it would lose."""
    target = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    lost = f"{lost}; " if lost else ""
    return (f"{_named(path)} leads nowhere: {target} does not exist (a disk not mounted? moved?); {lost}mount or "
            f"restore it, or remove the link")


def _cannot_read(path: str, exc: OSError, what: str) -> DataError:
    """The refusal of a folder that cannot be listed: skipping it would leave its images (as a class folder: its
    class, renumbering those after it) out without a word."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        fix = "give the user running vim-ds read and execute permission on it (chmod a+rx)"
    else:
        fix = "the disk or file system holding it failed (see dmesg); repair or remount it"
    return DataError(f"{what} {path} cannot be read ({reason}): {fix}")


def _named(path: str) -> str:
    return f"{path} (a symlink to {os.readlink(path)})" if os.path.islink(path) else path


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class _FolderScan:
    """Lists `split_dir/<class>/**/<image>` as ImageFolder does (class = sorted folder name; samples sorted by
    folder path, then by name; symlinks followed), except that:

    * a folder reached a second time is refused with one line naming the path that reaches it. ImageFolder walks
      a link to an ancestor (`ln -s .. train/0/loop`) until the OS refuses the path: 40 copies of the data set,
      all labelled with one class. A link into another class folder would list its images under two labels.
      Folders are told apart by (st_dev, st_ino), which also catches bind mounts; files are not (a stat per file
      would cost minutes on a network file system), so a symlinked file is listed as it is, once.
    * hidden names are skipped (`_entries`), and counted.
    * what cannot be read is refused by name (`_entries`): a class folder that is a symlink leading nowhere (a disk
      not mounted), a folder that cannot be listed (permissions, an I/O error), a loop. ImageFolder skips the first
      (a class fewer, the labels after it shifted by one) and stops with a traceback on the others.
    * two class folders whose names look the same (`names.alike`: `zéro` in NFC and in NFD) are refused: two classes
      every message and prediction would show alike.
    * images beside the class folders (no class's samples, as in ImageFolder) are counted (`loose`) for a warning.

    With `walk` False only the class folders are listed and checked (each opened, none walked): what the preflight
    and `predict --classes FOLDER` need, at the cost of one stat and one open per class.
    """

    def __init__(self, split_dir: str, walk: bool = True):
        self.hidden, class_dirs, files = _entries(split_dir, split_level=True)
        self.loose = [file for file in files if has_file_allowed_extension(file, IMG_EXTENSIONS)]
        self.classes = [os.path.basename(path) for path in class_dirs]
        _refuse_look_alikes(split_dir, self.classes)
        self.samples, self.ignored = [], []
        self.seen = {}  # identity -> (path, class) of every folder listed so far
        holders = {}  # identity -> path of the split folder and of every folder above it
        up = os.path.realpath(split_dir)
        while up not in holders.values():
            holders[_identity(up)] = up
            up = os.path.dirname(up)
        # every class folder is claimed first, so that a link from one class into another is caught either way
        keys = [self._claim(path, name, holders) for path, name in zip(class_dirs, self.classes)]
        if not walk:
            for path in class_dirs:
                _open_folder(path, "class folder")
            return
        for idx, (path, name, key) in enumerate(zip(class_dirs, self.classes, keys)):
            listed = []
            self._walk(path, name, {**holders, key: path}, listed, "class folder")
            # ImageFolder's order: folders by path, then files by name
            for _, files in sorted(listed):
                for file in files:
                    if has_file_allowed_extension(file, IMG_EXTENSIONS):
                        self.samples.append((file, idx))
                    else:
                        self.ignored.append(file)

    def _claim(self, path: str, name: str, holders: dict) -> tuple:
        key = _identity(path)
        if key in holders:
            raise DataError(f"symlink loop: {_named(path)} leads back to {holders[key]}, which holds it, so its "
                            f"images would be listed over and over; remove the link")
        if key in self.seen:
            first, first_class = self.seen[key]
            where = (f"under classes {quoted(first_class)} and {quoted(name)}" if first_class != name else
                     f"in class {quoted(name)}")
            raise DataError(f"{_named(path)} is the same folder as {_named(first)}: its images would be listed "
                            f"twice, {where}; remove the link or copy the folder")
        self.seen[key] = path, name
        return key

    def _walk(self, folder: str, name: str, holders: dict, listed: list, what: str = "folder") -> None:
        """Depth first below `folder` of class `name`; `holders`: identity -> path of the folders holding it."""
        hidden, folders, files = _entries(folder, what)
        self.hidden += hidden
        listed.append((folder, files))
        for path in folders:
            key = self._claim(path, name, holders)
            self._walk(path, name, {**holders, key: path}, listed)


def _open_folder(path: str, what: str) -> None:
    """Open `path` and read its first entry, as listing it would: a DataError if it cannot be read."""
    try:
        with os.scandir(path) as listing:
            next(listing, None)
    except OSError as exc:
        raise _cannot_read(path, exc, what) from None


def _refuse_look_alikes(split_dir: str, classes: list) -> None:
    """Two class folders whose names print the same (see `names`) would be two classes no message could tell
    apart."""
    first = {}
    for name in classes:
        twin = first.setdefault(look_alike_key(name), name)
        if twin != name:
            raise DataError(f"class folders {quoted(twin)} and {quoted(name)} of {split_dir} look the same: "
                            f"{alike(twin, name)}; they would be two classes that every message and prediction "
                            f"shows alike: merge them into one folder, or rename one")


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


def class_folders(split_dir: str) -> list:
    """Class folders as `_FolderScan` finds them (sorted folder names, hidden ones left out), checked as it checks
    them (every one can be read; no link loops, none reached twice, no two names alike), so the two agree."""
    return _FolderScan(split_dir, walk=False).classes


def _checked_split(root, split: str) -> list:
    """Check `root/split/<class>/` exists; return its class folder names."""
    if not root:
        raise DataError("no --data-path given: it must hold train/<class>/* and val/<class>/* (the ImageNet layout)")
    layout = f"{root}/train/<class>/* and {root}/val/<class>/*"
    _refuse_dangling(root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f"data path {root} is a file, not a folder (expected {layout})")
    if not os.path.isdir(root):
        raise DataError(f"data path {root} does not exist (expected {layout})")
    split_dir = os.path.join(root, split)
    _refuse_dangling(split_dir)
    if os.path.exists(split_dir) and not os.path.isdir(split_dir):
        raise DataError(f"{split_dir} is a file, not a folder: the data path must hold train/<class>/* and "
                        f"val/<class>/*")
    if not os.path.isdir(split_dir):
        raise DataError(f"{split_dir} is missing: the data path must hold train/<class>/* and val/<class>/*")
    classes = class_folders(split_dir)
    if not classes:
        raise DataError(f"{split_dir} has no class folders (expected {split_dir}/<class>/<image files>)")
    return classes


def _refuse_dangling(path: str) -> None:
    """A data path or split folder that is a symlink leading nowhere is not "missing": `ls` shows it."""
    if os.path.islink(path) and not os.path.exists(path):
        try:
            os.stat(path)
        except FileNotFoundError:
            raise DataError(_leads_nowhere(path, None)) from None
        except OSError:
            pass  # a loop, or no permission on the way: the scan names it


def check_layout(root: str, need_train: bool = True) -> None:
    """The ImageNet layout's folders, without listing an image: root/train/<class>/ (when `need_train`) and
    root/val/<class>/, the same class folders in both; a DataError with the one-line cause otherwise."""
    classes = _checked_split(root, "val")
    if need_train:
        _same_classes(root, _checked_split(root, "train"), classes)


def _same_classes(root: str, train_classes: list, classes: list) -> None:
    if classes != train_classes:  # both sorted: equal sets give equal lists
        first = sorted(set(train_classes) ^ set(classes))[0]
        has, lacks = ("train", "val") if first in train_classes else ("val", "train")
        there = classes if lacks == "val" else train_classes
        raise DataError(f"class folders of {os.path.join(root, 'train')} and {os.path.join(root, 'val')} differ: "
                        f"{_not_in(root, first, has, lacks, there)}")


def _not_in(root: str, name: str, has: str, lacks: str, there: list) -> str:
    """Why class `name` of split `has` is not one of `lacks`, which holds the classes `there`, told so that it can
    be matched with what `ls` shows: a file of that name, or a folder whose name only looks the same."""
    if os.path.lexists(os.path.join(root, lacks, name)):  # not a folder (a link leading nowhere was refused)
        return f"{lacks}/{name} is a file, not a folder, so {quoted(name)} is a class of {has}/ only"
    twin = next((other for other in there if alike(other, name)), None)
    if twin is not None:
        train, val = (name, twin) if has == "train" else (twin, name)
        return (f"train/ has {quoted(train)} where val/ has {quoted(val)}: {alike(train, val)}; rename one like the "
                f"other")
    return f"{quoted(name)} is in {has}/ but not in {lacks}/"


def _folder_dataset(root: str, is_train: bool, transform, finish=None) -> FolderDataset:
    split = "train" if is_train else "val"
    train_classes = _checked_split(root, "train")
    classes = train_classes if is_train else _checked_split(root, "val")
    _same_classes(root, train_classes, classes)
    dataset = FolderDataset(os.path.join(root, split), transform, finish)
    warn_left_out(dataset)
    counts = Counter(dataset.targets)
    for idx, name in enumerate(dataset.classes):
        if counts[idx]:
            continue
        folder = os.path.join(root, split, name)
        # a class the model could never learn: almost always a failed copy or extraction
        if is_train:
            raise DataError(f"class folder {folder} has no image files ({' '.join(IMG_EXTENSIONS)}); add its "
                            f"images, or remove the folder (which renumbers the classes after it)")
        # still a class of the head: its index (and every later one) stays where training put it
        if _is_rank0():
            log.warning("warning: class folder %s has no image files; class %d (%s) is not evaluated",
                        folder, idx, name)
    return dataset


def warn_left_out(dataset: FolderDataset) -> None:
    """One warning (on the first rank) for each kind of file a folder data set does not read: images beside the class
    folders, files without an image extension, hidden names."""
    if not _is_rank0():
        return
    if dataset.loose_images:
        log.warning("warning: ignored %d image file(s) directly in %s, outside any class folder (an image's class is "
                    "the folder it is in: move them into one), e.g. %s", dataset.loose_images, dataset.root,
                    dataset.loose_example)
    if dataset.ignored_files:
        log.warning("warning: ignored %d file(s) in %s without an image extension (%s), e.g. %s",
                    dataset.ignored_files, dataset.root, " ".join(IMG_EXTENSIONS), dataset.ignored_example)
    if dataset.hidden_entries:
        log.warning("warning: skipped %d hidden file(s) and folder(s) in %s (names starting with '.' are neither "
                    "classes nor images), e.g. %s", dataset.hidden_entries, dataset.root, dataset.hidden_example)


def _is_rank0() -> bool:
    """Data-set warnings are the same on every rank: only the first says them (RANK is set by the launchers)."""
    return os.environ.get("RANK", "0") == "0"


# --data-set name -> (data_path, split, transform) -> dataset, for readers defined in modules that build on this one
# (shards.py registers `shards`; the package imports it, so the table is filled whenever vim_ds.data is imported)
READERS: dict = {}


@dataclass(frozen=True)
class DatasetConfig:
    """Which data a run reads; the fields are `vim-ds train`'s options of the same names (the engine fills every
    one from them: config/components.py)."""

    data_set: str  # IMNET, folder, shards, synthetic, or another reader's name (READERS)
    data_path: str | None
    nb_classes: int  # synthetic only
    synthetic_size: int  # synthetic only: training images (validation: a tenth)
    seed: int  # synthetic only: the images
    transform: TransformConfig  # synthetic images come at transform.input_size, untransformed


def build_dataset(config: DatasetConfig, is_train: bool):
    """(dataset, num_classes) for `config.data_set`:

    * `IMNET`, `folder`: `data_path/train/<class>/*` and `data_path/val/<class>/*` (class index = sorted folder name;
      the val split must have exactly the train split's classes).
    * `shards`: `data_path` written by `vim-ds data shard` (`shards.py`): the folder's samples, order and labels,
      read by offset from tar shards.
    * `synthetic`: `synthetic_size` training images and max(1, synthetic_size // 10) validation images of
      `nb_classes` classes at `transform.input_size`, generated on the fly (no augmentation: they are noise).
    """
    kind = config.data_set
    if kind == "synthetic":
        size = int(config.synthetic_size)
        if not is_train:
            size = max(1, size // 10)
        classes = int(config.nb_classes)
        dataset = SyntheticDataset(size, config.transform.input_size, classes, config.seed, is_train)
        return dataset, classes
    if kind in ("IMNET", "folder"):
        dataset = _folder_dataset(config.data_path, is_train, *build_handover_transform(config.transform, is_train))
        return dataset, len(dataset.classes)
    if kind in READERS:
        dataset = READERS[kind](config.data_path or "", "train" if is_train else "val",
                                *build_handover_transform(config.transform, is_train))
        return dataset, len(dataset.classes)
    raise DataError(f"unknown --data-set {kind!r}: choose IMNET or folder (ImageNet layout), shards (written by "
                    f"`vim-ds data shard`) or synthetic")
