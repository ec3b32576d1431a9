"""The Vim/DeiT optimisation recipe: batch-scaled learning rate, per-step warmup + cosine.

DeepSpeed builds the optimizer from the JSON's "optimizer" section (so offload picks its CPU Adam); we hand it the
parameter groups (`vim_ds.models.param_groups`: which parameters take weight decay is a fact about the model, also
needed to read checkpoints) and a scheduler, which it steps once per optimizer step and saves in its checkpoints.
"""
from __future__ import annotations


def scaled_lr(base_lr: float, global_batch: int, unscale: bool = False) -> float:
    """DeiT's linear scaling rule: the lr given on the command line is for a global batch of 512."""
    return base_lr if unscale else base_lr * global_batch / 512.0


class PerStepScheduler:
    """timm's cosine schedule with linear warmup (the one DeiT and Vim use), advanced once per optimizer step.

    DeepSpeed calls `step()` after every optimizer step and saves `state_dict()` with its checkpoints; timm's
    scheduler is driven by `step_update(num_updates)`. This adapter connects the two.
    """

    def __init__(self, optimizer, *, total_steps: int, warmup_steps: int, warmup_lr: float, min_lr: float):
        from timm.scheduler import CosineLRScheduler

        self.optimizer = optimizer
        self.num_updates = 0
        self.schedule = CosineLRScheduler(optimizer, t_initial=max(total_steps, 1), lr_min=min_lr,
                                          warmup_t=warmup_steps, warmup_lr_init=warmup_lr, t_in_epochs=False)
        self.schedule.step_update(0)

    def step(self, **_):
        self.num_updates += 1
        self.schedule.step_update(self.num_updates)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates}

    def load_state_dict(self, state: dict):
        self.num_updates = int(state["num_updates"])
        self.schedule.step_update(self.num_updates)


def ds_auto_values(args, batch) -> dict:
    """The command line's values for a DeepSpeed config's "auto" entries ({dotted.path: value}), the lr scaled to
    the resolved global batch (`batch`: ds_config.BatchSizes)."""
    return {"optimizer.params.lr": scaled_lr(args.lr, batch.global_, args.unscale_lr),
            "optimizer.params.weight_decay": args.weight_decay, "optimizer.params.betas": list(args.opt_betas),
            "optimizer.params.eps": args.opt_eps, "gradient_clipping": args.clip_grad or 0.0}
