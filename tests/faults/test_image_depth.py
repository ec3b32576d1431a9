"""16-bit and other high-bit-depth images are reduced to 8 bits by scaling, not clipped, on every path that decodes
an image: the folder data set (train and eval items), the shards (`vim-ds data shard` copies the files; the shard
reader decodes them) and `vim-ds predict`. Each 16-bit file is made from an 8-bit original (`v * 257`, the exact
8 -> 16 bit expansion) and must decode to exactly that original; the control shows what PIL's plain
`convert("RGB")` (the old decoding) gives instead: black and white.

Covered: 16-bit greyscale PNG (PIL mode I;16, the issue's case), 16-bit greyscale TIFF (I;16), 16-bit PGM (mode I),
32-bit float TIFF in 0..1 (mode F), and, which PIL's own conversion already gets right and must stay so, float TIFF
in 0..255 and 16-bit greyscale+alpha and RGB PNGs (PIL reduces those by the high byte). Images with no known range
(a 32-bit integer TIFF beyond 0..65535, a float one beyond 0..255) are skipped with a warning / reported by predict,
not clipped.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from data_options import dataset_config
from vim_ds.data import build_dataset
from vim_ds.data.images import open_rgb
from vim_ds.data.shards import write_shards

ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=4",
        "stride=4"]


def png16(path, values, color_type: int) -> None:
    """A 16-bit PNG of `values` (H, W) or (H, W, C) (PIL writes only greyscale at 16 bits): colour type 0 grey,
    2 RGB, 4 grey+alpha, 6 RGBA."""
    values = np.asarray(values, dtype=">u2")
    height, width = values.shape[:2]
    raw = b"".join(b"\x00" + row.tobytes() for row in values.reshape(height, -1))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
                + chunk(b"IEND", b""))


def pgm16(path, values) -> None:
    values = np.asarray(values, dtype=">u2")
    with open(path, "wb") as f:
        f.write(f"P5 {values.shape[1]} {values.shape[0]} 65535\n".encode() + values.tobytes())


# (name in the 16-bit folder, how it is written from the 8-bit values v, the 8-bit original's PIL mode, channels,
#  whether PIL's plain convert("RGB") already gets it right)
KINDS = [
    ("grey16.png", lambda p, v: Image.fromarray(v.astype(np.uint16) * 257).save(p), "L", 1, False),
    ("grey16.tif", lambda p, v: Image.fromarray(v.astype(np.uint16) * 257).save(p), "L", 1, False),
    ("grey16.pgm", lambda p, v: pgm16(p, v.astype(np.uint16) * 257), "L", 1, False),
    ("unit_float.tif", lambda p, v: Image.fromarray(v.astype(np.float32) / 255).save(p), "L", 1, False),
    ("float255.tif", lambda p, v: Image.fromarray(v.astype(np.float32)).save(p), "L", 1, True),
    ("grey_alpha16.png", lambda p, v: png16(p, v.astype(np.uint16) * 257, 4), "LA", 2, True),
    ("rgb16.png", lambda p, v: png16(p, v.astype(np.uint16) * 257, 2), "RGB", 3, True),
]


def originals(seed: int, channels: int) -> np.ndarray:
    """8-bit values covering the whole range, 0 and 255 included (the issue's row first)."""
    v = np.random.default_rng(seed).integers(0, 256, size=(12, 12, channels), dtype=np.uint8)
    v[0, :5, 0], v[1, :2, 0] = (0, 0, 80, 207, 143), (255, 1)
    if channels in (2, 4):
        v[..., -1] = np.maximum(v[..., -1], 1)  # no fully transparent pixel (grey+alpha becomes RGBA in PIL)
    return v[..., 0] if channels == 1 else v


def write_pair(eight_dir, sixteen_dir, stem: str, kind, seed: int) -> tuple[str, str]:
    """The 8-bit original (PNG) in `eight_dir` and its high-bit-depth copy in `sixteen_dir`, both named `stem`+ext."""
    name, write, mode, channels, _ = kind
    v = originals(seed, channels)
    eight, sixteen = os.path.join(eight_dir, f"{stem}.png"), os.path.join(sixteen_dir, stem + os.path.splitext(name)[1])
    Image.fromarray(v, mode if mode != "L" else None).save(eight)
    write(sixteen, v)
    return eight, sixteen


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_a_high_bit_depth_file_decodes_to_its_8_bit_original(kind, tmp_path):
    os.makedirs(tmp_path / "8")
    eight, sixteen = write_pair(tmp_path / "8", tmp_path, "x", kind, seed=1)
    with Image.open(eight) as image:
        expected = np.asarray(image.convert("RGB"))
    got = np.asarray(open_rgb(sixteen))
    assert got.dtype == np.uint8 and np.array_equal(got, expected)
    with Image.open(sixteen) as image:  # the control: PIL's plain conversion, the old decoding
        plain = np.asarray(image.convert("RGB"))
    if not kind[4]:
        assert not np.array_equal(plain, expected)
        assert set(np.unique(plain)) <= {0, 1, 255}  # clipped: black and white (float 0..1: 0 and 1)


def test_the_issues_row_reads_back(tmp_path):
    row = np.array([[0, 0, 80, 207, 143]], dtype=np.uint8)
    Image.fromarray(row.astype(np.uint16) * 257).save(tmp_path / "row.png")
    assert np.asarray(open_rgb(str(tmp_path / "row.png")))[0, :, 0].tolist() == [0, 0, 80, 207, 143]
    # not only exact multiples of 257: the high byte, as PIL reduces 16-bit RGB PNGs
    Image.fromarray(np.array([[65535, 32896, 32895, 255, 256]], dtype=np.uint16)).save(tmp_path / "any.png")
    assert np.asarray(open_rgb(str(tmp_path / "any.png")))[0, :, 0].tolist() == [255, 128, 128, 0, 1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An ImageNet-layout folder of 8-bit PNGs, the same images at high bit depth (one file of each kind per class and
    split), and its shards."""
    root = tmp_path_factory.mktemp("depth")
    eight, sixteen = root / "eight", root / "sixteen"
    seed = 0
    for split in ("train", "val"):
        for cls in ("a", "b"):
            for d in (eight, sixteen):
                os.makedirs(d / split / cls)
            for n, kind in enumerate(KINDS):
                seed += 1
                write_pair(eight / split / cls, sixteen / split / cls, f"{n:02d}", kind, seed)
    write_shards(str(sixteen), str(root / "shards"), 10**6)
    return str(eight), str(sixteen), str(root / "shards")


def data_config(kind, path):
    return dataset_config(data_set=kind, data_path=str(path), input_size=32)


@pytest.mark.parametrize("is_train", [True, False], ids=["train", "eval"])
def test_folder_and_shard_items_are_those_of_the_8_bit_originals(folders, is_train):
    eight, sixteen, shards = folders
    expected, _ = build_dataset(data_config("folder", eight), is_train)
    for kind, path in (("folder", sixteen), ("shards", shards)):
        dataset, _ = build_dataset(data_config(kind, path), is_train)
        assert len(dataset) == len(expected) == 2 * len(KINDS)
        for index in range(len(dataset)):
            key = (index, 77 + index)  # the same sample seed: the same augmentation
            a, b = expected[key], dataset[key]
            assert b[2] == 1 and torch.equal(a[0], b[0]) and a[1] == b[1], (kind, dataset.describe(index))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    import timm

    import vim_ds  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)
    path = tmp_path_factory.mktemp("classifier") / "classifier.pth"
    torch.save({"model": model.state_dict()}, path)
    return str(path)


def test_predict_reads_a_16_bit_image_as_its_8_bit_original(classifier, folders, tmp_path):
    from vim_ds.predict import parse_args, predict

    eight, sixteen, _ = folders
    pairs = [(os.path.join(eight, "val", "a", f"{n:02d}.png"),
              os.path.join(sixteen, "val", "a", f"{n:02d}{os.path.splitext(kind[0])[1]}")) for n, kind in
             enumerate(KINDS)]
    clipped = tmp_path / "clipped.png"  # what the old decoding fed the model for the 16-bit greyscale PNG
    with Image.open(pairs[0][1]) as image:
        image.convert("RGB").save(clipped)
    images = [p for pair in pairs for p in pair] + [str(clipped)]
    results = dict(predict(parse_args([*images, "--weights", classifier, "--topk", "10", *ARCH])))
    for a, b in pairs:
        assert not isinstance(results[b], str) and results[a] == results[b], b
    assert results[str(clipped)] != results[pairs[0][0]]


def test_images_with_no_known_range_are_skipped_or_reported_not_clipped(classifier, tmp_path, caplog, capsys):
    from vim_ds.predict import main

    int32, huge_float = tmp_path / "int32.tif", tmp_path / "huge.tif"
    Image.fromarray(np.array([[0, 70000, 5]], dtype=np.int32)).save(int32)
    Image.fromarray(np.array([[0.0, 0.5, 300.0]], dtype=np.float32)).save(huge_float)
    assert main([str(int32), str(huge_float), "--weights", classifier, *ARCH]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vim-ds predict: error: cannot read image {int32} (ValueError: a 32-bit integer image with values from 0 to "
        f"70000: no known range to reduce to 8 bits (16-bit images hold 0..65535); save it as 8 or 16 bits)",
        f"vim-ds predict: error: cannot read image {huge_float} (ValueError: a floating-point image with values from 0 "
        f"to 300: no known range to reduce to 8 bits (0..1 or 0..255); save it as 8 or 16 bits)"]
    # in a data set: skipped as an image that does not decode, with the same reason
    from vim_ds.data.datasets import FolderDataset

    root = tmp_path / "data"
    os.makedirs(root / "c")
    os.replace(int32, root / "c" / "0.tif")
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "c" / "1.png")
    dataset = FolderDataset(str(root), transform=lambda image: image)
    with caplog.at_level(logging.WARNING, logger="vim_ds.data.datasets"):
        image, target, ok = dataset[0]
    assert ok == 0 and image.mode == "RGB"
    assert f"cannot decode {root / 'c' / '0.tif'} (ValueError: a 32-bit integer image with values from 0 to 70000" \
        in caplog.text
