"""`vim-ds env`: versions, accelerator, scan backends and the norm kernel, like DeepSpeed's ds_report."""
from __future__ import annotations

import argparse
import json
import platform
import sys

# From package metadata: importing deepspeed just for its version would print its accelerator banner.
from importlib.metadata import PackageNotFoundError, version

import timm
import torch

import vim_ds
from vim_ds.ops import backends, rms_norm

from ..engine.run_info import accelerator
from ..runtime import env_vars


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    scan = backends.report()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        in_use = backends.get_backend(device).name
    except (ValueError, RuntimeError) as exc:
        in_use = f"error: {exc}"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "vim_ds": vim_ds.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "deepspeed": _version("deepspeed"),
        "timm": timm.__version__,
        "accelerator": accelerator(),
        "scan_backends": scan,
        "scan_backend_in_use": {str(device): in_use},
        "add_rms_norm": rms_norm.describe(),
    }


def format_report(info: dict) -> str:
    lines = ["vim_ds environment", "-" * 60]
    for key in ("python", "platform", "vim_ds", "torch", "torch_cuda", "torch_hip", "deepspeed", "timm",
                "accelerator"):
        lines.append(f"{key:<14} {info[key]}")
    lines.append("selective-scan backends:")
    for name, row in info["scan_backends"].items():
        state = f"[OK] {row['how']}" if row["available"] else f"[--] {row['reason']}"
        lines.append(f"  {name:<6} {state}")
    for device, name in info["scan_backend_in_use"].items():
        lines.append(f"in use on {device}: {name}")
    lines.append(f"residual add + RMSNorm: {info['add_rms_norm']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vim-ds env", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    refused = env_vars.refusal("vim-ds env")  # a VIM_DS_* variable it cannot read: one line, before anything starts
    if refused:
        return refused
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
