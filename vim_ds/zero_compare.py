"""`python -m vim_ds.zero_compare` = `vim-ds zero-compare`, the path scripts and launchers use; the command
is vim_ds/cli/zero_compare.py."""
import sys

from .cli.zero_compare import main

if __name__ == "__main__":
    sys.exit(main())
