"""`vim-ds data digits`: scikit-learn's handwritten digits as an ImageNet-layout folder (vim_ds.data.digits)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...data.digits import clear_output_folder, write_digits
from ...runtime.errors import report_error


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vim-ds data digits",
        description="Write scikit-learn's 1,797 handwritten 8x8 digit images as PNG files in the ImageNet layout "
                    "(DIR/train/<digit>/*.png, DIR/val/<digit>/*.png), ready for "
                    "`--data-set folder --data-path DIR`.")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (must be empty or new)")
    parser.add_argument("--val-fraction", type=_fraction, default=0.2, metavar="F",
                        help="fraction of each class written to val/ (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty DIR, replacing the train/ and val/ that `vim-ds data` wrote "
                             "there (refused when they hold other files; nothing else is touched)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    out = Path(args.out)
    problem = clear_output_folder(out, args.force)
    if problem:
        return report_error("vim-ds data digits", problem)
    counts = write_digits(out, val_fraction=args.val_fraction, seed=args.seed)
    print(f"wrote {counts['train']} training and {counts['val']} validation images of {counts['classes']} classes "
          f"to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
