"""The ranks' layout under `--sequence-parallel N`: groups of N consecutive ranks share each image's token sequence
(models/sequence_parallel.py), data parallelism runs across the groups, and ZeRO partitions and averages over all
ranks.

What DeepSpeed sees. The split keeps every parameter replicated on the ranks of a group, and each rank's gradient is
its share of the image's: the shares of a group's N ranks, each back-propagating the same loss from the same logits,
add up to N times the image's gradient. DeepSpeed is therefore given the job as plain data parallelism over all W
ranks (no `mpu`): it partitions ZeRO states over the W ranks and divides the gradients' sum by W, which is the sum
over the W / N groups of N times each group's gradient, divided by W: the data-parallel average, in every ZeRO stage,
offload and precision, as without the split. Only its batch count sees W ranks: its `train_batch_size` is N times
the images of an optimizer step (`deepspeed_batch`); the sampler, the schedule and the metrics count images.

DeepSpeed's own sequence-parallel groups (`parallel_state_sp`, the `mpu` of its Ulysses attention) were tried first
and are not used (DeepSpeed 0.19.8, measured 2026-11-27): ZeRO-3's default reduce-scatter divides by W while ZeRO
0-2 divide by W / N (its `__avg_scatter_grads` leaves sequence_parallel_size out: a 2 x 2 split then had half the
first Adam moment of 2 data-parallel ranks); its checkpoints record N as the tensor-parallel degree, so
`ds_to_universal` refuses them ("model-state file count 1 does not match pp_degree=1 * tp_degree=2": no resume on
another rank count, no `vim-ds convert --universal`); and loading a universal checkpoint asks that mpu for
`get_tensor_model_parallel_world_size`, which it lacks. Ulysses needs those groups because it splits attention heads;
Vim's split shares no parameter between ranks, so it needs none of them.

Everything that counts images uses the data-parallel coordinates: the sampler (a group's ranks read the same images),
the global batch (micro x accumulation x W / N), the random draws (Mixup, stochastic depth: seeded per data rank, so
the ranks of a group draw alike), and the evaluation's sums (each image counted once, by the group's first rank)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..models.sequence_parallel import split_over


@dataclass(frozen=True)
class SequenceGroups:
    size: int          # N, ranks per sequence group
    rank: int          # this rank's position in its group (which chunk of the tokens it holds)
    data_rank: int     # its group's index: the data-parallel rank
    data_world: int    # the number of groups: the data-parallel world size
    group: object = None  # the torch process group of this rank's sequence group (None when N == 1)

    @property
    def counts_images(self) -> bool:
        """Whether this rank adds its images to the sums over ranks (one rank per group)."""
        return self.rank == 0

    def split(self, model):
        """`model` (a VisionMamba) made to run the split over this rank's group when N > 1 (its calls, not its
        weights, change: `models.sequence_parallel.split_over`); returns it."""
        if self.size > 1:
            split_over(model, self.group)
        return model

    def deepspeed_batch(self, images_per_step: int) -> int:
        """DeepSpeed's `train_batch_size` for an optimizer step of `images_per_step` images: it counts every rank
        as data-parallel (see above)."""
        return images_per_step * self.size


def world_error(size: int, world: int) -> str | None:
    """The one-line refusal of a world size that --sequence-parallel does not divide, else None."""
    if size > 1 and world % size:
        return (f"--sequence-parallel {size} needs a number of ranks that {size} divides (groups of {size} "
                f"consecutive ranks share each image); this job has {world}")
    return None


def build(size: int, rank: int, world: int) -> SequenceGroups:
    """The groups of `size` consecutive ranks (a collective when size > 1: every rank calls it at the same point,
    and creates every group, as torch.distributed.new_group requires)."""
    problem = world_error(size, world)
    if problem:
        raise ValueError(problem)
    if size == 1:
        return SequenceGroups(1, 0, rank, world)

    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceGroups(size, rank % size, rank // size, world // size, mine)
