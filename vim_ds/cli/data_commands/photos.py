"""`vim-ds data photos`: an ImageNet-like folder of JPEGs made from real photographs, for timing the input pipeline
(vim_ds.data.photos)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...data.digits import clear_output_folder
from ...data.photos import DEFAULT_QUALITY, DEFAULT_SIZES, write_photos
from ...runtime.errors import report_error


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 500x375, got {text!r}") from None
    if not (8 <= width <= 4096 and 8 <= height <= 4096):
        raise argparse.ArgumentTypeError(f"sides must be between 8 and 4096 pixels, got {text!r}")
    return width, height


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vim-ds data photos",
        description="Write an ImageNet-layout folder (DIR/train/<class>/*.jpg, DIR/val/<class>/*.jpg) of JPEGs "
                    "made from the real photographs shipped with scikit-learn: random crops, flips and colour "
                    "shifts at ImageNet's common sizes, quality 90. For timing the input pipeline "
                    "(`vim-ds bench data --data-path DIR`); the labels mean nothing.")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (must be empty or new)")
    parser.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    parser.add_argument("--per-class", type=int, default=50, help="training images per class (default 50)")
    parser.add_argument("--val-per-class", type=int, default=None,
                        help="validation images per class (default: a fifth of --per-class, at least 1)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same files (default 0)")
    parser.add_argument("--quality", type=int, default=DEFAULT_QUALITY, help="JPEG quality (default 90)")
    parser.add_argument("--sizes", type=_size, nargs="+", default=list(DEFAULT_SIZES), metavar="WxH",
                        help="image sizes, each image picks one "
                             f"(default {' '.join(f'{w}x{h}' for w, h in DEFAULT_SIZES)})")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty DIR, replacing the train/ and val/ that `vim-ds data` wrote "
                             "there (refused when they hold other files; nothing else is touched)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    prog = "vim-ds data photos"
    out = Path(args.out)
    problem = clear_output_folder(out, args.force)
    if problem:
        return report_error(prog, problem)
    try:
        counts = write_photos(out, classes=args.classes, per_class=args.per_class, val_per_class=args.val_per_class,
                              seed=args.seed, quality=args.quality, sizes=args.sizes)
    except ValueError as exc:
        return report_error(prog, exc)
    print(f"wrote {counts['train']} training and {counts['val']} validation JPEGs (quality {args.quality}) of "
          f"{counts['classes']} classes to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
