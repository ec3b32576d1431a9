"""vim_ds: Vision Mamba (Vim) training with DeepSpeed, on AMD Instinct and NVIDIA GPUs, and on CPU.

Importing the package registers the Vim models in timm's registry.
"""
__version__ = "0.1.0"

from .engine.versions import unsupported as _unsupported

# An unsupported torch may lack what the models and ops are built with (torch.library.custom_op): the package then
# imports without them, so that `vim-ds` and each rank can refuse it in one line (engine/versions.py).
if _unsupported() is None:
    from . import models  # noqa: F401  (registers the timm models)
    from .ops import selective_scan_fn, selective_scan_ref, ssm_branch_fn  # noqa: F401
