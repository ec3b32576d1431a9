"""`python -m vim_ds.env` = `vim-ds env`, the path scripts and launchers use; the command
is vim_ds/cli/env.py."""
import sys

from .cli.env import main

if __name__ == "__main__":
    sys.exit(main())
