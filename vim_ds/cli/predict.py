"""`vim-ds predict --weights FILE IMAGE...` = `python -m vim_ds.predict`: the top-5 classes of each image.

The model comes from `--model`/`--model-kwargs`/`--input-size`, or from the description a `vim-ds convert` file
carries (its "vim_ds" entry, or the safetensors metadata), so a converted file needs nothing else. Class names:
the folder names of an ImageFolder root given with `--classes` (or a text file, one name per line); without it,
the names the file records (`vim-ds convert` writes those the run was trained on), ImageNet's (timm's
ImageNetInfo) for a 1000-class head that records none or ImageNet's synsets, else class indices. A `--classes`
folder must have the recorded names in their order (a renamed class folder would name every class after it
wrongly), and so must a file that shares any name with them; a file that shares none is taken as display names
for the recorded classes in label order, with a note. Images go through the evaluation
transform (resize to input_size / eval_crop_ratio, centre crop).
"""
from __future__ import annotations

import argparse
import codecs
import os
import sys

import torch
from timm.data import ImageNetInfo

from ..checkpoint.class_names import listing, refusal
from ..checkpoint.weights_model import load_model
from ..data.datasets import class_folders, decode_failure
from ..data.images import open_rgb
from ..data.names import alike, look_alike_key, quoted
from ..data.transforms import eval_transform
from ..runtime import env_vars
from ..runtime.errors import report_error
from .run_options import add_model_kwargs

PROG = "vim-ds predict"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--weights", required=True,
                   help="a .pth/.safetensors file (vim-ds convert output, published, or timm train.py's)")
    p.add_argument("--model", default=None, help="model name (default: from the converted file)")
    add_model_kwargs(p, default=None, help=None)  # None: the file's
    p.add_argument("--input-size", type=int, default=None)
    p.add_argument("--num-classes", type=int, default=None)
    p.add_argument("--eval-crop-ratio", type=float, default=0.875)
    p.add_argument("--classes", default=None, help="ImageFolder root (class folder names) or a file of names "
                   "(default: the names the weights file records)")
    p.add_argument("--ema", action="store_true", help="use the file's EMA weights ('model_ema' or 'state_dict_ema')")
    p.add_argument("--topk", type=int, default=5)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def class_names(spec: str | None, num_classes: int, recorded: list[str] | None = None,
                weights: str = "the weights") -> list[str] | None:
    """The name of each label: `spec` (--classes: a folder's class folders, or a file of names) checked against
    the names the weights record (`recorded`), else those, else ImageNet's for a 1000-class head."""
    if spec:
        folder = os.path.isdir(spec)
        if folder:
            # as training numbered them: hidden folders are no classes
            names = class_folders(spec)
        elif os.path.isfile(spec):
            names = names_file(spec)
        else:
            raise ValueError(f"--classes: not found: {spec}")
        if recorded and names != recorded and (folder or set(names) & set(recorded)):
            raise ValueError(refusal(weights, recorded, f"--classes {spec}", names,
                                     "give --classes the classes it was trained on, or leave --classes out (the "
                                     "file records their names)"))
        if len(names) != num_classes:
            raise ValueError(f"--classes: {len(names)} names in {spec}, the model has {num_classes} classes")
        # a file of other names (descriptions, another language): in label order
        if recorded and names != recorded:
            print(f"note: --classes {spec} names none of the classes {weights} records ({listing(recorded)}); "
                  f"its names are shown for them in label order ({names[0]} for {recorded[0]}, ...)",
                  file=sys.stderr, flush=True)
        return names
    if num_classes == 1000:
        info = ImageNetInfo()
        # ImageNet's synsets in their order: described
        if not recorded or recorded == list(info.label_names()):
            return [info.index_to_description(i) for i in range(1000)]
    return recorded


# what a text editor may put first in a file: the encoding it names, and that the text does not start with it
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def names_file(path: str) -> list[str]:
    """The names of a `--classes` file, one a line (blank lines and spaces at the ends left out). UTF-8, or what a
    byte-order mark says (Windows editors write one: UTF-8's, or UTF-16's for "Unicode"), the mark not part of the
    first name. Two names that are the same, or print the same (`names.alike`), are refused: two labels would be
    shown alike."""
    with open(path, "rb") as f:
        data = f.read()
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ValueError(f"--classes {path} is not {encoding.upper().replace('-SIG', '')} text (byte "
                         f"0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8") from None
    if "\x00" in text:  # valid UTF-8, but no name holds one
        raise ValueError(f"--classes {path} holds NUL bytes: UTF-16 without a byte-order mark, or not text at all; "
                         f"save it as UTF-8")
    numbered = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    _refuse_repeats(path, numbered)
    return [name for _, name in numbered]


def _refuse_repeats(path: str, numbered: list[tuple[int, str]]) -> None:
    first = {}
    for number, name in numbered:
        earlier, earlier_name = first.setdefault(look_alike_key(name), (number, name))
        if earlier == number:
            continue
        same = (f"names {quoted(name)} twice" if name == earlier_name else
                f"names {quoted(earlier_name)} and {quoted(name)}, {alike(earlier_name, name)},")
        raise ValueError(f"--classes {path} {same} on lines {earlier} and {number}: two labels would be shown "
                         f"alike; give each class a name of its own")


def predict(args) -> list[tuple[str, list[tuple[str, float]] | str]]:
    """(image path, its top classes with probabilities) per image, or (path, why it cannot be read): an image that
    does not decode, like one PIL refuses as a decompression bomb, does not stop the others."""
    model, input_size, num_classes, recorded = load_model(args.weights, model=args.model, kwargs=args.model_kwargs,
                                                          input_size=args.input_size,
                                                          num_classes=args.num_classes, ema=args.ema)
    names = class_names(args.classes, num_classes, recorded, args.weights)
    transform = eval_transform(input_size, args.eval_crop_ratio)
    results = []
    for path in args.images:
        try:
            image = open_rgb(path)  # as training reads it: high-bit-depth images scaled to 8 bits
        except Exception as exc:  # noqa: BLE001 - PIL raises OSError, SyntaxError, DecompressionBombError, ...
            results.append((path, "no such file" if isinstance(exc, FileNotFoundError) else decode_failure(path, exc)))
            continue
        x = transform(image).unsqueeze(0)
        with torch.no_grad():
            probs = model(x).float().softmax(-1)[0]
        top = probs.topk(min(args.topk, num_classes))
        results.append((path, [(names[i] if names else str(i), p) for p, i in
                               zip(top.values.tolist(), top.indices.tolist())]))
    return results


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    refused = env_vars.refusal(PROG)  # a VIM_DS_* variable it cannot read: one line, before anything starts
    if refused:
        return refused
    try:
        results = predict(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        return report_error(PROG, exc)
    unreadable = 0
    for path, top in results:
        if isinstance(top, str):
            report_error(PROG, f"cannot read image {path} ({top})")
            unreadable += 1
        else:
            print(f"{path}: " + ", ".join(f"{name} {p:.3f}" for name, p in top))
    return 2 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
