"""Mixup/CutMix for batches in host memory: timm's `Mixup`, with its batch mode applied one image pair at a time.

timm mixes a whole batch at once (`x.flip(0)` copies the batch, then multiply and add over it): for a float32 batch
of 64 images at 224 px that is ~40 MB read and written three times, 0.5 ms per image on 2 cores of an AMD EPYC,
the largest cost left in the training process once the workers hand over uint8 images. Image i is mixed with
image n-1-i, so the pairs are independent: mixing each pair while it is in the CPU cache gives the same numbers
(the same float operations on the same values) with one pass over memory. The random draws, the box and the
targets are timm's own code (`_params_per_batch`, `cutmix_bbox_and_lam`, `mixup_target`); tensors on an
accelerator take timm's path unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from timm.data import Mixup
from timm.data.mixup import cutmix_bbox_and_lam


class PairwiseMixup(Mixup):
    """`timm.data.Mixup` whose batch mode (the default, `mode="batch"`) mixes a CPU batch pair by pair."""

    def _mix_batch(self, x):
        if x.device.type != "cpu":
            return super()._mix_batch(x)
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.:
            return 1.
        n = len(x)
        if use_cutmix:
            (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(x.shape, lam, ratio_minmax=self.cutmix_minmax,
                                                        correct_lam=self.correct_lam)
            for i in range(n // 2):  # swap the box between the pair
                a, b = x[i, :, yl:yh, xl:xh], x[n - 1 - i, :, yl:yh, xl:xh]
                saved = a.clone()
                a.copy_(b)
                b.copy_(saved)
        else:
            for i in range(n // 2):
                a, b = x[i], x[n - 1 - i]
                a_share, b_share = a * (1. - lam), b * (1. - lam)
                a.mul_(lam).add_(b_share)
                b.mul_(lam).add_(a_share)
        return lam


@dataclass(frozen=True)
class MixupConfig:
    """Mixup/CutMix as a run sets them; the fields are `vim-ds train`'s options of the same names (the engine fills
    every one from them: config/components.py), passed to timm's `Mixup` as the published main.py passes them."""

    mixup: float  # alpha; 0: off
    cutmix: float  # alpha; 0: off (unless cutmix_minmax is given)
    # (min, max) box area fraction: CutMix alone, whatever the alphas
    cutmix_minmax: Sequence[float] | None
    mixup_prob: float
    mixup_switch_prob: float
    mixup_mode: str
    smoothing: float  # label smoothing of the mixed targets

    @property
    def active(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0 or self.cutmix_minmax is not None


def build_mixup(config: MixupConfig, micro_batch: int, num_classes: int) -> PairwiseMixup | None:
    """The Mixup/CutMix of a run whose micro batches have `micro_batch` images of `num_classes` classes; None when
    both are off. Pairs are mixed within a micro batch, which must therefore be even."""
    if not config.active:
        return None
    if micro_batch % 2:
        raise ValueError(f"Mixup/CutMix mix pairs within a micro batch, which must be even (it is "
                         f"{micro_batch}); change --batch-size or pass --mixup 0 --cutmix 0")
    return PairwiseMixup(mixup_alpha=config.mixup, cutmix_alpha=config.cutmix, cutmix_minmax=config.cutmix_minmax,
                         prob=config.mixup_prob, switch_prob=config.mixup_switch_prob, mode=config.mixup_mode,
                         label_smoothing=config.smoothing, num_classes=num_classes)
