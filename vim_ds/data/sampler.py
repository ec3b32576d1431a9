"""Batch samplers that make training independent of how a global batch is split over ranks and micro steps.

The training sampler lays out one epoch as a single sequence of positions 0, 1, 2, ... and gives every position an
image index *and* a sample seed (for its augmentation, see `datasets.seeded_rngs`). Optimizer step s always
consumes positions [s*G, (s+1)*G) where G = micro_batch × accum_steps × world_size; only who reads which position
changes with the split. So 2 ranks × 1 accumulation step, 1 rank × 2 accumulation steps or 4 ranks with half the
micro batch see the same images with the same augmentations at every optimizer step, and a run resumed mid-epoch
(`set_epoch(epoch, start_step)`) replays exactly the rest of the epoch.
"""
from __future__ import annotations

import torch
from torch.utils.data import Sampler

from .datasets import DataError, derive_seed


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The 63-bit augmentation seed of one position of one epoch."""
    return derive_seed("sample", int(seed), int(epoch), int(position))


def _positive(**values) -> None:
    for name, value in values.items():
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


class GlobalBatchSampler(Sampler):
    """Training batch sampler (pass as `DataLoader(batch_sampler=...)`); yields this rank's micro batches as lists
    of `(index, sample_seed)` keys, step-major then micro-step, `micro_batch` keys each.

    Epoch order: a permutation seeded by (seed, epoch) (identity when `shuffle=False`). With `repeats` > 1 (DeiT's
    repeated augmentation) each index is repeated `repeats` times in a row and the result cut back to
    `num_samples`, so an epoch has as many samples whatever the rank count. Ranks are interleaved within a micro
    step (rank r reads positions r, r + world, ...), which puts the repeats of one image on different ranks, where
    they get different augmentations. The last partial global batch is dropped.
    """

    def __init__(self, num_samples: int, *, micro_batch: int, accum_steps: int, rank: int, world_size: int,
                 seed: int, repeats: int = 3, shuffle: bool = True):
        _positive(micro_batch=micro_batch, accum_steps=accum_steps, world_size=world_size, repeats=repeats)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.num_samples, self.micro_batch, self.accum_steps = int(num_samples), int(micro_batch), int(accum_steps)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.repeats, self.shuffle = int(repeats), bool(shuffle)
        self.global_batch = self.micro_batch * self.accum_steps * self.world_size
        self.steps_per_epoch = self.num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training set has {self.num_samples} images, fewer than one global batch of "
                f"{self.global_batch} (micro batch {self.micro_batch} × accumulation {self.accum_steps} × "
                f"{self.world_size} ranks); lower --batch-size or the gradient accumulation steps, use fewer ranks, "
                f"or use more data")
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration yields optimizer steps start_step .. steps_per_epoch - 1 of `epoch`. Call it before
        every epoch (the setting stays until the next call, as with DistributedSampler)."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step {start_step} is outside 0..{self.steps_per_epoch} (steps per epoch)")
        self.epoch, self.start_step = int(epoch), int(start_step)

    def epoch_order(self) -> torch.Tensor:
        """The image index at every position of the current epoch (`num_samples` entries)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed("order", self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)[: self.num_samples]
        return order

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accum_steps

    def __iter__(self):
        order = self.epoch_order().tolist()
        per_micro_step = self.micro_batch * self.world_size
        for step in range(self.start_step, self.steps_per_epoch):
            for micro in range(self.accum_steps):
                first = step * self.global_batch + micro * per_micro_step + self.rank
                yield [(order[p], sample_seed(self.seed, self.epoch, p))
                       for p in range(first, first + per_micro_step, self.world_size)]


class ShardedEvalSampler(Sampler):
    """Evaluation batch sampler: rank r reads indices r, r + world, r + 2·world, ... in batches of `batch_size`.

    No padding and no duplicates (unlike DistributedSampler), so metrics summed over ranks are exact for any rank
    count. Ranks may get one batch more or less than others (none at all when there are fewer images than ranks),
    so collectives must come after the loop, not inside it.
    """

    def __init__(self, num_samples: int, *, batch_size: int, rank: int, world_size: int):
        _positive(batch_size=batch_size, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.indices = list(range(int(rank), int(num_samples), int(world_size)))
        self.batch_size = int(batch_size)

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.indices), self.batch_size):
            yield self.indices[start:start + self.batch_size]
