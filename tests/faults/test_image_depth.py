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
    from vim_ds.cli.predict import parse_args, predict

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
    from vim_ds.cli.predict import main

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


# -- every mode the decoder reads, from a real file of that mode (issue 50) -------------------------------------------
#
# One file per mode (and per byte order and depth a file stores it in), written with Pillow or, where Pillow writes
# no such file, by hand (`tiff`); each must decode to the 8-bit RGB values computed here from the stored samples with
# the colour science's own formulas, not with PIL. Modes that no file opens as in Pillow (RGBX, RGBa, HSV, I;16L,
# I;16N: PIL makes them only in memory) are checked on an image made in memory. Each case also names what a plausible
# wrong decoding gives (the channels taken as they are, the low byte, a negative, PIL's plain conversion where it is
# wrong), which must differ from the expected values: the comparison can tell them apart.


def tiff(path, values, photometric: int, *, big_endian=False, sample_format=1, extra=(), palette=None,
         subsampling=None) -> str:
    """A baseline TIFF by hand: `values` (H, W) or (H, W, C), its dtype giving the bits per sample, as one
    uncompressed strip in either byte order, with these tags (PhotometricInterpretation, SampleFormat, ExtraSamples,
    ColorMap (N x 3, 16-bit), YCbCrSubSampling)."""
    values = np.asarray(values)
    values = values[..., None] if values.ndim == 2 else values
    height, width, channels = values.shape
    order = ">" if big_endian else "<"
    data = values.astype(values.dtype.newbyteorder(order)).tobytes()
    tags = {256: [width], 257: [height], 258: [values.dtype.itemsize * 8] * channels, 259: [1], 262: [photometric],
            273: [0], 277: [channels], 278: [height], 279: [len(data)], 284: [1], 339: [sample_format] * channels}
    if extra:
        tags[338] = list(extra)
    if palette is not None:
        tags[320] = np.asarray(palette, np.uint16).T.reshape(-1).tolist()
    if subsampling:
        tags[530] = list(subsampling)
    # header, IFD (12 bytes a tag, SHORT values but the strip's LONG offset and size), values longer than 4 bytes
    types = {273: ("I", 4), 279: ("I", 4)}
    outside = sum(len(v) * types.get(t, ("H", 2))[1] for t, v in tags.items()
                  if len(v) * types.get(t, ("H", 2))[1] > 4)
    at = 8 + 2 + 12 * len(tags) + 4
    tags[273] = [at + outside]
    head, ifd, blob = (b"MM\x00\x2a" if big_endian else b"II\x2a\x00") + struct.pack(order + "I", 8), b"", b""
    for tag in sorted(tags):
        code, size = types.get(tag, ("H", 2))
        packed = struct.pack(order + code * len(tags[tag]), *tags[tag])
        pointer = packed.ljust(4, b"\0") if len(packed) <= 4 else struct.pack(order + "I", at + len(blob))
        blob += b"" if len(packed) <= 4 else packed
        ifd += struct.pack(order + "HHI", tag, 4 if code == "I" else 3, len(tags[tag])) + pointer
    with open(path, "wb") as f:
        f.write(head + struct.pack(order + "H", len(tags)) + ifd + b"\0\0\0\0" + blob + data)
    return str(path)


def grey(v) -> np.ndarray:
    return np.repeat(np.asarray(v, np.float64)[..., None], 3, axis=-1)


def cmyk_to_rgb(cmyk) -> np.ndarray:
    """Subtractive inks: each of C, M, Y, and K over all, removes its fraction of the light."""
    c = np.asarray(cmyk, np.float64)
    return (255 - c[..., :3]) * (255 - c[..., 3:]) / 255


def ycbcr_to_rgb(ycc) -> np.ndarray:
    """JFIF (ITU-R BT.601, full range): R = Y + 1.402 Cr', G = Y - 0.344136 Cb' - 0.714136 Cr', B = Y + 1.772 Cb'."""
    y, cb, cr = (np.asarray(ycc, np.float64)[..., i] for i in range(3))
    return np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128),
                     y + 1.772 * (cb - 128)], -1)


def lab_to_srgb(lab) -> np.ndarray:
    """CIE L*a*b* (L* stored as L * 100 / 255, a* and b* signed; D50 white, as TIFF and ICC take it) to XYZ, adapted
    to D65 by the Bradford transform, to linear sRGB (IEC 61966-2-1's matrix), clipped, and encoded by its curve."""
    lab = np.asarray(lab)
    lightness = lab[..., 0].astype(np.float64) * 100 / 255
    a, b = (lab[..., i].view(np.int8).astype(np.float64) for i in (1, 2))
    fy = (lightness + 16) / 116
    f = np.stack([fy + a / 500, fy, fy - b / 200])
    delta = 6 / 29
    xyz = np.where(f > delta, f ** 3, 3 * delta ** 2 * (f - 4 / 29))
    d50, d65 = np.array([0.96422, 1.0, 0.82521]), np.array([0.95047, 1.0, 1.08883])
    bradford = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])
    adapt = np.linalg.inv(bradford) @ np.diag((bradford @ d65) / (bradford @ d50)) @ bradford
    to_rgb = np.array([[3.2406, -1.5372, -0.4986], [-0.9689, 1.8758, 0.0415], [0.0557, -0.2040, 1.0570]])
    linear = np.clip(np.einsum("ij,jk,k...->...i", to_rgb, adapt, xyz * d50[:, None, None]), 0, 1)
    return 255 * np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)


def hsv_to_rgb(hsv) -> np.ndarray:
    import colorsys

    return np.array([[colorsys.hsv_to_rgb(*(p / 255)) for p in row] for row in np.asarray(hsv, np.float64)]) * 255


def unpremultiplied(colour, alpha) -> np.ndarray:
    """A colour stored multiplied by its alpha (TIFF's associated alpha), divided by it again."""
    return np.asarray(colour, np.float64) * 255 / np.asarray(alpha, np.float64)[..., None]


PALETTE = np.random.default_rng(7).integers(0, 256, (256, 3), dtype=np.uint8)


def palette_png(path, index, transparency=None) -> str:
    image = Image.fromarray(index.astype(np.uint8), "P")
    image.putpalette(PALETTE.reshape(-1).tolist())
    if transparency is not None:
        image.info["transparency"] = transparency
    image.save(path)
    return str(path)


def mode_cases(rng, folder):
    """(case id, PIL mode on opening, file path or in-memory image, expected RGB (float), tolerance, a wrong reading)
    per mode and storage."""
    def u8(*shape):
        return rng.integers(0, 256, (4, 4, *shape), dtype=np.uint8)

    def at(name):
        return str(folder / name)

    def f(values):
        return np.asarray(values, np.float64)

    v, rgb, rgba, cmyk, alpha = u8(), u8(3), u8(4), u8(4), np.maximum(u8(), 1)
    bits = rng.integers(0, 2, (4, 4)).astype(bool)
    Image.fromarray(bits).save(at("1.png"))
    yield "1 (PNG)", "1", at("1.png"), grey(bits * 255.0), 0, grey(bits * 1.0)
    Image.fromarray(v).save(at("L.png"))
    yield "L (PNG)", "L", at("L.png"), grey(v), 0, grey(255 - v)
    yield "L WhiteIsZero (TIFF)", "L", tiff(at("L_wiz.tif"), v, 0), grey(255 - v), 0, grey(v)
    Image.fromarray(np.stack([v, alpha], -1), "LA").save(at("LA.png"))
    yield "LA (PNG)", "LA", at("LA.png"), grey(v), 0, grey(alpha)
    stored = (v.astype(np.uint32) * alpha // 255).astype(np.uint8)  # grey with associated (premultiplied) alpha
    yield ("La (TIFF, premultiplied)", "La", tiff(at("La.tif"), np.stack([stored, alpha], -1), 1, extra=(1,)),
           grey(unpremultiplied(stored[..., None], alpha)[..., 0]), 1, grey(stored))
    index = rng.integers(0, 256, (4, 4))
    yield "P (PNG)", "P", palette_png(at("P.png"), index), f(PALETTE[index]), 0, grey(index)
    yield ("P with a transparency table (PNG)", "P", palette_png(at("Pt.png"), index, bytes(range(0, 256, 16))),
           f(PALETTE[index]), 0, grey(index))
    pa = tiff(at("PA.tif"), np.stack([index, alpha], -1).astype(np.uint8), 3, palette=PALETTE.astype(np.uint16) * 257,
              extra=(2,))
    yield "PA (TIFF)", "PA", pa, f(PALETTE[index]), 0, grey(index)
    Image.fromarray(rgb).save(at("RGB.png"))
    yield "RGB (PNG)", "RGB", at("RGB.png"), f(rgb), 0, f(rgb[..., ::-1])
    for big in (True, False):  # 16 bits a sample, both byte orders: the high byte, as for every 16-bit sample
        wide = rgb.astype(np.uint16) * 256 + rng.integers(0, 256, rgb.shape).astype(np.uint16)
        path = tiff(at(f"RGB16{big}.tif"), wide, 2, big_endian=big)
        yield f"RGB 16-bit {'big' if big else 'little'}-endian (TIFF)", "RGB", path, f(rgb), 0, f(wide & 255)
    Image.fromarray(rgba).save(at("RGBA.png"))
    yield "RGBA (PNG)", "RGBA", at("RGBA.png"), f(rgba[..., :3]), 0, f(rgba[..., 1:])
    colour = (rgb.astype(np.uint32) * alpha[..., None] // 255).astype(np.uint8)
    stored = np.concatenate([colour, alpha[..., None]], -1)
    yield ("RGBA from premultiplied (TIFF)", "RGBA", tiff(at("RGBa.tif"), stored, 2, extra=(1,)),
           unpremultiplied(colour, alpha), 1, f(colour))
    yield "RGBa (in memory)", "RGBa", Image.fromarray(stored, "RGBa"), unpremultiplied(colour, alpha), 1, f(colour)
    yield "RGBX (in memory)", "RGBX", Image.fromarray(rgba, "RGBX"), f(rgba[..., :3]), 0, f(rgba[..., 1:])
    yield "CMYK (TIFF)", "CMYK", tiff(at("CMYK.tif"), cmyk, 5), cmyk_to_rgb(cmyk), 0, f(cmyk[..., :3])
    flat = np.repeat(np.repeat(cmyk[:2, :2], 8, 0), 8, 1)  # flat 8 x 8 blocks: JPEG keeps them to a level or two
    Image.fromarray(flat, "CMYK").save(at("CMYK.jpg"), quality=100)  # inverted, with an Adobe marker, as Photoshop
    yield "CMYK (JPEG, Adobe)", "CMYK", at("CMYK.jpg"), cmyk_to_rgb(flat), 2, 255 - cmyk_to_rgb(flat)
    ycc = u8(3)
    yield ("YCbCr (TIFF)", "YCbCr", tiff(at("YCbCr.tif"), ycc, 6, subsampling=(1, 1)),
           np.clip(ycbcr_to_rgb(ycc), 0, 255), 1, f(ycc))
    lab = u8(3)
    lab[0, :4] = [[0, 0, 0], [128, 0, 0], [255, 0, 0], [135, 246, 209]]  # black, grey, white, a blue PIL got wrong
    path = tiff(at("LAB.tif"), lab, 8)  # a* and b* as signed bytes
    with Image.open(path) as image:
        plain = f(image.convert("RGB"))  # PIL's 8-bit LittleCMS tables: off by up to 14 levels
    yield "LAB (TIFF)", "LAB", path, lab_to_srgb(lab), 1, plain
    hsv = u8(3)
    yield "HSV (in memory)", "HSV", Image.fromarray(hsv, "HSV"), hsv_to_rgb(hsv), 0, f(hsv)
    wide = v.astype(np.uint16) * 256 + rng.integers(0, 256, v.shape).astype(np.uint16)  # its high byte: v
    clipped = grey(np.minimum(wide, 255))  # PIL's plain conversion
    Image.fromarray(wide).save(at("I16.png"))  # PNG stores big-endian; PIL gives I;16
    yield "I;16 (PNG)", "I;16", at("I16.png"), grey(v), 0, clipped
    yield "I;16 (TIFF, little-endian)", "I;16", tiff(at("I16le.tif"), wide, 1), grey(v), 0, clipped
    yield ("I;16B (TIFF, big-endian)", "I;16B", tiff(at("I16be.tif"), wide, 1, big_endian=True), grey(v), 0,
           grey(wide.byteswap() >> 8))
    yield "I;16 WhiteIsZero (TIFF)", "I;16", tiff(at("I16_wiz.tif"), 65535 - wide, 0), grey(v), 0, grey(255 - v)
    for mode, dtype in (("I;16L", "<u2"), ("I;16N", "=u2")):
        yield f"{mode} (in memory)", mode, Image.frombytes(mode, (4, 4), wide.astype(dtype).tobytes()), grey(v), 0, \
            clipped
    with open(at("I.pgm"), "wb") as file:  # 16-bit PGM: PIL's mode I
        file.write(b"P5 4 4 65535\n" + wide.astype(">u2").tobytes())
    yield "I (PGM, 16-bit)", "I", at("I.pgm"), grey(v), 0, clipped
    yield ("I (TIFF, 32-bit signed, big-endian)", "I",
           tiff(at("I32be.tif"), wide.astype(np.int32), 1, big_endian=True, sample_format=2), grey(v), 0, clipped)
    unit = (v + rng.uniform(-0.4, 0.4, v.shape)).clip(0, 255).astype(np.float32) / 255  # rounds to v
    for big in (True, False):
        path = tiff(at(f"F{big}.tif"), unit, 1, big_endian=big, sample_format=3)
        yield f"F (TIFF, {'big' if big else 'little'}-endian)", "F", path, grey(v), 0, grey(unit)
    yield ("F WhiteIsZero (TIFF)", "F", tiff(at("F_wiz.tif"), 1 - unit, 0, sample_format=3), grey(v), 0,
           grey(255 - v))


@pytest.fixture(scope="module")
def mode_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modes")
    cases = {case[0]: case[1:] for case in mode_cases(np.random.default_rng(50), folder)}
    assert sorted(cases) == sorted(CASE_IDS)
    return cases


CASE_IDS = ["1 (PNG)", "L (PNG)", "L WhiteIsZero (TIFF)", "LA (PNG)", "La (TIFF, premultiplied)", "P (PNG)",
            "P with a transparency table (PNG)", "PA (TIFF)", "RGB (PNG)", "RGB 16-bit big-endian (TIFF)",
            "RGB 16-bit little-endian (TIFF)", "RGBA (PNG)", "RGBA from premultiplied (TIFF)", "RGBa (in memory)",
            "RGBX (in memory)", "CMYK (TIFF)", "CMYK (JPEG, Adobe)", "YCbCr (TIFF)", "LAB (TIFF)", "HSV (in memory)",
            "I;16 (PNG)", "I;16 (TIFF, little-endian)", "I;16B (TIFF, big-endian)", "I;16 WhiteIsZero (TIFF)",
            "I;16L (in memory)", "I;16N (in memory)", "I (PGM, 16-bit)", "I (TIFF, 32-bit signed, big-endian)",
            "F (TIFF, big-endian)", "F (TIFF, little-endian)", "F WhiteIsZero (TIFF)"]


@pytest.mark.parametrize("case", CASE_IDS)
def test_every_mode_decodes_to_the_rgb_its_colour_space_defines(mode_files, case, recwarn):
    from vim_ds.data.images import to_rgb

    mode, source, expected, tolerance, wrong = mode_files[case]
    if isinstance(source, str):
        with Image.open(source) as image:
            assert image.mode == mode  # the file holds what the case is about
        got = np.asarray(open_rgb(source))
    else:
        assert source.mode == mode
        got = np.asarray(to_rgb(source))
    expected = np.rint(expected)
    assert got.dtype == np.uint8 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= tolerance, (case, got[0, :2].tolist(), expected[0, :2].tolist())
    # the control: a plausible wrong decoding is more than the tolerance away, so the comparison above can fail
    assert np.abs(np.rint(wrong) - expected).max() > tolerance
    assert not [w for w in recwarn if "Transparency" in str(w.message)]  # PIL's warning for every such image


def test_the_cases_cover_every_mode_pil_has():
    """Every mode Pillow has is a case (a mode a later Pillow adds, or a case dropped, shows here)."""
    assert {case.split(" ")[0] for case in CASE_IDS} == set(Image.MODES), set(Image.MODES)
