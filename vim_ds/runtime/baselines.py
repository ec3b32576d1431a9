"""PyTorch DDP and FSDP2 in place of the DeepSpeed engine: the baselines of `vim-ds zero-compare`.

`TorchEngine` (`DDPEngine`, `FSDPEngine`; config/training_engines.py registers them as --engine ddp and fsdp)
answers the calls the trainer makes on a DeepSpeed engine (forward, `backward`, `step`, `get_lr`,
`was_step_applied`, `get_global_grad_norm`, `train`/`eval`), so the trainer's data order, loss, metrics, evaluation
and memory accounting are the ones the ZeRO runs use; only the wrapping, backward and step differ:

ddp   `DistributedDataParallel` (gradients as views of its buckets, so they are held once)
fsdp  FSDP2 `fully_shard` on every block, then on the root, full sharding (`reshard_after_forward=True`): each
      rank holds dim-0 shards (DTensors) of the parameters, gradients and Adam states

The optimizer is torch's AdamW with the model's two parameter groups and the DeepSpeed config's lr, betas, eps,
weight decay and gradient clipping; the lr schedule is the trainer's. As DeepSpeed's engine does, `backward`
divides the loss by the accumulation steps, and a step whose gradient norm is not finite is not applied.

Precision: fp32 runs in fp32. bf16 keeps fp32 parameters and Adam states and runs the forward under
`torch.autocast(bf16)` (what DDP/FSDP users do, and what Mamba's authors recommend), unlike DeepSpeed's bf16 mode
(bf16 weights, fp32 masters): losses then agree with ZeRO only to bf16 precision. autocast-bf16 runs the same
way, and there DeepSpeed does too (its torch_autocast mode; it reduces nn.Linear/Conv gradients in bf16, these
baselines all gradients in fp32, so losses still agree only to bf16 precision). fp16 is refused.

Baselines are for measurement: they save no checkpoints and keep no EMA (the trainer refuses --resume,
--save-interval and --model-ema with them).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel


def precision_label(precision: str) -> str:
    """How a baseline runs a `--precision`: 'fp32', or fp32 parameters with bf16 autocast (named 'autocast-bf16'
    when that is what was asked for, since DeepSpeed then runs the same recipe)."""
    if precision in ("fp32", "autocast-bf16"):
        return precision
    if precision == "bf16":
        return "fp32+autocast-bf16"
    raise ValueError(f"the DDP/FSDP baselines run fp32, bf16 or autocast-bf16 (both: fp32 parameters, bf16 "
                     f"autocast), not {precision}")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class TorchEngine:
    """What the two baselines share; `DDPEngine` and `FSDPEngine` wrap the model and switch gradient sync."""
    is_torch_baseline = True  # what vim_ds.engine.memory.state_bytes dispatches on

    def __init__(self, model: torch.nn.Module, groups: list[dict], ds, device: torch.device, scheduler_factory):
        self.precision = precision_label(ds.precision)
        self.device, self.accum = device, ds.batch.accum
        params = ds.config.get("optimizer", {}).get("params", {})
        self.clip = float(ds.config.get("gradient_clipping") or 0.0)
        model = model.to(device)
        names = {id(p): n for n, p in model.named_parameters()}
        # FSDP replaces the Parameters
        group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        self.module, self.wrapped = model, self._wrap(model, device)
        by_name = dict(self.module.named_parameters())
        self.params = list(by_name.values())
        self.optimizer = torch.optim.AdamW(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [by_name[n] for n in gn]}
             for g, gn in zip(groups, group_names)],
            lr=params.get("lr", 1e-3), betas=tuple(params.get("betas", (0.9, 0.999))), eps=params.get("eps", 1e-8),
            weight_decay=params.get("weight_decay", 0.0))
        self.scheduler = scheduler_factory(self.optimizer)
        self.micro = 0
        self.applied = True
        self.grad_norm = None

    def _wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """What the forward calls."""
        raise NotImplementedError

    def _sync(self, on: bool):
        """Reduce the gradients in the next backward, or not."""
        raise NotImplementedError

    # -- what the trainer calls ---------------------------------------------------------------------------------

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float()
        if self.precision == "fp32":
            return self.wrapped(images)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return self.wrapped(images)

    def backward(self, loss: torch.Tensor):
        # reduce only on the accumulation boundary's backward
        self._sync(self.micro == self.accum - 1)
        (loss / self.accum).backward()

    def step(self):
        self.micro += 1
        if self.micro < self.accum:
            return
        self.micro = 0
        if self.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        self.grad_norm = float(norm)
        self.applied = math.isfinite(self.grad_norm)
        if self.applied:
            self.optimizer.step()
            self.scheduler.step()
        # zeroed, not freed: DDP's gradients are views of its buckets (held anyway), and the memory report reads
        # the gradients held between steps from the live tensors
        self.optimizer.zero_grad(set_to_none=False)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        return self.applied

    def get_global_grad_norm(self):
        return self.grad_norm

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()


class DDPEngine(TorchEngine):
    """`DistributedDataParallel` (gradients as views of its buckets); the bare model in a world of one."""

    def _wrap(self, model, device):
        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device],
                                       gradient_as_bucket_view=True) if _world() > 1 else model

    def _sync(self, on: bool):
        if self.wrapped is not self.module:
            self.wrapped.require_backward_grad_sync = on


class FSDPEngine(TorchEngine):
    """FSDP2 `fully_shard` on every block, then on the root, full sharding: the model itself, its Parameters
    replaced by DTensors of dim-0 shards."""

    def _wrap(self, model, device):
        # here, not at the top: torch.distributed.fsdp has fully_shard from torch 2.6 on (vim_ds supports 2.4), and
        # only --engine fsdp needs it
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (_world(),))
        for block in getattr(model, "layers", ()):
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        return model

    def _sync(self, on: bool):
        self.module.set_requires_gradient_sync(on)
