"""The GPU kernels' launches at small shapes, forward and backward, for NVIDIA's compute-sanitizer (tools/gpu_check.sh,
step `sanitize`: racecheck, synccheck and memcheck each run this program): the hardware's counterpart of the kernel
emulator's race check (tools/kernel_emu, `run.sh --races`), which ran the same paths without a GPU.

- the scan at d_state 1, 16, 24 and 33 (groups of 8, 16 and 32 lanes a channel, and two states a lane), 40 channels
  (several blocks of channels a row: the backward's dB, dC chain) and 197 steps (chunks, segments), both directions,
  fp32 and bf16;
- the scan from an initial state with the last state's gradient (the sequence split's op);
- a Vim mixer's two directions as the model calls them (the conv with its SiLU both ways, the second direction's
  output and the conv's dx added into the first's).

usage: python tools/gpu_sanitize.py [--device cpu]   (exit 0 when every call ran; the sanitizer's exit code says what
it found. --device cpu: the same calls on the CPU kernels, to check the program itself without a GPU)
"""
import argparse
import sys

import torch

from vim_ds.ops import selective_scan_fn, selective_scan_with_state
from vim_ds.ops.ssm_branch import bimamba_branch_fn


def inputs(batch, dim, seqlen, d_state, dtype, device):
    g = dict(device=device, dtype=dtype)
    u, delta, z = (torch.randn(batch, dim, seqlen, **g) for _ in range(3))
    B, C = (torch.randn(batch, d_state, seqlen, **g) for _ in range(2))
    A = -torch.exp(0.5 * torch.randn(dim, d_state, device=device))
    D, bias = torch.randn(dim, device=device), 0.5 * torch.randn(dim, device=device)
    return [t.requires_grad_() for t in (u, 0.5 * delta, A, B, C, D, z, bias)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    dev = torch.device(parser.parse_args(argv).device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_sanitize: no GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    launches = 0
    for dtype in (torch.float32, torch.bfloat16):
        for d_state in (1, 16, 24, 33):
            for reverse in (False, True):
                u, delta, A, B, C, D, z, bias = inputs(2, 40, 197, d_state, dtype, dev)
                out = selective_scan_fn(u, delta, A, B, C, D, z, bias, delta_softplus=True, reverse=reverse)
                out.float().square().sum().backward()
                launches += 1
    u, delta, A, B, C, D, z, bias = inputs(2, 40, 197, 16, torch.float32, dev)
    h0 = torch.randn(2, 40, 16, device=dev).requires_grad_()
    out, last = selective_scan_with_state(u, delta, A, B, C, D, z, bias, delta_softplus=True, h0=h0)
    (out.square().sum() + last.square().sum()).backward()
    launches += 1
    d_inner, d_state, dt_rank, width = 48, 16, 4, 4

    def direction():
        return [torch.randn(d_inner, 1, width, device=dev) * 0.3, torch.randn(d_inner, device=dev),
                torch.randn(dt_rank + 2 * d_state, d_inner, device=dev) * 0.1,
                torch.randn(d_inner, dt_rank, device=dev) * 0.3,
                -torch.exp(0.5 * torch.randn(d_inner, d_state, device=dev)), torch.randn(d_inner, device=dev),
                0.5 * torch.randn(d_inner, device=dev)]

    for dtype in (torch.float32, torch.bfloat16):
        x, z = (torch.randn(2, d_inner, 197, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
        weights = [[w.requires_grad_() for w in direction()] for _ in range(2)]
        bimamba_branch_fn(x, z, weights[0], weights[1]).float().square().sum().backward()
        launches += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "the CPU"
    print(f"gpu_sanitize: {launches} forward and backward calls ran on {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
