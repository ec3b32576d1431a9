"""Load weight files that users bring, without ever running code from them.

Published Vim checkpoints are ``{"model": state_dict, "args": argparse.Namespace, ...}`` pickles (DeiT heritage).
They are read with ``torch.load(weights_only=True)``, allow-listing only the few plain types such files contain;
a pickle that asks for anything else is refused with a message saying so. ``.safetensors`` files are read as such.
"""
from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import torch

# Types found in DeiT/Vim training checkpoints besides tensors and containers: the argparse Namespace of the
# command line, and paths in it.
SAFE_GLOBALS = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath]


class CheckpointError(ValueError):
    """A weights file that is missing, unreadable, unsafe or does not fit the model."""


_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation", "Re-running", "(1)",
                "(2)", "In PyTorch")


def _unpickler_reason(text: str) -> str:
    """The one informative line of torch.load's long weights-only error (or the first line of any other)."""
    lines = [line.strip() for line in text.replace("WeightsUnpickler error:", "\n").splitlines() if line.strip()]
    refused_global = [line for line in lines if "GLOBAL" in line]  # torch's wording differs between cases
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


def load_weights_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a .pth/.pt/.bin (pickle, weights only) or .safetensors file into a dict, on CPU."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise refusal(path, exc) from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict or {{'model': state_dict}}")
    return obj


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike, key: str = "model", strict: bool = True):
    """Load a published-format or converted checkpoint into a VisionMamba, adapting position embeddings and head.

    `key` picks the entry of a checkpoint dict ("model", or "model_ema" for EMA weights); a bare state dict is
    used as it is.
    """
    from ..models.vim import load_state_dict_into

    obj = load_weights_file(path)
    if key in obj and isinstance(obj[key], dict):
        state_dict = obj[key]
    elif key != "model":
        raise CheckpointError(f"{path} has no {key!r} entry (entries: {', '.join(map(str, obj))})")
    elif all(isinstance(v, torch.Tensor) for v in obj.values()):
        state_dict = obj
    else:
        raise CheckpointError(f"{path} has no 'model' entry and is not a state dict (entries: {', '.join(map(str, obj))})")
    try:
        return load_state_dict_into(model, state_dict, strict=strict)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
