"""`vim-ds eval` = `python -m vim_ds.eval` = `vim-ds train --eval`: top-1/top-5/loss of saved weights on a
validation set, distributed over however many ranks are launched.

The weights come from `--resume` (a DeepSpeed checkpoint directory written by `vim-ds train`, any ZeRO stage and
rank count, or a plain .pth/.safetensors file) or from `--finetune` (a published checkpoint). The model runs
replicated on every rank (no DeepSpeed engine is needed to evaluate); the validation set is sharded
(`vim_ds.engine.evaluate.evaluate_weights`).
"""
from __future__ import annotations

import sys
from typing import NoReturn

from ..engine.run import run
from ..runtime import distributed
from .run_options import build_parser as train_parser
from .run_options import parse_config


def build_parser():
    """`vim-ds train`'s parser under this command's name (main adds `--eval`)."""
    return train_parser(prog="vim-ds eval")


def main(argv=None) -> NoReturn:
    argv = list(sys.argv[1:] if argv is None else argv)
    # ends the process itself, as `vim-ds train` does (distributed.end_rank_process)
    distributed.end_rank_process(run(parse_config(argv + ["--eval"], prog="vim-ds eval"), prog="vim-ds eval"))


if __name__ == "__main__":
    sys.exit(main())
