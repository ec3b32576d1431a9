"""`vim-ds data shard`: an ImageNet-layout folder as WebDataset tar shards with an index of member offsets
(vim_ds.data.shards: the format, the writer and the reader)."""
from __future__ import annotations

import argparse
import sys

from ...data.datasets import DataError
from ...data.shards import index_path, parse_size, write_shards
from ...runtime.errors import report_error


def _shard_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vim-ds data shard",
        description="Write an ImageNet-layout folder (DIR/train/<class>/*, DIR/val/<class>/*) or one folder of class "
                    "folders as WebDataset tar shards with an index of member offsets, for "
                    "`vim-ds train --data-set shards --data-path SHARDS` (the same samples, order and labels as "
                    "`--data-set folder --data-path DIR`).")
    parser.add_argument("--data-path", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument("--out", required=True, metavar="SHARDS", help="output folder (created if needed)")
    parser.add_argument("--shard-size", type=_shard_size, default=10**9, metavar="SIZE",
                        help="bytes per shard, about (default 1GB; units kB MB GB, KiB MiB GiB)")
    parser.add_argument("--split", metavar="NAME",
                        help="write DIR itself (a folder of class folders) as split NAME (train or val); default: "
                             "DIR's train/ and val/ when it has both, else DIR as 'train'")
    parser.add_argument("--force", action="store_true", help="replace the split(s) already in SHARDS")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        headers = write_shards(args.data_path, args.out, args.shard_size, split=args.split, force=args.force)
    except DataError as exc:
        return report_error("vim-ds data shard", exc)
    for split, header in headers.items():
        total = sum(s["bytes"] for s in header["shards"])
        print(f"{split}: {header['num_samples']} images of {len(header['classes'])} classes in "
              f"{len(header['shards'])} shard(s), {total / 1e6:.1f} MB, index {index_path(args.out, split)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
