"""The `vim-ds` console script: one entry point, one subcommand per module (`vim-ds X` = `python -m vim_ds.X`)."""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "train": ("vim_ds.train", "train Vim with DeepSpeed (ZeRO 0-3, bf16/fp16/fp32, offload)"),
    "eval": ("vim_ds.eval", "evaluate a checkpoint directory or weights file on a validation set"),
    "convert": ("vim_ds.convert", "a checkpoint directory -> one .pth/.safetensors weights file (fp32 masters)"),
    "predict": ("vim_ds.predict", "top-5 classes of images with a weights file"),
    "export": ("vim_ds.export", "a weights file -> a torch.export program (.pt2) for inference"),
    "env": ("vim_ds.env", "versions, accelerator and selective-scan backends"),
    "bench": ("vim_ds.bench", "benchmarks: scan kernels, model steps, training, conversion, the input pipeline"),
    "zero-compare": ("vim_ds.zero_compare", "ZeRO stages side by side: model-state bytes per rank vs theory"),
    "compare-runs": ("vim_ds.compare_runs", "loss curves of runs (clusters, vendors, layouts) vs a reference run"),
    "demo": ("vim_ds.demo", "a short demonstration of the model and kernels"),
    "configs": ("vim_ds.configs", "the DeepSpeed configs shipped with vim_ds (--deepspeed_config NAME), and copies"),
    "data": ("vim_ds.data", "datasets: the digits ImageFolder, real-photo JPEGs (vim-ds data digits|photos --out DIR)"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items())
    return f"usage: vim-ds <command> [options]\n\ncommands:\n{rows}\n\n'vim-ds <command> --help' for options"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"vim-ds: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
