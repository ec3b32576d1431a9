"""The data layer's configs as a run fills them (`vim_ds.config.components`, from the run's RunConfig), for tests
that build datasets, transforms, loaders and Mixup without a run: `vim-ds train`'s defaults with some options changed
(by dest)."""
from __future__ import annotations

import argparse

from vim_ds.cli.run_options import build_parser
from vim_ds.config import components
from vim_ds.config.run_config import RunConfig


def train_options(**changes) -> argparse.Namespace:
    """The train parser's defaults (as parsed from an empty command line, before parse_args's checks), changed."""
    args = build_parser().parse_args([])
    unknown = set(changes) - set(vars(args))
    assert not unknown, f"not options of vim-ds train: {sorted(unknown)}"
    return argparse.Namespace(**{**vars(args), **changes})


def run_config(**changes) -> RunConfig:
    """The same options as the typed config the engine reads."""
    return RunConfig.from_dict(vars(train_options(**changes)))


def dataset_config(**changes):
    return components.dataset_config(run_config(**changes))


def transform_config(**changes):
    return components.transform_config(run_config(**changes))


def loader_config(**changes):
    return components.loader_config(run_config(**changes))
