"""`python -m vim_ds.eval` = `vim-ds eval`, the path scripts and launchers use; the command
is vim_ds/cli/eval.py."""
import sys

from .cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
