"""Checkpoint files: safe loading of user-supplied weights (published Vim files, converted DeepSpeed checkpoints)."""
from .files import CheckpointError, load_model_weights, load_weights_file

__all__ = ["CheckpointError", "load_model_weights", "load_weights_file"]
