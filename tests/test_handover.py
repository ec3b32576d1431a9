"""The uint8 hand-over (issue 23, item 2): workers send uint8 images, the consuming process normalises and erases.

The reference is the float pipeline as it was before: `build_transform`'s whole timm transform (to float tensor,
Normalize, RandomErasing) run on the decoded image in one process, the steps up to Normalize with the generators
seeded from the sample seed, random erasing seeded from the sample's erase seed. The loader's batches must equal it
sample for sample (bit for bit: the normalisation does the same float operations in the same order), whatever the
worker count and batch split; controls show the comparison sees a dropped erasing and a doubled normalisation.
"""
from __future__ import annotations

import random

import torch

from data_options import dataset_config
from vim_ds.data import GlobalBatchSampler, build_dataset, build_transform
from vim_ds.data.datasets import erase_seed, seeded_rngs
from vim_ds.data.loader import LoaderConfig, build_loader

SEED = 5


def _config(folder):
    # a high erasing probability and two rectangles, so that most samples have erased pixels to compare
    return dataset_config(data_set="folder", data_path=folder, input_size=32, reprob=0.8, recount=2, seed=SEED)


def _workers(workers: int = 2) -> LoaderConfig:
    return LoaderConfig(num_workers=workers, data_timeout=60)


def _reference(dataset, config, key, *, erase=True, normalize_twice=False):
    """The old in-worker float pipeline for one (index, sample seed)."""
    steps = list(build_transform(config.transform, is_train=True).transforms)
    assert [type(s).__name__ for s in steps[-3:]] == ["MaybeToTensor", "Normalize", "RandomErasing"]
    index, seed = key
    with seeded_rngs(seed):
        image = dataset.loader(dataset.samples[index][0])
        for step in steps[:-1]:
            image = step(image)
        if normalize_twice:
            image = steps[-2](image)
    if erase:
        with seeded_rngs(erase_seed(seed)):
            image = steps[-1](image)
    return image


def _loaded(dataset, *, micro_batch, world_size, workers, steps=6):
    """{key: image} of the first `steps` optimizer steps, read by every rank's loader of that layout."""
    images = {}
    for rank in range(world_size):
        sampler = GlobalBatchSampler(len(dataset), micro_batch=micro_batch, accum_steps=1, rank=rank,
                                     world_size=world_size, seed=SEED, repeats=1)
        sampler.set_epoch(0)
        keys = list(sampler)[:steps]
        loader = build_loader(dataset, sampler, _workers(workers), "train", persistent=False)
        try:
            for batch_keys, (batch, _targets, ok) in zip(keys, loader):
                assert batch.dtype == torch.float32 and bool(ok.all())
                images.update(zip(batch_keys, batch))
        finally:
            loader.shutdown()
    return images


def test_workers_hand_over_uint8(digits):
    config = _config(digits)
    dataset, _ = build_dataset(config, is_train=True)
    assert dataset.finish is not None and dataset.finish.erasing is not None
    image, target, ok, seed = dataset.handover_item((3, 77))
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32) and seed == erase_seed(77)
    sampler = GlobalBatchSampler(len(dataset), micro_batch=4, accum_steps=1, rank=0, world_size=1, seed=1)
    loader = build_loader(dataset, sampler, _workers(), "train")
    try:
        raw = next(iter(loader._batches()))  # what crossed the process boundary
    finally:
        loader.shutdown()
    assert raw[0].dtype == torch.uint8 and raw[3].dtype == torch.int64 and len(raw) == 4
    val, _ = build_dataset(config, is_train=False)
    assert val.finish is not None and val.finish.erasing is None and val.handover_item(0)[0].dtype == torch.uint8


def test_batches_equal_the_float_pipeline_sample_for_sample_whatever_the_layout(digits):
    config = _config(digits)
    dataset, _ = build_dataset(config, is_train=True)
    layouts = [dict(micro_batch=8, world_size=1, workers=2), dict(micro_batch=4, world_size=2, workers=0)]
    first, second = (_loaded(dataset, **layout) for layout in layouts)
    assert first.keys() == second.keys() and len(first) == 48
    keys = sorted(first)
    reference = {key: _reference(dataset, config, key) for key in keys}
    for key in keys:
        assert torch.equal(first[key], reference[key]), key
        assert torch.equal(second[key], reference[key]), key
        assert torch.equal(dataset[key][0], reference[key]), key  # a single sample gets the same finish
    # controls: the reference without erasing, or normalised twice, is told apart
    erased = [key for key in keys if not torch.equal(first[key], _reference(dataset, config, key, erase=False))]
    assert len(erased) >= len(keys) // 2, "erasing at p = 0.8 should change most samples"
    assert not any(torch.equal(first[key], _reference(dataset, config, key, normalize_twice=True)) for key in keys)


def test_erasing_does_not_disturb_the_consuming_process_rngs(digits):
    """The consuming process's generators (Mixup, drop path are seeded after the batch, but other code may draw)
    are as they were after a batch has been finished."""
    config = _config(digits)
    dataset, _ = build_dataset(config, is_train=True)
    items = [dataset.handover_item((i, 100 + i)) for i in range(4)]
    images = torch.stack([item[0] for item in items])
    random.seed(9)
    torch.manual_seed(9)
    expected = random.random(), torch.rand(1)
    random.seed(9)
    torch.manual_seed(9)
    dataset.finish(images, [item[3] for item in items])
    assert (random.random(), torch.rand(1)) == expected


def test_workers_keep_freed_memory_through_mallopt():
    """`_worker_init` raises glibc's mmap and trim thresholds in the worker (a fresh interpreter here, so that the
    test process's own malloc settings stay as they are); glibc accepts both values."""
    import subprocess
    import sys

    code = ("import os; from vim_ds.data import loader; calls = []; "
            "loader._keep_freed_memory, keep = (lambda: calls.append(1) or keep()), loader._keep_freed_memory; "
            "loader._worker_init(False, os.getpid(), 0); print(calls, keep())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1]", "True"], out.stdout
