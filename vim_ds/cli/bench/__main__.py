"""`python -m vim_ds.bench ...` = `vim-ds bench ...`."""
import sys

from . import main

sys.exit(main())
