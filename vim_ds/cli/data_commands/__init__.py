"""`vim-ds data <command>` (= `python -m vim_ds.data <command>`): the commands that write data sets, one module each.

`COMMANDS` is the `data` level of `vim-ds` (vim_ds.cli dispatches it, as it dispatches `vim-ds` itself); the writing
is the data library's (vim_ds.data): a command parses its options, makes one call and turns errors into exit codes.
"""

COMMANDS = {
    "digits": ("vim_ds.cli.data_commands.digits",
               "write scikit-learn's 8x8 handwritten digits as train/ and val/ PNG folders"),
    "shard": ("vim_ds.cli.data_commands.shard",
              "write an ImageNet-layout folder as WebDataset tar shards with an offset index"),
    "photos": ("vim_ds.cli.data_commands.photos",
               "write JPEGs at ImageNet's sizes made from real photographs (for benchmarks)"),
}
