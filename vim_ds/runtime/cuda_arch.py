"""TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can read it.

GPU images for Hopper and Blackwell often set `TORCH_CUDA_ARCH_LIST=9.0a` (or `10.0f`): PyTorch's cpp_extension
accepts the family suffix, but DeepSpeed 0.19's builder parses each entry's minor as an integer and stops the run
inside `deepspeed.initialize`, when it JIT-builds FusedAdam, with "invalid literal for int() with base 10: '0a'"
(seen on an H200 on 2026-11-27). The ops DeepSpeed builds use no family-specific instructions, so a rank reads the
list without the suffixes and says so in one note."""
from __future__ import annotations

import re

VARIABLE = "TORCH_CUDA_ARCH_LIST"
# an entry like 9.0a, 10.0f or 9.0a+PTX: the letters after the minor are what DeepSpeed cannot parse
_SUFFIXED = re.compile(r"^(\d+\.\d+)[a-z]+(\+PTX)?$")


def without_family_suffixes(arch_list: str) -> str:
    """`arch_list` with each entry's family suffix dropped ("8.0;9.0a+PTX" -> "8.0;9.0+PTX"), in PyTorch's separators
    (";" or spaces); entries without one, and names such as "Hopper", are left as they are."""
    entries = arch_list.replace(";", " ").split()
    return ";".join(_SUFFIXED.sub(r"\1\2", entry) for entry in entries)


def readable_by_deepspeed(environ) -> str | None:
    """Rewrite `environ`'s TORCH_CUDA_ARCH_LIST so that DeepSpeed's JIT builder can parse it; the note to print when
    it changed, else None."""
    value = environ.get(VARIABLE)
    if not value or not any(_SUFFIXED.match(entry) for entry in value.replace(";", " ").split()):
        return None
    environ[VARIABLE] = without_family_suffixes(value)
    return (f"note: {VARIABLE}={value} read as {environ[VARIABLE]} for the ops DeepSpeed builds (its builder cannot "
            f"parse the family suffix)")
