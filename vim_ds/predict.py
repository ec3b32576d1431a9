"""`python -m vim_ds.predict` = `vim-ds predict`, the path scripts and launchers use; the command
is vim_ds/cli/predict.py."""
import sys

from .cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
