"""`python -m vim_ds.train` = `vim-ds train`, the path launchers, scripts and docs use (`deepspeed --module
vim_ds.train`, torchrun's `-m vim_ds.train`); the command is vim_ds/cli/train.py."""
import sys

from .cli.train import main

if __name__ == "__main__":
    sys.exit(main())
