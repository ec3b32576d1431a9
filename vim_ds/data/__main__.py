"""`python -m vim_ds.data <command>` = `vim-ds data <command>`: an entry point of the commands
(vim_ds.cli.data_commands), not a part of the data library."""
import sys

from vim_ds.cli import main

sys.exit(main(["data", *sys.argv[1:]]))
