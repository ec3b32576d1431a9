"""Sharded data sets: an ImageNet-layout folder written as WebDataset tar shards plus an index of member offsets.

`vim-ds data shard --data-path DIR --out SHARDS [--shard-size 1GB]` writes

    SHARDS/train-000000.tar ...      WebDataset shards: members KEY.<jpg|png|...> (the file's bytes, unchanged) and
    SHARDS/val-000000.tar ...        KEY.cls (the label, ASCII decimal), KEY = the sample's index (8+ digits)
    SHARDS/train.index.jsonl         the index of a split: line 1 a header (classes, shards and their byte sizes),
    SHARDS/val.index.jsonl           line 2 one column per field: shard, offset, size, label, path of each sample
    SHARDS/_info.json                timm's split info (num_samples, filenames, shard_lengths) for its `wds` reader

Samples are written in the order, and with the labels, of the folder data set (`FolderDataset`), so sample i of
the shards is image i of the folder: `vim-ds train --data-set shards --data-path SHARDS` draws the same sample
indices, seeds and images as `--data-set folder` on DIR, and resumes mid-epoch the same way. A sample is read
with one positioned read (`os.pread`) of `size` bytes at `offset` in its shard: no tar parsing per sample, and
shards are large files read whole by tools that stream them (webdataset, timm, tar).

Files are copied, not decoded, when writing: a file that does not decode in the folder does not decode in the
shards, and is skipped in the same way (`SeededDataset`). A file that cannot be read at all (gone, no permission)
is written as an empty member and is skipped when training, as the folder data set skips it.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile

import numpy as np
from PIL import UnidentifiedImageError

from .datasets import (READERS, BadImage, DataError, FolderDataset, SeededDataset, _folder_dataset,
                       class_folders, warn_left_out)
from .images import open_rgb

log = logging.getLogger(__name__)

FORMAT, VERSION = "vim-ds shards", 1
SPLITS = ("train", "val")
INFO = "_info.json"
# timm's wds reader: jpg;png;webp
IMAGE_EXTS = {"jpeg": "jpg", "jpg": "jpg", "png": "png", "webp": "webp"}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30,
          "ti": 2**40}


def parse_size(text: str) -> int:
    """'1GB' = 10**9 bytes, '512MiB' = 512 * 2**20, '4096' = 4096 bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 1GB, 500MB, 2GiB, 1048576)")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size < 1:
        raise ValueError(f"a shard size must be at least one byte, got {text!r}")
    return size


def index_path(root: str, split: str) -> str:
    return os.path.join(root, f"{split}.index.jsonl")


def member_ext(path: str) -> str:
    """The member's extension: WebDataset's image keys (jpg, png, webp) where the file is one, else its own."""
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "bin"
    return IMAGE_EXTS.get(ext, ext)


def member_key(index: int) -> str:
    """Sample keys hold no dot (WebDataset splits a member name at the first dot of its base name)."""
    return f"{index:08d}"


# -- writing ---------------------------------------------------------------------------------------------------------

def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    # no time stamps: the same folder gives the same bytes
    info.size, info.mode, info.mtime = size, 0o444, 0
    return info


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class _SplitWriter:
    """Writes one split's samples into `{split}-NNNNNN.tar` files of at most `shard_size` bytes each (a single
    sample larger than that gets a shard of its own), recording where each image's bytes land."""

    def __init__(self, out: str, split: str, shard_size: int):
        self.out, self.split, self.shard_size = out, split, shard_size
        self.shards, self.tar, self.in_shard = [], None, 0
        self.columns = {"shard": [], "offset": [], "size": [], "label": [], "path": []}

    def _roll(self) -> None:
        self._close()
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self.shards.append({"file": name, "bytes": 0, "samples": 0})
        self.tar = tarfile.open(os.path.join(self.out, name + ".partial"), "w", format=tarfile.USTAR_FORMAT)

    def _close(self) -> None:
        if self.tar is None:
            return
        self.tar.close()
        shard = self.shards[-1]
        final = os.path.join(self.out, shard["file"])
        os.replace(final + ".partial", final)
        shard["bytes"], self.tar = os.path.getsize(final), None

    def add(self, index: int, data: bytes, label: int, relpath: str) -> None:
        cls = str(label).encode()
        needed = 3 * tarfile.BLOCKSIZE + _padded(len(data)) + _padded(len(cls))
        if self.tar is None or (self.shards[-1]["samples"] and self.tar.offset + needed > self.shard_size):
            self._roll()
        key = member_key(index)
        self.tar.addfile(_tarinfo(f"{key}.{member_ext(relpath)}", len(data)), io.BytesIO(data))
        # the data follows its header, padded to whole blocks
        offset = self.tar.offset - _padded(len(data))
        self.tar.addfile(_tarinfo(f"{key}.cls", len(cls)), io.BytesIO(cls))
        self.shards[-1]["samples"] += 1
        for column, value in zip(self.columns.values(), (len(self.shards) - 1, offset, len(data), label, relpath)):
            column.append(value)

    def finish(self, classes: list, source: str) -> dict:
        self._close()
        header = {"format": FORMAT, "version": VERSION, "split": self.split, "source": source, "classes": classes,
                  "num_samples": len(self.columns["label"]), "shards": self.shards,
                  "fields": list(self.columns), "key": "sample index, 8 or more digits"}
        path = index_path(self.out, self.split)
        with open(path + ".partial", "w") as f:  # written last: an interrupted run leaves no index
            f.write(json.dumps(header) + "\n")
            f.write(json.dumps(self.columns, separators=(",", ":")) + "\n")
        os.replace(path + ".partial", path)
        return header


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        log.warning("warning: cannot read %s (%s); written as an empty member, skipped when training", path,
                    exc.strerror or exc)
        return b""


def write_split(dataset: FolderDataset, out: str, split: str, shard_size: int, relative_to: str) -> dict:
    """One split's shards and index; `path` in the index is relative to `relative_to` (the --data-path)."""
    writer = _SplitWriter(out, split, shard_size)
    for index, (path, label) in enumerate(dataset.samples):
        writer.add(index, _read_bytes(path), label, os.path.relpath(path, relative_to))
    return writer.finish(list(dataset.classes), os.path.abspath(relative_to))


def source_splits(data_path: str, split: str | None = None) -> dict:
    """split name -> FolderDataset (no transform) of what `data_path` holds: its train/ and val/ (the ImageNet
    layout, checked as the trainer checks it), or, for a folder of class folders, that folder as split `split`."""
    if not data_path or not os.path.isdir(data_path):
        raise DataError(f"data path {data_path} is not a folder (expected train/<class>/* and val/<class>/*, or "
                        f"<class>/*)")
    layout = all(os.path.isdir(os.path.join(data_path, s)) for s in SPLITS)
    if layout and split in (None, *SPLITS):
        return {s: _folder_dataset(data_path, s == "train", None) for s in ([split] if split else SPLITS)}
    if not class_folders(data_path):
        raise DataError(f"{data_path} has no class folders (expected train/<class>/* and val/<class>/*, or "
                        f"<class>/*)")
    dataset = FolderDataset(data_path, None)
    warn_left_out(dataset)
    return {split or "train": dataset}


def _write_info(out: str, headers: dict, name: str) -> None:
    path = os.path.join(out, INFO)
    info = {"name": name, "splits": {}}
    if os.path.isfile(path):
        with open(path) as f:
            info = json.load(f)
    for split, header in headers.items():
        info["splits"][split] = {"name": split, "num_samples": header["num_samples"],
                                 "filenames": [s["file"] for s in header["shards"]],
                                 "shard_lengths": [s["samples"] for s in header["shards"]]}
    with open(path + ".partial", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".partial", path)


def _clear(out: str, splits, force: bool) -> str | None:
    """Why `out` cannot take these splits (a file; earlier shards of the same split without --force), or None."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"{out} exists and is not a folder"
    os.makedirs(out, exist_ok=True)
    for split in splits:
        pattern = re.compile(rf"{re.escape(split)}(-\d+\.tar|\.index\.jsonl)(\.partial)?")
        found = sorted(name for name in os.listdir(out) if pattern.fullmatch(name))
        if found and not force:
            return f"{out} already holds split {split!r} ({found[0]}); pass --force to replace it"
        for name in found:
            os.remove(os.path.join(out, name))
    return None


def write_shards(data_path: str, out: str, shard_size: int = 10**9, split: str | None = None,
                 force: bool = False) -> dict:
    """Write the splits of `data_path` (see `source_splits`) into `out`; return split -> index header."""
    sources = source_splits(data_path, split)
    problem = _clear(out, sources, force)
    if problem:
        raise DataError(problem)
    headers = {}
    for name, dataset in sources.items():
        headers[name] = write_split(dataset, out, name, shard_size, data_path)
    _write_info(out, headers, os.path.basename(os.path.abspath(data_path)))
    return headers


# -- reading ---------------------------------------------------------------------------------------------------------

def read_header(root: str, split: str) -> dict:
    """The index header of `split` (its first line), checked against the shard files on disk: each is present and
    has the size the index recorded (a shorter one is truncated; another size was rewritten since)."""
    path = index_path(root, split)
    if not os.path.isdir(root):
        raise DataError(f"shards folder {root} does not exist (write one with `vim-ds data shard --data-path DIR "
                        f"--out {root}`)")
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing: {root} holds no {split} split written by `vim-ds data shard`")
    try:
        with open(path) as f:
            header = json.loads(f.readline())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a shard index (line 1 is not JSON: {exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: not a shard index written by `vim-ds data shard`")
    if header.get("version") != VERSION:
        raise DataError(f"{path}: index version {header.get('version')} is not {VERSION}; write the shards again")
    for shard in header["shards"]:
        file = os.path.join(root, shard["file"])
        if not os.path.isfile(file):
            raise DataError(f"{file} is missing (listed in {path})")
        size = os.path.getsize(file)
        if size < shard["bytes"]:
            raise DataError(f"{file} is truncated: {size} bytes, the index says {shard['bytes']}; copy it again "
                            f"or write the shards again")
        if size != shard["bytes"]:
            raise DataError(f"{file} has {size} bytes, the index says {shard['bytes']}: it was changed after the "
                            f"index was written; write the shards again")
    return header


def read_index(root: str, split: str):
    """(header, columns) of a split's index, checked: the header against the shard files (`read_header`), and every
    sample's bytes inside its shard and its label among the classes. Columns: numpy arrays shard, offset, size,
    label, and the list path."""
    header = read_header(root, split)
    path = index_path(root, split)
    with open(path) as f:
        f.readline()
        try:
            raw = json.loads(f.readline())
            cols = {name: np.asarray(raw[name], dtype=np.int64) for name in ("shard", "offset", "size", "label")}
            cols["path"] = list(raw["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: the sample columns (line 2) are unreadable ({exc}); write the shards "
                            f"again") from None
    shard, offset, size, label, paths = (cols[name] for name in ("shard", "offset", "size", "label", "path"))
    n = header["num_samples"]
    if not n == len(shard) == len(offset) == len(size) == len(label) == len(paths):
        raise DataError(f"{path}: {n} samples in the header but columns of other lengths; write the shards again")
    if n and (shard.min() < 0 or shard.max() >= len(header["shards"])):
        raise DataError(f"{path} names a shard it does not list; write the shards again")
    ends = np.asarray([s["bytes"] for s in header["shards"]], dtype=np.int64)
    past = np.flatnonzero((offset < tarfile.BLOCKSIZE) | (size < 0) | (offset + size > ends[shard])) if n else []
    if len(past):
        i = int(past[0])
        raise DataError(f"{path}: sample {i} ({paths[i]}) points at bytes {offset[i]}..{offset[i] + size[i]} of "
                        f"{header['shards'][shard[i]]['file']}, which has {ends[shard[i]]}: the index does not "
                        f"belong to these shards; write the shards again")
    if n and (label.min() < 0 or label.max() >= len(header["classes"])):
        raise DataError(f"{path}: a label outside the {len(header['classes'])} classes; write the shards again")
    return header, cols


def check_shards(root: str, need_train: bool = True) -> None:
    """What the preflight checks: each split's index and shards (`read_index`), the same classes in both."""
    val, _ = read_index(root, "val")
    if need_train:
        train, _ = read_index(root, "train")
        if train["classes"] != val["classes"]:
            raise DataError(f"the classes of {index_path(root, 'train')} and {index_path(root, 'val')} differ")


class ShardDataset(SeededDataset):
    """One split of a shards folder: sample i is `size` bytes at `offset` in its shard, decoded as the folder data
    set decodes a file (`images.open_rgb`: 8-bit RGB, high-bit-depth images scaled), then transformed; with a
    `finish`, handed over as uint8 and finished in the consuming process, as the folder's samples are
    (datasets.SeededDataset)."""

    def __init__(self, root: str, split: str, transform, finish=None):
        header, cols = read_index(root, split)
        self.root, self.split, self.transform, self.finish = root, split, transform, finish
        self.classes = list(header["classes"])
        self.class_to_idx = {name: idx for idx, name in enumerate(self.classes)}
        self.files = [os.path.join(root, s["file"]) for s in header["shards"]]
        self.shard, self.offset, self.size, self.label = cols["shard"], cols["offset"], cols["size"], cols["label"]
        self.paths = cols["path"]
        self.targets = self.label.tolist()
        self._fds = {}

    def __len__(self) -> int:
        return len(self.label)

    def __getstate__(self):  # open files stay in the process that opened them
        return {**self.__dict__, "_fds": {}}

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def member(self, index: int) -> str:
        return f"{member_key(index)}.{member_ext(self.paths[index])}"

    def describe(self, index: int) -> str:
        return f"{self.files[self.shard[index]]}:{self.member(index)} ({self.paths[index]})"

    def read(self, index: int) -> bytes:
        """The image's bytes: one positioned read in its shard (opened once per process)."""
        shard = int(self.shard[index])
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        return os.pread(fd, int(self.size[index]), int(self.offset[index]))

    def load(self, index: int):
        where = self.describe(index)
        try:
            data = self.read(index)
        except OSError as exc:
            raise BadImage(where, f"cannot read the shard: {exc.strerror or exc}") from exc
        if len(data) < self.size[index]:
            raise BadImage(where, "the shard ends before the member does (truncated since the start)")
        if not data:
            raise BadImage(where, "empty file")
        try:
            image = open_rgb(io.BytesIO(data))
        # PIL raises OSError, SyntaxError, ValueError, EOFError ... for broken files
        except Exception as exc:
            if isinstance(exc, UnidentifiedImageError):
                reason = "not an image PIL can identify"
            else:
                text = str(exc).strip().splitlines()
                reason = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
            raise BadImage(where, reason) from exc
        return self.transform(image), int(self.label[index])


READERS["shards"] = ShardDataset
