"""`python -m vim_ds.cli ...` = `vim-ds ...`."""
import sys

from . import main

sys.exit(main())
