"""`vim-ds export --weights FILE --out model.pt2` = `python -m vim_ds.export`: a torch.export program for inference.

The model comes from the weights file as in `vim-ds predict` (`--model`, `--model-kwargs`, `--input-size`, or the
description a `vim-ds convert` file carries). The program takes images (batch, 3, N, N), float32, and returns
logits; the batch size is dynamic. The selective scan stays one registered operator per call
(`torch.ops.vim_ds.*`), so loading the program needs vim_ds imported first:

    import torch, vim_ds
    program = torch.export.load("model.pt2")
    logits = program.module()(images)
"""
from __future__ import annotations

import argparse
import os
import sys
import zipfile

import torch

from ..checkpoint.atomic_write import same_file, write_atomically
from ..checkpoint.weights_model import load_model
from ..runtime import env_vars
from ..runtime.errors import report_error
from .run_options import add_model_kwargs

PROG = "vim-ds export"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True,
                   help="a .pth/.safetensors file (vim-ds convert output, published, or timm train.py's)")
    p.add_argument("--out", required=True, help="the program file to write (.pt2)")
    p.add_argument("--model", default=None, help="model name (default: from the converted file)")
    add_model_kwargs(p, default=None, help=None)  # None: the file's
    p.add_argument("--input-size", type=int, default=None, help="image side (default: the file's, else 224)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="the head's classes (default: the file's); 0 with a backbone's weights (no head): the "
                        "program returns the pooled features instead of logits")
    p.add_argument("--ema", action="store_true", help="export the file's EMA weights ('model_ema' or 'state_dict_ema')")
    p.add_argument("--static-batch", action="store_true", help="fix the batch size at 2 instead of dynamic")
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def export(args) -> tuple[str, int, int]:
    """Write the program; return (path, input size, classes: 0 for a backbone's features)."""
    directory = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(directory):  # before the (slow) export, not after it
        raise ValueError(f"--out: no such directory: {directory}")
    problem = out_problem(args.out, args.weights)
    if problem:
        raise ValueError(problem)
    model, input_size, num_classes, _ = load_model(args.weights, model=args.model, kwargs=args.model_kwargs,
                                                    input_size=args.input_size, num_classes=args.num_classes,
                                                    ema=args.ema, backbone_ok=True)
    example = torch.randn(2, 3, input_size, input_size)
    dynamic = None if args.static_batch else {"x": {0: torch.export.Dim("batch", min=1, max=4096)}}
    with torch.no_grad():
        program = torch.export.export(model, (example,), dynamic_shapes=dynamic)

    def write(path: str):
        with open(path, "wb") as f:  # a file object: the archive's inner folder is not named after the temporary
            torch.export.save(program, f)

    # whole or not at all, however the export stops (see atomic_write)
    write_atomically(args.out, write)
    return args.out, input_size, num_classes


def out_problem(out: str, weights: str) -> str | None:
    """Why --out must not be written, or None: a folder, the --weights file itself (also through a link), or an
    existing file that is not a torch.export program (a program exported earlier is replaced)."""
    if os.path.isdir(out):
        return f"--out {out} is a folder: give the program file to write, e.g. {os.path.join(out, 'model.pt2')}"
    if same_file(out, [weights]):
        return f"--out {out} is the --weights file {weights}: writing the program would destroy the weights; give " \
               f"--out a new name, e.g. model.pt2"
    if not os.path.lexists(out):
        return None
    try:
        with zipfile.ZipFile(out) as archive:  # torch.export.save's archive: `<folder>/archive_format` in a zip
            if any(name.endswith("/archive_format") for name in archive.namelist()):
                return None
    except (OSError, zipfile.BadZipFile):
        pass
    return f"--out {out} exists and is not a torch.export program: {PROG} replaces only a program it wrote; give " \
           f"--out a new name, or move {out} away first"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    refused = env_vars.refusal(PROG)  # a VIM_DS_* variable it cannot read: one line, before anything starts
    if refused:
        return refused
    if not os.path.isfile(args.weights):
        return report_error(PROG, f"--weights: no such file: {args.weights}")
    try:
        path, size, num_classes = export(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        return report_error(PROG, exc)
    returns = "logits" if num_classes else "pooled features (no head)"
    print(f"wrote {path}: images (batch, 3, {size}, {size}) -> {returns}; load with `import vim_ds` then "
          f"torch.export.load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
