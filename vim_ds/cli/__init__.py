"""The command line (vim_ds/cli/): this dispatcher, the `vim-ds` console script, and one module or package per
subcommand beside it (`vim-ds X` = `python -m vim_ds.X`, through the forwarder kept at that path), with the run's
option parser (run_options.py). Nothing below imports the command line (tests/test_layering.py).

One dispatcher serves every level: a subcommand whose module holds a `COMMANDS` table of its own (`vim-ds data`:
vim_ds.cli.data_commands) is dispatched the same way one level down. Commands are imported by name, only the one run.
"""
from __future__ import annotations

import importlib
import sys

from ..runtime.errors import report_error
from ..runtime.versions import unsupported

SUBCOMMANDS = {
    "train": ("vim_ds.cli.train", "train Vim with DeepSpeed (ZeRO 0-3, bf16/fp16/fp32, offload)"),
    "eval": ("vim_ds.cli.eval", "evaluate a checkpoint directory or weights file on a validation set"),
    "convert": ("vim_ds.cli.convert", "a checkpoint directory -> one .pth/.safetensors weights file (fp32 masters)"),
    "predict": ("vim_ds.cli.predict", "top-5 classes of images with a weights file"),
    "export": ("vim_ds.cli.export", "a weights file -> a torch.export program (.pt2) for inference"),
    "env": ("vim_ds.cli.env", "versions, accelerator and selective-scan backends"),
    "bench": ("vim_ds.cli.bench", "benchmarks: scan kernels, model steps, training, conversion, the input pipeline"),
    "zero-compare": ("vim_ds.cli.zero_compare", "ZeRO stages side by side: model-state bytes per rank vs theory"),
    "compare-runs": ("vim_ds.cli.compare_runs", "loss curves of runs (clusters, vendors, layouts) vs a reference run"),
    "demo": ("vim_ds.cli.demo", "a short demonstration of the model and kernels"),
    "configs": ("vim_ds.cli.configs",
                "the DeepSpeed configs shipped with vim_ds (--deepspeed_config NAME), and copies"),
    "data": ("vim_ds.cli.data_commands",
             "datasets: the digits ImageFolder, real-photo JPEGs (vim-ds data digits|photos --out DIR)"),
}


def usage(prog: str = "vim-ds", table: dict = SUBCOMMANDS) -> str:
    width = max(map(len, table))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items())
    return f"usage: {prog} <command> [options]\n\ncommands:\n{rows}\n\n'{prog} <command> --help' for options"


def dispatch(prog: str, table: dict, argv: list[str]) -> int:
    """Run `prog NAME ARGS...`: the module `table` names for NAME gets ARGS (its `main(ARGS)`), or, when that module
    is a level of its own (a `COMMANDS` table), `prog NAME` dispatches ARGS the same way. Returns the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog, table))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{usage(prog, table)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    if hasattr(module, "COMMANDS"):
        return dispatch(f"{prog} {name}", module.COMMANDS, rest)
    return module.main(rest) or 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    refused = unsupported()  # a torch or DeepSpeed too old: said before any command imports them
    if refused:
        return report_error("vim-ds" if not argv or argv[0] not in SUBCOMMANDS else f"vim-ds {argv[0]}", refused)
    return dispatch("vim-ds", SUBCOMMANDS, argv)
