"""Data: datasets (ImageNet-layout folders, their tar shards, synthetic), transforms, batch samplers, and the digits
data set.

`vim-ds data <command>` (= `python -m vim_ds.data <command>`) runs the data commands.
"""
from __future__ import annotations

import sys

from .datasets import DataError, SeededDataset, build_dataset, derive_seed, seeded_rngs
from .digits import write_digits
from .sampler import GlobalBatchSampler, ShardedEvalSampler, sample_seed
from .shards import ShardDataset, write_shards  # also registers --data-set shards with build_dataset
from .transforms import build_transform

__all__ = ["DataError", "SeededDataset", "build_dataset", "build_transform", "derive_seed", "seeded_rngs",
           "GlobalBatchSampler", "ShardedEvalSampler", "sample_seed", "write_digits", "ShardDataset", "write_shards",
           "main"]

COMMANDS = {
    "digits": ("vim_ds.data.digits", "write scikit-learn's 8x8 handwritten digits as train/ and val/ PNG folders"),
    "shard": ("vim_ds.data.shards", "write an ImageNet-layout folder as WebDataset tar shards with an offset index"),
    "photos": ("vim_ds.data.photos", "write JPEGs at ImageNet's sizes made from real photographs (for benchmarks)"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: vim-ds data <command> [options]\n\ncommands:\n{rows}\n\n'vim-ds data <command> --help' for options"


def main(argv=None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vim-ds data: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[name][0]).main(rest) or 0
