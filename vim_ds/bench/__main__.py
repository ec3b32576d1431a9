"""`python -m vim_ds.bench ...` = `vim-ds bench ...` (vim_ds/cli/bench/)."""
import sys

from vim_ds.cli.bench import main

sys.exit(main())
