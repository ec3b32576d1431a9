"""`vim-ds demo`: build a published Vim, check its kernel against the reference, run it forward and backward.

A first thing to run on a fresh machine: it shows which scan backend is in use, that it agrees with the
pure-PyTorch reference, and how long a Vim training step takes here.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import vim_ds
from vim_ds.engine.run_info import accelerator
from vim_ds.models import ModelConfig
from vim_ds.ops import backends
from vim_ds.ops.selective_scan import scan_with_backend
from vim_ds.runtime import env_vars


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vim-ds demo", description=__doc__)
    parser.add_argument("--model", default="vim_tiny", help="a Vim name or alias (default: vim_tiny)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--input-size", type=int, default=224)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    refused = env_vars.refusal("vim-ds demo")  # a VIM_DS_* variable it cannot read: one line, before anything starts
    if refused:
        return refused

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = backends.get_backend(device)
    print(f"vim_ds {vim_ds.__version__} | torch {torch.__version__} | {accelerator()}")
    print(f"selective-scan backend on {device.type}: {backend.name}")

    # 1. the kernel in use agrees with the float64 reference at a small shape
    torch.manual_seed(0)
    g = dict(device=device, dtype=torch.float64)
    u, delta, z = (torch.randn(2, 8, 33, **g) for _ in range(3))
    A = -torch.rand(8, 16, **g) - 0.5
    B, C = torch.randn(2, 16, 33, **g), torch.randn(2, 16, 33, **g)
    D, bias = torch.randn(8, **g), torch.randn(8, **g)
    got = scan_with_backend(backend, u, delta, A, B, C, D, z, bias, True)
    want = vim_ds.selective_scan_ref(u, delta, A, B, C, D, z, bias, True)
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{backend.name} kernel vs float64 reference: max relative error {err:.1e}")
    if err > 1e-9:
        print("ERROR: the scan kernel disagrees with the reference", file=sys.stderr)
        return 1

    # 2. the published model, forward and backward
    # as published: ImageNet's 1000 classes, the architecture's own dropout and stochastic depth
    model = ModelConfig(args.model, 1000, args.input_size, drop=None, drop_path=None).build().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{model.pretrained_cfg['architecture']}: {n_params / 1e6:.1f}M parameters, "
          f"{len(model.layers)} blocks, class token at position {model.token_position}")
    x = torch.randn(args.batch_size, 3, args.input_size, args.input_size, device=device)
    target = torch.randint(0, model.num_classes, (args.batch_size,), device=device)
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"forward+backward of {args.batch_size} images at {args.input_size}^2: loss {loss.item():.3f}, "
          f"{time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
