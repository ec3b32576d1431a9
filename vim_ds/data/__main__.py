"""`python -m vim_ds.data <command>` = `vim-ds data <command>`."""
import sys

from . import main

sys.exit(main())
