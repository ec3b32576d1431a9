"""`vim-ds configs` = `python -m vim_ds.configs`: the DeepSpeed configs that ship with vim_ds.

    vim-ds configs                 # one line each: name, ZeRO stage, precision, offload; then the recipes
    vim-ds configs --write DIR     # copy them to DIR to edit; then --deepspeed_config DIR/zero2.json

`vim-ds train --deepspeed_config NAME` takes a shipped name as well as a path, and `vim-ds train --config NAME` a
shipped recipe (a published Vim run: model, batch, lr schedule, regularisation, DeepSpeed config and precision).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from ..config import options_file
from ..config.ds_config import DEFAULT_ACCUM_STEPS, DEFAULT_MICRO_BATCH
from ..config.run_config import OPTIONS
from ..config.shipped_configs import DEFAULT, RECIPES, describe, recipes, shipped, shipped_dir
from ..engine.optim import scaled_lr
from ..runtime.errors import first_line, report_error


def build_parser(prog: str = "vim-ds configs") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--write", metavar="DIR", default="",
                   help="copy the shipped configs into DIR (created if missing; existing files are not replaced)")
    return p


def describe_recipe(path: str) -> str:
    """One line from a recipe: model, stage, global batch at its documented GPU count, effective lr, epochs,
    DeepSpeed config and precision, and where it comes from."""
    options, meta = options_file.load(path)
    value = {dest: option.default for dest, option in OPTIONS.items()}
    value.update(options)
    gpus = int(meta.get("gpus") or 1)
    micro = value.get("batch_size") or DEFAULT_MICRO_BATCH
    accum = value.get("accum_steps") or DEFAULT_ACCUM_STEPS
    split = value.get("sequence_parallel") or 1  # groups of `split` GPUs share each image (micro: per group)
    batch = gpus // split * micro * accum
    lr = scaled_lr(value["lr"], batch, value["unscale_lr"])
    accum_text = f" x {accum} accum" if accum != 1 else ""
    where = f"{gpus} GPUs" if split == 1 else f"{gpus} GPUs = {gpus // split} groups of {split}"
    return (f"{value['model']}, {meta.get('stage', '?')}: {where} x {micro}{accum_text} = global batch {batch}, "
            f"lr {lr:g} (--lr {value['lr']:g} per 512), {value['epochs']} epochs, "
            f"{value.get('deepspeed_config') or DEFAULT} {value.get('precision') or 'as its JSON'}"
            + (f"; from {meta['source']}" if meta.get("source") else ""))


def main(argv=None, prog: str = "vim-ds configs") -> int:
    args = build_parser(prog).parse_args(argv)
    configs = shipped()
    if not configs:
        return report_error(prog, "no shipped DeepSpeed configs found (looked for vim_ds/ds_configs/ and the "
                                  "source checkout's ds_configs/): reinstall vim_ds")
    if args.write:
        try:
            os.makedirs(args.write, exist_ok=True)
            existing = [name for name in configs if os.path.exists(os.path.join(args.write, f"{name}.json"))]
            if existing:
                held = ", ".join(f"{n}.json" for n in existing)
                return report_error(prog, f"{args.write} already holds {held}; nothing was written (move them away "
                                          f"or give another folder)")
            for name, path in configs.items():
                shutil.copyfile(path, os.path.join(args.write, f"{name}.json"))
        except OSError as exc:
            return report_error(prog, f"cannot write to {args.write}: {exc.strerror or first_line(exc)}")
        print(f"wrote {len(configs)} DeepSpeed configs to {args.write}: {', '.join(configs)}")
        return 0
    width = max(map(len, configs))
    print(f"DeepSpeed configs shipped with vim_ds ({shipped_dir()}); pass one as --deepspeed_config NAME:")
    for name, path in configs.items():
        default = "  [the default]" if name == DEFAULT else ""
        print(f"  {name:<{width}}  {describe(path)}{default}")
    found = recipes()
    if found:
        width = max(map(len, found))
        print(f"Recipes of the published Vim runs ({os.path.join(shipped_dir(), RECIPES)}); pass one as "
              f"`vim-ds train --config NAME` (the command line wins over it):")
        for name, path in found.items():
            try:
                line = describe_recipe(path)
            except ValueError as exc:  # a broken file is said, not a traceback
                line = f"unreadable: {exc}"
            print(f"  {name:<{width}}  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
