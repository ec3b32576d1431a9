"""Exponential moving average of the weights that works under every ZeRO stage, ZeRO-3 included.

Each rank keeps the average of the parameter storage it owns: the whole parameter under ZeRO 0/1/2, its own
partition (`param.ds_tensor`) under ZeRO-3, so the EMA costs what the parameters cost and needs no communication
per step. The full averaged weights are gathered only to save them or to evaluate them (in a plain replica of
the model, so the engine's ZeRO-3 parameter tracing is never disturbed).

The average follows the engine's parameters (bf16 under bf16 training, as timm's EMA follows the AMP model) and
is accumulated in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    """The storage this rank updates: the ZeRO-3 partition, or the parameter itself."""
    return p.ds_tensor.data if hasattr(p, "ds_tensor") else p.data


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ShardedEMA:
    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        named = [(n, p) for n, p in module.named_parameters()]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.zero3 = any(hasattr(p, "ds_tensor") for p in self.params)
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self):
        current = [_local(p).float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    # -- full weights -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights as a plain fp32 state dict on CPU (a collective under ZeRO-3: call it on all ranks)."""
        if not self.zero3:
            return {n: s.detach().cpu().clone() for n, s in zip(self.names, self.shadow)}
        _, world = _world()
        flat = torch.cat([s.reshape(-1) for s in self.shadow])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        per_rank = [torch.split(g, [s.numel() for s in self.shadow]) for g in gathered]
        out = {}
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            full = torch.cat([chunks[i] for chunks in per_rank])[:p.ds_numel]
            out[name] = full.view(p.ds_shape).cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]):
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"EMA state lacks {len(missing)} parameters, e.g. {missing[0]}")
        rank, _ = _world()
        for name, p, shadow in zip(self.names, self.params, self.shadow):
            full = state[name].to(shadow.device, torch.float32).reshape(-1)
            if self.zero3:
                size = shadow.numel()
                part = full[rank * size:(rank + 1) * size]
                shadow.zero_()
                shadow[:part.numel()].copy_(part)
            else:
                shadow.copy_(full.view_as(shadow))
