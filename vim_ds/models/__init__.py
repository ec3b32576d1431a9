"""Vim models, registered in timm's registry on import (``timm.create_model("vim_tiny")`` after ``import vim_ds``)."""
from .vim import (ALIASES, VARIANTS, BiMambaMixer, Block, PatchEmbed, RMSNorm, VisionMamba, checkpoint_filter_fn,
                  load_state_dict_into, resample_pos_embed)
from .factory import DESCRIPTION_KEYS, ModelConfig, param_groups

__all__ = ["ALIASES", "VARIANTS", "BiMambaMixer", "Block", "PatchEmbed", "RMSNorm", "VisionMamba",
           "DESCRIPTION_KEYS", "ModelConfig", "checkpoint_filter_fn", "load_state_dict_into", "param_groups",
           "resample_pos_embed"]
