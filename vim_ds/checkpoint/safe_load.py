"""Reading checkpoint files with `torch.load(weights_only=True)` only, including inside DeepSpeed.

A pickle can run any code while it is unpickled, and checkpoint directories travel (shared file systems, copies
from colleagues, downloads). Our own loads pass `weights_only=True`; DeepSpeed's (`load_checkpoint`, `zero_to_fp32`,
`ds_to_universal`) pass `weights_only=False`, so `deepspeed_loads()` forces them with torch's
`TORCH_FORCE_WEIGHTS_ONLY_LOAD`, allow-listing the few DeepSpeed classes its files hold. A refused file becomes a
one-line `CheckpointError` naming it.

    python -m vim_ds.checkpoint.safe_load DIR MODULE ARGS...   runs `python -m MODULE ARGS...` (e.g. DeepSpeed's
    ds_to_universal) under deepspeed_loads(DIR); a refused file is one `error:` line and exit code 2.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import runpy
import sys

import numpy as np
import torch

from .deepspeed_dir import EMA_FILE
from .files import SAFE_GLOBALS, CheckpointError, refusal, safe_globals

FORCE, FORCE_NO = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def deepspeed_globals() -> list:
    """Non-torch types in DeepSpeed 0.19 checkpoints (model_states, optim_states, universal `zero/` files) for ZeRO
    0-3, bf16/fp16/fp32, with or without offload: the loss scaler objects of the ZeRO and bf16 optimizers, the
    ZeRO stage enum and the fragment addresses of `param_slice_mappings`. (torch.Size, OrderedDict and tensors
    are torch's own allow-list.) DeepSpeed 0.16's model states also hold a `set` (`sparse_tensor_module_names`),
    which newer torch (2.14) allows by default and torch 2.4 does not: there every resume and conversion of such a
    checkpoint was refused as unsafe. A set of names is data, as a list is."""
    # DeepSpeed here, not at the top: seconds of start-up; only a DeepSpeed checkpoint's files need these
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    by_name = [(_enum_member, f"{module}.getattr") for module in ("builtins", "__builtin__")]
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, set, *by_name]


def _enum_member(cls, name):
    """`getattr(cls, name)` for an allow-listed enum's member, and nothing else. Some Pythons (Debian 12's 3.11.2,
    not 3.11.7) pickle members of int-mixin enums such as DeepSpeed's ZeroStageEnum as `getattr(ZeroStageEnum,
    'gradients')`; allowing `getattr` itself would hand any attribute of any allowed class to the pickle."""
    # DeepSpeed here, not at the top (start-up): as in deepspeed_globals
    from deepspeed.runtime.zero.config import ZeroStageEnum

    if cls is ZeroStageEnum and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    what = getattr(cls, "__name__", type(cls).__name__)
    raise pickle.UnpicklingError(f"Unsupported global: getattr({what}, {name!r}), not a member of an allowed enum")


def numpy_rng_globals() -> list:
    """What a NumPy RNG state pickles to: only for `rng_rank{N}.pt` files written before they held tensors."""
    core = getattr(np, "_core", None) or np.core  # NumPy 2 / 1
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]


def load(path: str, extra_globals=(), mmap: bool = False):
    """torch.load(path, weights_only=True) on CPU, allowing vim_ds's and DeepSpeed's types (and `extra_globals`);
    with `mmap` the tensors are mapped, not read."""
    try:
        with safe_globals(SAFE_GLOBALS + deepspeed_globals() + list(extra_globals)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file not found: {path}") from None
    except Exception as exc:
        raise refusal(path, exc) from exc


def first_unsafe_file(directory: str) -> tuple[str, Exception] | None:
    """The first of DeepSpeed's `*.pt` files under `directory` that a weights-only load refuses (with mmap, so
    the tensors are not read). vim_ds's own files there (EMA, RNG states) are loaded, and checked, by vim_ds."""
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.pt"), recursive=True)):
        if os.path.basename(path) == EMA_FILE or os.path.basename(path).startswith("rng_rank"):
            continue
        try:
            with safe_globals(SAFE_GLOBALS + deepspeed_globals()):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any refusal is reported by the caller
            return path, exc
    return None


@contextlib.contextmanager
def deepspeed_loads(directory: str):
    """Every torch.load inside (DeepSpeed's too) is weights-only with DeepSpeed's types allowed; a file refused
    there raises CheckpointError naming it (looked for under `directory`, the checkpoint being read)."""
    saved = {name: os.environ.pop(name, None) for name in (FORCE, FORCE_NO)}
    os.environ[FORCE] = "1"
    try:
        with safe_globals(SAFE_GLOBALS + deepspeed_globals()):
            yield
    except pickle.UnpicklingError as exc:
        found = first_unsafe_file(directory)
        raise refusal(found[0], found[1]) if found else refusal(f"a file in {directory}", exc) from exc
    finally:
        os.environ.pop(FORCE, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m vim_ds.checkpoint.safe_load CHECKPOINT_DIR MODULE [ARGS...]", file=sys.stderr)
        return 2
    directory, sys.argv = argv[0], argv[1:]
    try:
        with deepspeed_loads(directory):
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
