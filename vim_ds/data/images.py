"""Decoding an image file to the 8-bit RGB picture every path of vim_ds feeds the model: the one function that the
folder and shard data sets (train, eval) and `vim-ds predict` use.

PIL's `convert("RGB")` (what torchvision's default loader calls) is right for most 8-bit modes (1, L, LA, P, PA,
RGBA, CMYK, YCbCr, HSV; LAB and La aside, below) and for 16-bit colour PNGs and TIFFs, which PIL itself decodes to 8
bits by keeping the high byte of each sample. For its high-bit-depth single-channel modes it is not: it clips each
value to 0..255, so a 16-bit greyscale PNG (mode I;16) becomes black and white (a row `0 0 80 207 143` saved at 16
bits, `v * 257`, reads back as `0 0 255 255 255`). Those are reduced here by scaling instead:

* I;16, I;16B, I;16L, I;16N (16-bit greyscale PNG, TIFF) and I (PIL's 32-bit container, in which its decoders put
  16-bit data: PGM with a maxval above 255, normalised to 0..65535; older Pillows' 16-bit PNGs): `value >> 8`, the
  high byte, as PIL's own 16-bit RGB/RGBA/LA decoding, libpng's `png_set_strip_16` and torchvision's
  `to_dtype(uint16 -> uint8, scale=True)` do. A 16-bit file made from an 8-bit one (`v * 257`, the exact 8 -> 16
  bit expansion) reads back as the 8-bit original. An I image with values outside 0..65535 (a 32-bit integer
  TIFF) has no known range: it is refused, not clipped.
* F (32-bit float TIFF): values in 0..1 (torchvision's float convention, as when every value is at most 1) are
  scaled by 255, values in 0..255 (PIL's own F -> L convention) are rounded; anything else (negative, above 255,
  NaN) has no known range and is refused.

A refused image raises `ValueError` with the reason: the data sets skip it as an image that does not decode (with
`warning: cannot decode PATH (reason); skipped`), `vim-ds predict` reports it as an image it cannot read.

Where PIL's conversion is wrong or fails for a mode a file can hold, it is done here too:

* LAB (a CIELab TIFF, as Photoshop writes one: L* scaled to 0..255, a* and b* signed bytes, D50 white): PIL's
  conversion runs LittleCMS's 8-bit pipeline, whose tables are off by up to 14 levels near the edge of sRGB; the
  same transform without that optimisation (`_lab_to_srgb`) is within one level of the CIE formulas.
* La (grey with premultiplied alpha: a TIFF with ExtraSamples 1): PIL converts it to LA, not to RGB (`conversion
  from La to L not supported`): it goes through LA.
* 16-bit and float greyscale TIFFs stored WhiteIsZero (PhotometricInterpretation 0): PIL inverts 1- and 8-bit
  ones but hands the higher depths over as they are stored, a negative: they are inverted after the reduction.
* P with a transparency table of several entries: PIL's RGB conversion warns that it "should be converted to RGBA"
  for every such image; it goes through RGBA, to the same colours, without the warning.

Alpha is dropped, as torchvision's loader and timm drop it: an RGBA, LA or PA pixel gives its colour as stored (a
premultiplied one, RGBa or La, its colour divided by its alpha), whatever its transparency.
"""
from __future__ import annotations

import functools

import numpy as np
from PIL import Image

_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
_WHITE_IS_ZERO = 0  # TIFF PhotometricInterpretation
_PHOTOMETRIC = 262  # its tag


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as 8-bit RGB: PIL's conversion, with high-bit-depth greyscale scaled and the modes it gets wrong done
    here (see the module docstring)."""
    mode = image.mode
    if mode in _SIXTEEN_BIT or mode in ("I", "F"):
        grey = _reduced_grey(image)
        if _white_is_zero(image):
            grey = 255 - grey
        return Image.fromarray(grey).convert("RGB")
    if mode == "LAB":
        # here, not at the top: PIL.ImageCms needs Pillow's optional littlecms, and only LAB images need it
        from PIL import ImageCms

        return ImageCms.applyTransform(image, _lab_to_srgb())
    if mode == "La":
        image = image.convert("LA")
    elif mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def _reduced_grey(image: Image.Image) -> np.ndarray:
    """A high-bit-depth greyscale image (I;16*, I, F) as 8-bit values (uint8, H x W)."""
    mode = image.mode
    if mode == "F":
        values = np.asarray(image, dtype=np.float64)
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if not (np.isfinite(low) and np.isfinite(high) and 0 <= low and high <= 255):
            raise ValueError(f"a floating-point image with values from {low:g} to {high:g}: no known range to reduce "
                             f"to 8 bits (0..1 or 0..255); save it as 8 or 16 bits")
        scale = 255.0 if high <= 1.0 else 1.0
        return np.rint(values * scale).astype(np.uint8)
    values = np.asarray(image)
    if mode == "I" and values.size and (values.min() < 0 or values.max() > 65535):
        raise ValueError(f"a 32-bit integer image with values from {values.min()} to {values.max()}: no known "
                         f"range to reduce to 8 bits (16-bit images hold 0..65535); save it as 8 or 16 bits")
    return (values.astype(np.uint32) >> 8).astype(np.uint8)


def _white_is_zero(image: Image.Image) -> bool:
    tags = getattr(image, "tag_v2", None)  # a TIFF's
    return tags is not None and tags.get(_PHOTOMETRIC) == _WHITE_IS_ZERO


@functools.cache
def _lab_to_srgb():
    """LittleCMS's transform from PIL's LAB (D50, as TIFF and ICC define it) to sRGB, without the 8-bit
    precalculation that makes it coarse. Built once per process (it cannot be pickled to data-loader workers)."""
    from PIL import ImageCms  # here, not at the top: as in to_rgb

    return ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), "LAB", "RGB",
                                   renderingIntent=ImageCms.Intent.RELATIVE_COLORIMETRIC,
                                   flags=ImageCms.Flags.NOOPTIMIZE)


def open_rgb(source) -> Image.Image:
    """Decode the image file `source` (a path or a binary file object) to 8-bit RGB (`to_rgb`); PIL's exceptions
    (and `to_rgb`'s ValueError) for a file that does not decode pass through."""
    with Image.open(source) as image:
        return to_rgb(image)
