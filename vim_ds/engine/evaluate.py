"""Distributed evaluation: top-1, top-5 and cross-entropy over the validation set, exact for any rank count.

Each rank scores a disjoint shard (no padding, no duplicates) and the sums are added across ranks. Images that
failed to decode (ok == 0) are left out of every sum and counted. Under ZeRO-3 every forward pass is a
collective, so ranks whose shard has fewer batches run blank batches until all ranks have run as many.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import distributed


@torch.no_grad()
def evaluate(forward, loader, device: torch.device, dtype: torch.dtype, input_shape: tuple) -> dict:
    correct1 = correct5 = loss_sum = count = bad = 0.0
    batches = len(loader)
    most = int(distributed.all_reduce_max([batches], device)[0])
    for images, targets, ok in loader:
        images = images.to(device, dtype, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        keep = ok.to(device, non_blocking=True).bool()
        logits = forward(images).float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top5 == targets[:, None]
        correct1 += (hit[:, 0] & keep).sum().item()
        correct5 += (hit.any(dim=1) & keep).sum().item()
        loss_sum += (F.cross_entropy(logits, targets, reduction="none") * keep).sum().item()
        count += keep.sum().item()
        bad += (~keep).sum().item()
    for _ in range(most - batches):
        forward(torch.zeros((1, *input_shape), device=device, dtype=dtype))
    correct1, correct5, loss_sum, count, bad = distributed.all_reduce_sum(
        [correct1, correct5, loss_sum, count, bad], device)
    n = max(count, 1.0)
    return {"acc1": 100.0 * correct1 / n, "acc5": 100.0 * correct5 / n, "loss": loss_sum / n,
            "images": int(count), "bad_images": int(bad)}
