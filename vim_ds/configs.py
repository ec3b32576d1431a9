"""`python -m vim_ds.configs` = `vim-ds configs`, the path scripts and launchers use; the command
is vim_ds/cli/configs.py."""
import sys

from .cli.configs import main

if __name__ == "__main__":
    sys.exit(main())
