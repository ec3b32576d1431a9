"""The torch and DeepSpeed versions vim_ds runs on, checked before anything else starts.

An older torch lacks what the ops are registered with (``torch.library.custom_op`` came in 2.4), an older DeepSpeed
what the engine calls; such a run would stop with a traceback somewhere in its first minute. `vim-ds` (every
command) and each rank of a run (engine/run.py) refuse it first, in one line naming the version found and the range
supported. setup.py's install_requires holds the same minimums (tests/test_versions.py keeps the two in line).
The range tested, combination by combination, is docs/versions.md's table (tools/version_matrix.sh).
"""
from __future__ import annotations

import re
from importlib import metadata

import torch

MINIMUM = {"torch": (2, 4), "deepspeed": (0, 16)}
TESTED = {"torch": "2.4.1 to 2.14.1", "deepspeed": "0.16.9 to 0.19.8"}  # docs/versions.md


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "2.4.1+cu121" or "0.16.9", None when it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def patch_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as "0.17.6" or "0.18.3+abc" (patch 0 where it has none), None
    when it has no major and minor."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def problem(found: dict[str, str | None]) -> str | None:
    """The one-line refusal for the versions `found` ({"torch": "2.3.1", ...}; None: not installed), or None."""
    for name, minimum in MINIMUM.items():
        version = found.get(name)
        numbers = None if version is None else release(version)
        if numbers is not None and numbers < minimum:
            least = ".".join(map(str, minimum))
            return (f"{name} {version} is installed, and vim_ds supports {name} >= {least} (tested: "
                    f"{TESTED[name]}, docs/versions.md); install a {name} in that range")
    return None


def installed() -> dict[str, str | None]:
    """The versions installed: torch's as torch reports it (torch.__version__), DeepSpeed's from its package
    metadata (importing DeepSpeed takes seconds, and an old one may not import at all)."""
    try:
        deepspeed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        deepspeed = None
    return {"torch": str(torch.__version__), "deepspeed": deepspeed}


def unsupported() -> str | None:
    """problem(installed())."""
    return problem(installed())
