"""Load weight files that users bring, without ever running code from them.

Published Vim checkpoints are ``{"model": state_dict, "args": argparse.Namespace, ...}`` pickles (DeiT heritage);
timm's train.py writes ``{"state_dict": ..., "state_dict_ema": ..., "args": argparse.Namespace, ...}`` ones.
They are read with ``torch.load(weights_only=True)``, allow-listing only the few plain types such files contain;
a pickle that asks for anything else is refused with a message saying so. safetensors files are read as such.

A file is recognised by its content, not its name (`sniff`): a safetensors file renamed `.pth` (torch.load would say
`Unsupported operand 184`) or a torch file named `.safetensors` loads all the same, and a file that is neither (an
HTML page saved as a download, a Git LFS pointer, an archive) is refused with one line saying what it looks like.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import pathlib
from typing import Any

import torch
from safetensors.torch import load_file

from ..models.vim import load_state_dict_into

# Types found in DeiT/Vim training checkpoints besides tensors and containers: the argparse Namespace of the
# command line, and paths in it.
SAFE_GLOBALS = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath]


class CheckpointError(ValueError):
    """A weights file that is missing, unreadable, unsafe or does not fit the model."""


_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation", "Re-running", "(1)",
                "(2)", "In PyTorch")


def safe_globals(allowed: list):
    """``torch.serialization.safe_globals(allowed)``: the types a weights-only ``torch.load`` may build, for the
    loads inside the ``with``. torch 2.4 has no such context manager, only the process-wide allow-list
    (``add_safe_globals``): there the list is added for the block and put back as it was after it. The
    ``(object, "module.name")`` pairs of the list are dropped where torch's allow-list cannot take them (2.4, 2.5:
    there such a file is refused, as any global the list does not hold)."""
    if not hasattr(torch.serialization, "safe_globals"):
        return _scoped_safe_globals(_without_pairs(allowed))
    if not _allow_list_takes_pairs():
        allowed = _without_pairs(allowed)
    return torch.serialization.safe_globals(allowed)


def _without_pairs(allowed: list) -> list:
    return [entry for entry in allowed if not isinstance(entry, tuple)]


@functools.cache
def _allow_list_takes_pairs() -> bool:
    """Whether this torch's weights-only allow-list takes ``(object, "module.name")`` pairs (torch >= 2.6). torch
    2.5 takes the list but reads every entry's ``__module__`` at the first global it looks up, so a pair there
    failed every load it was allowed for (``'tuple' object has no attribute '__module__'``). Found by loading a
    small file with one pair allowed, not by the version."""
    buffer = io.BytesIO()
    torch.save(argparse.Namespace(), buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals([(argparse.Namespace, "argparse.Namespace")]):
            return isinstance(torch.load(buffer, weights_only=True), argparse.Namespace)
    except Exception:  # noqa: BLE001 - any failure means the pairs cannot be used
        return False


@contextlib.contextmanager
def _scoped_safe_globals(allowed: list):
    # a copy: torch 2.4 returns its live list, which add_safe_globals extends in place, so the types added here
    # stayed allowed for the rest of the process
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _unpickler_reason(text: str) -> str:
    """The one informative line of torch.load's long weights-only error (or the first line of any other)."""
    lines = [line.strip() for line in text.replace("WeightsUnpickler error:", "\n").splitlines() if line.strip()]
    # torch's wording differs between cases
    refused_global = [line for line in lines if "GLOBAL" in line]
    if refused_global:
        return refused_global[0].split(". ")[0].rstrip(".")
    informative = [line for line in lines if not line.startswith(_BOILERPLATE)]
    return (informative or lines or [""])[0]


def refusal(path: str, exc: BaseException) -> CheckpointError:
    """The one-line error for a file that torch.load(weights_only=True) did not accept."""
    message = _unpickler_reason(str(exc)) or type(exc).__name__
    if "global" in message.lower():  # the unpickler refused to import a callable or class
        return CheckpointError(f"refusing to load {path}: unsafe, it holds Python objects other than weights that "
                               f"could run code when unpickled ({message})")
    return CheckpointError(f"{path} is not a readable PyTorch checkpoint: {message}")


SAFETENSORS, TORCH = "safetensors", "torch"


def sniff(path: str) -> tuple[str, str]:
    """(kind, what it looks like) of a file from its first bytes: kind SAFETENSORS (an 8-byte little-endian header
    length, then the JSON header, which starts with '{'), TORCH (a zip archive: torch.save's format; or a pickle:
    its legacy one), or "" for neither, with a description of what the file seems to be instead."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "", "an empty file"
    if len(head) > 8 and head[8:9] == b"{":
        header = int.from_bytes(head[:8], "little")
        if header <= size - 8:
            return SAFETENSORS, "a safetensors file"
        # a plausible header length, longer than the file: cut short (not a stray '{')
        if header < 2**32:
            return "", f"a safetensors file cut short (its header alone is {header} bytes, the file {size})"
    if head.startswith(b"PK\x03\x04"):
        return TORCH, "a zip archive (torch.save's format)"
    # pickle protocol 2-5
    if head.startswith(b"\x80") and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return TORCH, "a pickle (torch.save's legacy format)"
    text = head.lstrip().lower()
    if head.startswith(b"version https://git-lfs"):
        what = "a Git LFS pointer, not the file it points to (run `git lfs pull`)"
    elif text.startswith((b"<!doctype html", b"<html")):
        what = "an HTML page (a download that returned a web page instead of the file?)"
    elif head.startswith(b"\x1f\x8b"):
        what = "a gzip-compressed file (unpack it first)"
    elif head[257:262] == b"ustar":
        what = "a tar archive (unpack it first)"
    elif head.startswith(b"\x93NUMPY"):
        what = "a NumPy .npy array"
    elif head.startswith(b"\x89HDF"):
        what = "an HDF5 file (Keras or TensorFlow weights?)"
    else:
        try:
            first = head.decode("utf-8").strip().splitlines()[0] if head.strip() else ""
        except UnicodeDecodeError:
            first = None
        if first == "":
            what = "blank text"
        elif first is not None and first.isprintable():
            what = f"a text file (it starts {first[:40]!r})"
        else:
            what = f"an unknown binary format (it starts with bytes {head[:8].hex(' ')})"
    return "", what


def is_safetensors(path: str | os.PathLike) -> bool:
    """Whether the file at `path` holds safetensors, whatever its name."""
    try:
        return sniff(os.fspath(path))[0] == SAFETENSORS
    except OSError:
        return False


def load_weights_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a torch file (zip or legacy pickle, weights only; .pth/.pt/.bin) or a safetensors file into a dict, on
    CPU, told apart by their content (`sniff`), not their names."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        kind, what = sniff(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if kind == SAFETENSORS:
        try:
            return load_file(path, device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    try:  # an open file, not the path: torch.load would take a path named .safetensors to be one
        with open(path, "rb") as f, safe_globals(SAFE_GLOBALS):
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch.load's complaint (`Unsupported operand 60`, `invalid load key`) would not say it
        if not kind:
            raise CheckpointError(f"{path} is neither a PyTorch checkpoint nor a safetensors file: it looks like "
                                  f"{what}") from exc
        raise refusal(path, exc) from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict; accepted: {ACCEPTED}")
    return obj


# The checkpoint layouts a weights file may have: (entry of the weights, entry of their EMA), first match wins.
FORMATS = (("model", "model_ema"),  # published Vim/DeiT files and `vim-ds convert` output
           ("state_dict", "state_dict_ema"))  # timm's train.py (timm.utils.CheckpointSaver)
ACCEPTED = ("{'model': ..., 'model_ema': ...} (Vim/DeiT, vim-ds convert), {'state_dict': ..., 'state_dict_ema': ...} "
            "(timm train.py) or a bare state dict")


def _unprefixed(state_dict: dict) -> dict:
    """Without the "module." of a state dict saved from a DDP-wrapped model."""
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}


def split_weights(obj: dict, source: str) -> tuple[dict, dict | None]:
    """(weights, EMA weights or None) of a loaded checkpoint in any of FORMATS, or of a bare state dict.

    `source` names the file in the one-line error raised when `obj` holds no weights.
    """
    for weights_key, ema_key in FORMATS:
        if isinstance(obj.get(weights_key), dict):
            ema = obj.get(ema_key)
            return _unprefixed(obj[weights_key]), _unprefixed(ema) if isinstance(ema, dict) else None
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _unprefixed(obj), None
    raise CheckpointError(f"{source} holds no weights (entries: {', '.join(map(str, list(obj)[:8])) or 'none'}); "
                          f"accepted: {ACCEPTED}")


def select_weights(obj: dict, source: str, ema: bool = False) -> dict:
    """The weights of a loaded checkpoint (split_weights), or with `ema` its EMA weights (an error if it has none)."""
    weights, ema_weights = split_weights(obj, source)
    if not ema:
        return weights
    if ema_weights is None:
        raise CheckpointError(f"{source} has no EMA weights (no 'model_ema' or 'state_dict_ema' entry)")
    return ema_weights


def load_into(model: torch.nn.Module, state_dict: dict, source: str, strict: bool = True):
    """load_state_dict_into (position embeddings and head adapted), its mismatch error naming `source`."""
    try:
        return load_state_dict_into(model, state_dict, strict=strict)
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike, ema: bool = False, strict: bool = True):
    """Load a weights file in any of FORMATS (its EMA weights with `ema`), or a bare state dict, into a VisionMamba,
    adapting position embeddings and head."""
    return load_into(model, select_weights(load_weights_file(path), os.fspath(path), ema), os.fspath(path), strict)
