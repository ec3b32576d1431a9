"""The DeepSpeed configs that ship with vim_ds, by name: `--deepspeed_config zero2` as well as a path.

The repository's top-level `ds_configs/*.json` are the source. A wheel carries copies of them as package data in
`vim_ds/ds_configs/` (setup.py's build_py step puts them there); a source checkout or an editable install reads
the top-level folder itself. Either way `vim-ds configs` lists them and `vim-ds configs --write DIR` copies them
out to edit.
"""
from __future__ import annotations

import json
import os

# Used when `vim-ds train` is given no --deepspeed_config: ZeRO-2 partitions the optimizer states and the gradients
# (about 8x less optimizer memory per rank than plain data parallelism at 8 ranks) for the same communication volume
# as data parallelism (a reduce-scatter of the gradients plus an all-gather of the updated weights = one
# all-reduce; ZeRO paper, Rajbhandari et al. 2020, section 7), so it costs nothing in speed, while ZeRO-3 adds 50 %
# more traffic and offload moves the optimizer onto the CPU.
DEFAULT = "zero2"

_PACKAGED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")


def shipped_dir() -> str | None:
    """The folder that holds the shipped configs: the wheel's package data, else the source checkout's."""
    for folder in (_PACKAGED, _SOURCE):
        if os.path.isdir(folder) and any(name.endswith(".json") for name in os.listdir(folder)):
            return folder
    return None


def shipped() -> dict[str, str]:
    """name -> path of every shipped config, in name order."""
    folder = shipped_dir()
    if folder is None:
        return {}
    return {name[:-len(".json")]: os.path.join(folder, name)
            for name in sorted(os.listdir(folder)) if name.endswith(".json")}


def resolve(given: str) -> str:
    """The file `given` names: an existing path as it is, else a shipped config's name (`zero2`, `zero2.json` or
    `ds_configs/zero2.json` run outside the repository), else a ValueError that lists the shipped names."""
    if os.path.exists(given):
        return given
    configs = shipped()
    name = os.path.basename(given)
    name = name[:-len(".json")] if name.endswith(".json") else name
    looks_like_ours = os.path.dirname(given) in ("", "ds_configs")
    if looks_like_ours and name in configs:
        return configs[name]
    names = ", ".join(configs) or "none found"
    raise ValueError(f"DeepSpeed config not found: {given} is neither a file nor a shipped config name "
                     f"(shipped: {names}; `vim-ds configs` describes them)")


def describe(path: str) -> str:
    """One line from what the file holds: ZeRO stage, precision, offload."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    zero = config.get("zero_optimization") or {}
    parts = [f"ZeRO-{zero.get('stage', 0)}"]
    if (config.get("torch_autocast") or {}).get("enabled"):
        parts.append("autocast-bf16 (fp32 weights)")
    elif (config.get("bf16") or {}).get("enabled"):
        parts.append("bf16")
    elif (config.get("fp16") or {}).get("enabled"):
        parts.append("fp16 with loss scaling (GPU only)")
    else:
        parts.append("fp32")
    offloaded = [what for what in ("param", "optimizer")
                 if ((zero.get(f"offload_{what}") or {}).get("device") or "none") != "none"]
    if offloaded:
        parts.append(" and ".join({"param": "parameters", "optimizer": "optimizer states"}[w] for w in offloaded)
                     + " offloaded to the CPU")
    return ", ".join(parts)


# -- recipes: `vim-ds train --config NAME` ------------------------------------------------------------------------
# The published Vim runs as `vim-ds train` option files (YAML), in the recipes/ folder beside the JSON configs
# (ds_configs/recipes/ in a checkout, vim_ds/ds_configs/recipes/ in a wheel: setup.py copies them).
RECIPES = "recipes"


def recipes() -> dict[str, str]:
    """name -> path of every shipped recipe, in name order."""
    folder = shipped_dir()
    folder = os.path.join(folder, RECIPES) if folder else None
    if folder is None or not os.path.isdir(folder):
        return {}
    return {name[:-len(".yaml")]: os.path.join(folder, name)
            for name in sorted(os.listdir(folder)) if name.endswith(".yaml")}


def resolve_recipe(given: str) -> str:
    """The option file `given` names: an existing path as it is, else a shipped recipe's name (`vim_small_pretrain`
    or `vim_small_pretrain.yaml`), else a ValueError that lists the shipped names."""
    if os.path.isfile(given):
        return given
    found = recipes()
    name = given[:-len(".yaml")] if given.endswith(".yaml") else given
    if os.path.dirname(given) == "" and name in found:
        return found[name]
    names = ", ".join(found) or "none found"
    raise ValueError(f"--config {given}: neither a file nor a shipped recipe name (shipped: {names}; "
                     f"`vim-ds configs` describes them)")
