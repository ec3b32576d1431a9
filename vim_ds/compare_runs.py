"""`python -m vim_ds.compare_runs` = `vim-ds compare-runs`, the path scripts and launchers use; the command
is vim_ds/cli/compare_runs.py."""
import sys

from .cli.compare_runs import main

if __name__ == "__main__":
    sys.exit(main())
