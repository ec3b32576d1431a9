"""vim_ds: Vision Mamba (Vim) training with DeepSpeed, on AMD Instinct and NVIDIA GPUs, and on CPU.

Importing the package registers the Vim models in timm's registry.
"""
__version__ = "0.1.0"

from . import models  # noqa: F401  (registers the timm models)
from .ops import selective_scan_fn, selective_scan_ref, ssm_branch_fn  # noqa: F401
