"""vim_ds: Vision Mamba (Vim) training with DeepSpeed, on AMD Instinct and NVIDIA GPUs, and on CPU.

Importing the package registers the Vim models in timm's registry.
"""
__version__ = "0.1.0"

import torch as _torch

# The ops are registered with torch.library.custom_op (torch 2.4). A torch without it gets the package without the
# models and ops, so that `vim-ds` and each rank refuse that torch in one line (runtime/versions.py) instead of a
# traceback from here.
if hasattr(_torch.library, "custom_op"):
    from . import models  # noqa: F401  (registers the timm models)
    from .ops import selective_scan_fn, selective_scan_ref, ssm_branch_fn  # noqa: F401
