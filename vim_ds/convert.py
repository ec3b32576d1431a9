"""`python -m vim_ds.convert` = `vim-ds convert`, the path scripts and launchers use; the command
is vim_ds/cli/convert.py."""
import sys

from .cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
