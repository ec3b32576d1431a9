"""Data: datasets (ImageNet-layout folders, their tar shards, synthetic), transforms, batch samplers, and the digits
data set.

The commands that write data sets (`vim-ds data <command>` = `python -m vim_ds.data <command>`) are
vim_ds.cli.data_commands; this package is what they call.
"""
from __future__ import annotations

from .datasets import DataError, SeededDataset, build_dataset, derive_seed, seeded_rngs
from .digits import write_digits
from .sampler import GlobalBatchSampler, ShardedEvalSampler, sample_seed
# also registers --data-set shards with build_dataset
from .shards import ShardDataset, write_shards
from .transforms import build_transform

__all__ = ["DataError", "SeededDataset", "build_dataset", "build_transform", "derive_seed", "seeded_rngs",
           "GlobalBatchSampler", "ShardedEvalSampler", "sample_seed", "write_digits", "ShardDataset", "write_shards"]
