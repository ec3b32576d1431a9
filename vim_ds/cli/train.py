"""`vim-ds train` = `python -m vim_ds.train`: train (or, with --eval, evaluate) Vim with DeepSpeed.

Launch it with the deepspeed launcher, torchrun, a SLURM wrapper, or as one plain process:

    deepspeed --num_gpus 8 --module vim_ds.train --deepspeed_config ds_configs/zero2.json \\
        --model vim_small --data-path /data/imagenet --output_dir runs/vim_small

Option names follow the published Vim/DeiT `main.py`; `--batch-size` is the per-rank micro batch.
"""
from __future__ import annotations

import sys
from typing import NoReturn

from ..engine.run import run
from ..runtime import distributed
from . import run_options


def build_parser():
    """The command's parser (the option audit and `--help` read it): the run's options (cli/run_options.py)."""
    return run_options.build_parser(prog="vim-ds train")


def main(argv=None, prog: str = "vim-ds train") -> NoReturn:
    """The rank process's entry (`python -m vim_ds.train`, `vim-ds train`): it ends the process itself (see
    distributed.end_rank_process), so its exit code is the run's, whatever the interpreter's teardown would do."""
    distributed.end_rank_process(run(run_options.parse_config(argv, prog), prog))


if __name__ == "__main__":
    sys.exit(main())
