"""`python -m vim_ds.export` = `vim-ds export`, the path scripts and launchers use; the command
is vim_ds/cli/export.py."""
import sys

from .cli.export import main

if __name__ == "__main__":
    sys.exit(main())
