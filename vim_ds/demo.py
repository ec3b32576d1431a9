"""`python -m vim_ds.demo` = `vim-ds demo`, the path scripts and launchers use; the command
is vim_ds/cli/demo.py."""
import sys

from .cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
