"""`vim-ds bench data`: the input pipeline alone, ours against timm's loader, on a folder of real JPEGs.

What is measured, for the training pipeline and for the evaluation pipeline:

* **Loader throughput** for each `--workers` count: batches from the real loader, as the trainer builds it
  (`build_dataset` + `build_transform` from `vim-ds train`'s own options, `GlobalBatchSampler`, `build_loader`'s
  fork-server workers handing over uint8 images, normalisation and per-sample-seeded random erasing in the
  training process as the loader does them, then Mixup there, seeded per step as the trainer seeds it), and from
  `timm.data.create_loader` with its defaults (prefetcher on: uint8 batches, normalisation and random erasing in
  the consuming process; Mixup in the workers through `FastCollateMixup`, as timm's train.py sets it up) with the
  same transform arguments, batch size and worker count. The two run back to back in alternating order, once per
  round, so that a busy machine slows both alike. Reported: images/s (wall clock), and images per CPU-second of
  all the pipeline's processes (workers and the consuming process, read from /proc), i.e. the images/s one core
  sustains when it does nothing else. The per-core figure does not depend on how many cores other programs leave
  free, which is why the summary line uses it.
* **Where the time goes**, in one process with one thread (as a worker runs), on `--sample` images: each sample
  decoded, then each step of the transform timed on its own (resize/crop, RandAugment, tensor conversion and
  normalisation, random erasing), then collation and Mixup per batch, and for ours the per-sample seeding; CPU
  time. The same samples are also run untimed step by step (`dataset[key]`, the real collate and Mixup), which
  checks that the stages add up. The inter-process transfer (workers -> training process: shared memory, pickling,
  the queues) is what the loader's CPU time per image adds to that in-process time.

The batches reach the training process's memory; a host-to-device copy is not part of this benchmark.
"""
from __future__ import annotations

import collections
import copy
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import PIL
import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, FastCollateMixup, ImageDataset, create_loader
from timm.data.loader import fast_collate
from torch.utils.data import default_collate

from ...config.components import dataset_config
from ...config.ds_config import DEFAULT_MICRO_BATCH, BatchSizes, eval_batch_size
from ...config.run_config import RunConfig
from ...data import build_dataset
from ...data.datasets import _checked_split, derive_seed, erase_seed, seeded_rngs
from ...data.images import open_rgb
from ...data.loader import LoaderConfig, build_loader, stop_workers
from ...data.shards import check_shards, write_shards
from ...data.transforms import _auto_augment
from ...engine.evaluate import eval_sampler
from ...engine.parts import build_mixup, train_sampler
from ...engine.run_info import cpu_name
from ...engine.trainer import seed_everything
from ...runtime import sequence_groups
from ..run_options import parse_args

PROG = "vim-ds bench data"
STAGES = ("seeding", "decode", "resize_crop", "augment", "to_tensor_normalize", "random_erasing", "collate",
          "mixup")
STAGE_LABELS = {"seeding": "per-sample seeding", "decode": "decode (JPEG -> RGB)", "resize_crop": "resize/crop/flip",
                "augment": "RandAugment", "to_tensor_normalize": "to tensor + normalise",
                "random_erasing": "random erasing", "collate": "collate", "mixup": "Mixup/CutMix",
                "transfer": "inter-process transfer"}
_AUGMENT = {"RandAugment", "AutoAugment", "AugMixAugment", "ColorJitter", "RandomGrayscale", "GaussianBlur"}
_TENSOR = {"ToTensor", "MaybeToTensor", "PILToTensor", "MaybePILToTensor", "ToNumpy", "Normalize",
           "ConvertImageDtype", "ToDtype"}


class BenchError(ValueError):
    """Bad input for the benchmark: one line."""


def timed_steps(steps, image, times: dict, start: float):
    """Apply the transform steps in turn, adding each one's CPU time (from `start`) to its stage in `times`."""
    for step in steps:
        image = step(image)
        now = time.process_time()
        times[stage_of(step)] += now - start
        start = now
    return image


def stage_of(step) -> str:
    """The stage a transform step belongs to, by its class."""
    name = type(step).__name__
    if name in _AUGMENT:
        return "augment"
    if name in _TENSOR:
        return "to_tensor_normalize"
    if name == "RandomErasing":
        return "random_erasing"
    return "resize_crop"  # RandomResizedCrop*, Resize, CenterCrop, flips


def transform_steps(transform) -> list:
    return list(getattr(transform, "transforms", [transform]))


# -- CPU time of a set of processes ------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (all its threads) from /proc, or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of proc(5))


def cpu_seconds(pids) -> tuple[float, float | None]:
    """(CPU time of this process, that of the processes `pids` together, or None when one cannot be read)."""
    workers = 0.0
    for pid in pids:
        t = process_cpu_seconds(pid)
        if t is None:
            return time.process_time(), None
        workers += t
    return time.process_time(), workers


# -- the two pipelines -------------------------------------------------------------------------------------------

class VimDsPipeline:
    """The trainer's pipeline: its dataset, sampler and Mixup from the builders of a training run (engine/parts.py),
    one rank, no gradient accumulation."""

    name = "vim_ds"

    def __init__(self, train_args, is_train: bool, batch_size: int):
        self.args, self.is_train = train_args, is_train
        config = RunConfig.from_dict(vars(train_args))
        # the one split measured (a run's parts.build_datasets reads both)
        self.dataset, num_classes = build_dataset(dataset_config(config), is_train=is_train)
        self.dataset.restore_rngs = False  # the in-process passes seed samples as a worker does
        batch, one_rank = BatchSizes(batch_size, 1, 1), sequence_groups.build(1, 0, 1)
        if is_train:
            self.sampler = train_sampler(config, len(self.dataset), batch, one_rank)
            self.mixup = build_mixup(config, batch, num_classes)
            self.batch_size = batch_size
        else:
            self.sampler = eval_sampler(self.dataset, batch_size, one_rank)
            self.mixup = None
            self.batch_size = self.sampler.batch_size  # the trainer's eval batch
        self.steps = transform_steps(self.dataset.transform)
        # normalise + erase after the uint8 hand-over
        self.finish = getattr(self.dataset, "finish", None)
        self.where = {"mixup": "training process"}
        if self.finish is not None:
            self.where.update(to_tensor_normalize="training process (normalise) + worker (to uint8 tensor)",
                              random_erasing="training process")

    # loader
    def make_loader(self, workers: int):
        return build_loader(self.dataset, self.sampler, LoaderConfig(num_workers=workers, data_timeout=0),
                            "train" if self.is_train else "val", persistent=True)

    def batches(self, loader):
        epoch, step = 0, 0
        while True:
            if self.is_train:
                self.sampler.set_epoch(epoch)
            for images, targets, _ok in loader:  # the loader has applied the finish
                images = self.mix(images, targets, step)
                step += 1
                yield images
            epoch += 1

    @staticmethod
    def iterator(loader):
        return getattr(loader, "_iterator", None)

    def in_training_process(self) -> list:
        """The transform steps that run after the hand-over (besides Mixup)."""
        if self.finish is None:
            return []
        return ["Normalize"] + (["RandomErasing"] if self.finish.erasing is not None else [])

    def close(self, loader):
        loader.shutdown()

    # in-process pieces
    def keys(self, n: int) -> list:
        if self.is_train:
            self.sampler.set_epoch(0)
            keys = [key for batch in self.sampler for key in batch]
            return [keys[i % len(keys)] for i in range(n)]
        return spread(len(self.dataset), n)

    def fetch_split(self, key, times: dict):
        index, seed = key if isinstance(key, tuple) else (key, None)
        # as in a worker: seeded without saving and restoring the generators (see SeededDataset._load_seeded)
        seeding = seeded_rngs(seed, restore=False) if seed is not None else None
        t0 = time.process_time()
        if seeding is not None:
            seeding.__enter__()
        t1 = time.process_time()
        if seeding is None:
            t0 = t1
        try:
            path, target = self.dataset.samples[index]
            image = self.dataset.loader(path)
            t2 = time.process_time()
            times["decode"] += t2 - t1
            image = timed_steps(self.steps, image, times, t2)
        finally:
            t4 = time.process_time()
            if seeding is not None:
                seeding.__exit__(None, None, None)
            if seeding is not None:
                times["seeding"] += (t1 - t0) + (time.process_time() - t4)
        if self.finish is None:
            return image, target, 1
        if seed is None:
            return image, target, 1, erase_seed(None)
        t5 = time.process_time()
        erase = erase_seed(seed)
        times["seeding"] += time.process_time() - t5
        return image, target, 1, erase

    def fetch_whole(self, key):
        return self.dataset.handover_item(key) if self.finish is not None else self.dataset[key]

    def collate(self, samples):
        return default_collate(samples)

    def post_split(self, batch, step: int, times: dict):
        images, targets = batch[:2]
        if self.finish is not None:  # as the Loader does after the hand-over
            t0 = time.process_time()
            images = self.finish.normalize(images)
            t1 = time.process_time()
            times["to_tensor_normalize"] += t1 - t0
            if self.finish.erasing is not None:
                self.finish.erase(images, batch[3].tolist())
                times["random_erasing"] += time.process_time() - t1
        if self.mixup is not None:
            t0 = time.process_time()
            self.mix(images, targets, step)
            times["mixup"] += time.process_time() - t0

    def post_whole(self, batch, step: int):
        images, targets = batch[:2]
        if self.finish is not None:
            images = self.finish(images, batch[3].tolist())
        return self.mix(images, targets, step)

    def mix(self, images, targets, step: int):
        # as Trainer._micro_step: seeded per (seed, step, micro step, rank)
        if self.mixup is not None:
            seed_everything(derive_seed(self.args.seed, step, 0, 0))
            images, targets = self.mixup(images, targets)
        return images


class TimmPipeline:
    """`timm.data.create_loader` with its defaults and the same transform arguments; Mixup as timm's train.py
    passes it with the prefetcher (`FastCollateMixup` as the collate function)."""

    name = "timm"

    def __init__(self, train_args, is_train: bool, batch_size: int):
        a = train_args
        self.is_train = is_train
        self.batch_size = batch_size if is_train else eval_batch_size(batch_size)  # the trainer's batches
        self.root = os.path.join(a.data_path, "train" if is_train else "val")
        self.dataset = ImageDataset(self.root)
        mixup = is_train and (a.mixup > 0 or a.cutmix > 0 or a.cutmix_minmax is not None)
        self.collate_fn = FastCollateMixup(
            mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, cutmix_minmax=a.cutmix_minmax, prob=a.mixup_prob,
            switch_prob=a.mixup_switch_prob, mode=a.mixup_mode, label_smoothing=a.smoothing,
            num_classes=len(self.dataset.reader.class_to_idx)) if mixup else None
        size = int(a.input_size)
        if is_train:
            self.kwargs = dict(is_training=True, scale=tuple(a.scale), ratio=tuple(a.ratio), hflip=a.hflip,
                               color_jitter=a.color_jitter, auto_augment=_auto_augment(a.aa),
                               interpolation=a.train_interpolation, re_prob=a.reprob, re_mode=a.remode,
                               re_count=a.recount)
        else:
            self.kwargs = dict(is_training=False, interpolation="bicubic", crop_pct=a.eval_crop_ratio)
        self.kwargs.update(input_size=(3, size, size), batch_size=self.batch_size, mean=IMAGENET_DEFAULT_MEAN,
                           std=IMAGENET_DEFAULT_STD, collate_fn=self.collate_fn, device=torch.device("cpu"))
        # the transform and prefetcher create_loader builds, for the in-process part
        probe = self.make_loader(0)
        self.prefetcher = probe
        self.steps = transform_steps(self.dataset.transform)
        self.where = {"to_tensor_normalize": "training process (normalise) + worker (to uint8 tensor)",
                      "random_erasing": "training process", "mixup": "worker (in the collate)"}

    def make_loader(self, workers: int):
        return create_loader(self.dataset, num_workers=workers, **self.kwargs)

    @staticmethod
    def batches(loader):
        while True:
            for images, _targets in loader:
                yield images

    @staticmethod
    def iterator(loader):
        return getattr(loader.loader, "_iterator", None)

    def in_training_process(self) -> list:
        pf = self.prefetcher
        return ["Normalize"] + (["RandomErasing"] if getattr(pf, "random_erasing", None) is not None else [])

    def close(self, loader):
        stop_workers(self.iterator(loader))
        loader.loader._iterator = None

    def keys(self, n: int) -> list:
        return spread(len(self.dataset), n)

    def fetch_split(self, key, times: dict):
        path, target = self.dataset.reader[key][:2]
        t0 = time.process_time()
        image = open_rgb(path)
        t1 = time.process_time()
        times["decode"] += t1 - t0
        return timed_steps(self.steps, image, times, t1), target

    def fetch_whole(self, key):
        return self.dataset[key]

    def collate(self, samples):
        return (self.collate_fn or _fast_collate)(samples)

    def post_split(self, batch, step: int, times: dict):
        pf = self.prefetcher
        t0 = time.process_time()
        images = batch[0].to(pf.img_dtype).sub_(pf.mean).div_(pf.std)
        t1 = time.process_time()
        times["to_tensor_normalize"] += t1 - t0
        if pf.random_erasing is not None:
            pf.random_erasing(images)
            times["random_erasing"] += time.process_time() - t1

    def post_whole(self, batch, step: int):
        pf = copy.copy(self.prefetcher)  # the real PrefetchLoader code over one batch
        pf.loader = [batch]
        return next(iter(pf))[0]


def spread(size: int, n: int) -> list:
    """n indices spread evenly over a data set of `size` (every class folder, not the first few)."""
    return [(i * size) // n if n <= size else i % size for i in range(n)]


def _fast_collate(samples):
    return fast_collate(samples)


# -- measurements ------------------------------------------------------------------------------------------------

def measure_loader(pipe, workers: int, batches: int, warmup: int) -> dict:
    """Images/s and images per CPU-second of `batches` batches after `warmup` (worker start-up excluded)."""
    loader = pipe.make_loader(workers)
    stream = pipe.batches(loader)
    try:
        for _ in range(warmup):
            next(stream)
        iterator = pipe.iterator(loader)
        pids = [w.pid for w in getattr(iterator, "_workers", [])]
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        images = 0
        for _ in range(batches):
            images += int(next(stream).shape[0])
        seconds, cpu1 = time.perf_counter() - t0, cpu_seconds(pids)
    finally:
        stream.close()
        pipe.close(loader)
    own = cpu1[0] - cpu0[0]
    workers_cpu = cpu1[1] - cpu0[1] if cpu0[1] is not None and cpu1[1] is not None else None
    cpu = own + workers_cpu if workers_cpu is not None else None
    return {"pipeline": pipe.name, "workers": workers, "worker_processes": len(pids), "images": images,
            "seconds": seconds,
            "images_per_sec": images / seconds, "images_per_sec_per_worker": images / seconds / max(1, workers),
            "cpu_seconds": cpu, "images_per_cpu_second": images / cpu if cpu else None,
            "cpu_ms_per_image_workers": 1e3 * workers_cpu / images if workers_cpu is not None else None,
            "cpu_ms_per_image_training_process": 1e3 * own / images}


def measure_in_process(pipe, sample: int, keys=None, offset: int = 0) -> dict:
    """Stage times per image (ms of CPU, one thread) and the untimed whole for the same samples, alternating per
    batch. `offset` shifts the step numbers (ours: Mixup's per-step seed) and timm's per-sample seeds, so that
    each round draws other Mixup/CutMix decisions (one per batch) and the Mixup stage is not that of one draw."""
    times = collections.defaultdict(float)  # only the stages this pipeline has
    keys = pipe.keys(sample) if keys is None else keys
    whole = 0.0
    warm = keys[:pipe.batch_size]  # once untimed first: lazy imports, first-call set-up, caches
    pipe.post_whole(pipe.collate([pipe.fetch_whole(key) for key in warm]), 0)
    for step, first in enumerate(range(0, len(keys), pipe.batch_size)):
        chunk = keys[first:first + pipe.batch_size]
        if len(chunk) < 2:  # Mixup needs pairs; a lone last sample is not timed
            break
        for timed in ((True, False) if step % 2 else (False, True)):
            samples = []
            for i, key in enumerate(chunk):
                _seed_like(pipe, offset * len(keys) + first + i)  # untimed
                t0 = time.process_time()
                samples.append(pipe.fetch_split(key, times) if timed else pipe.fetch_whole(key))
                if not timed:
                    whole += time.process_time() - t0
            t0 = time.process_time()
            batch = pipe.collate(samples)
            if timed:
                spent = time.process_time() - t0
                # FastCollateMixup: collate and mix
                if pipe.name == "timm" and pipe.collate_fn is not None:
                    t1 = time.process_time()
                    _fast_collate(samples)  # the collation alone, to tell the two apart
                    plain = time.process_time() - t1
                    times["collate"] += plain
                    times["mixup"] += spent - plain
                else:
                    times["collate"] += spent
                pipe.post_split(batch, offset * len(keys) + step, times)
            else:
                pipe.post_whole(batch, offset * len(keys) + step)
                whole += time.process_time() - t0
    images = sum(min(pipe.batch_size, len(keys) - f) for f in range(0, len(keys), pipe.batch_size)
                 if min(pipe.batch_size, len(keys) - f) >= 2)
    per_image = {k: 1e3 * times[k] / images for k in STAGES if k in times}
    return {"images": images, "stages_ms": per_image, "stages_sum_ms": sum(per_image.values()),
            "whole_ms": 1e3 * whole / images}


def _seed_like(pipe, position: int) -> None:
    """timm's samples draw their augmentation from the global RNGs: seed them per sample (untimed), so that the
    timed and the untimed pass do the same work. Ours seed themselves (that cost is the "seeding" stage)."""
    if pipe.name == "timm":
        seed_everything(position)


# -- the run -----------------------------------------------------------------------------------------------------

def train_namespace(args):
    """`vim-ds train`'s parsed options for --data-path and --train-args: the transform and Mixup come from the
    same options, with the same defaults, as in training."""
    try:
        extra = shlex.split(args.train_args)
    except ValueError as exc:
        raise BenchError(f"--train-args: {exc}") from None
    return parse_args(["--data-path", args.data_path, "--batch-size", str(args.batch_size), *extra],
                      prog=f"{PROG} --train-args")


def _summary(rows: list, rounds: list) -> dict:
    images = sum(r["images"] for r in rows)
    cpu = [r["cpu_seconds"] for r in rows]
    per_core = images / sum(cpu) if rows and all(c for c in cpu) else None
    by_workers = {}
    for w in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == w]
        cpu_w = [r["cpu_seconds"] for r in mine]
        by_workers[str(w)] = {
            "images_per_sec": statistics.median(r["images_per_sec"] for r in mine),
            "images_per_sec_per_worker": statistics.median(r["images_per_sec_per_worker"] for r in mine),
            "images_per_cpu_second": (sum(r["images"] for r in mine) / sum(cpu_w)) if all(cpu_w) else None}
    # the in-process split: the mean over the rounds (each round measured beside that round's loaders)
    stages = {k: statistics.fmean(r["stages_ms"].get(k, 0.0) for r in rounds) for k in STAGES
              if any(k in r["stages_ms"] for r in rounds)}
    whole = statistics.fmean(r["whole_ms"] for r in rounds)
    # transfer: each loader measurement's CPU time per image minus the same round's in-process time
    transfers = [1e3 / r["images_per_cpu_second"] - rounds[r["round"]]["whole_ms"] for r in rows
                 if r["images_per_cpu_second"]]
    return {"loader": rows, "by_workers": by_workers, "images_per_sec_per_core": per_core,
            "in_process": rounds, "images": sum(r["images"] for r in rounds), "stages_ms": stages,
            "stages_sum_ms": sum(stages.values()), "whole_ms": whole, "in_process_images_per_sec_per_core": 1e3 / whole,
            "transfer_ms": statistics.median(transfers) if transfers else None, "transfer_ms_each": transfers,
            "loader_cpu_ms_per_image": {
                where: _median([r[f"cpu_ms_per_image_{where}"] for r in rows])
                for where in ("workers", "training_process")}}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_pipeline_pair(args, train_args, is_train: bool, log) -> dict:
    pipes = [VimDsPipeline(train_args, is_train, args.batch_size), TimmPipeline(train_args, is_train,
                                                                                args.batch_size)]
    for pipe in pipes:
        if len(pipe.dataset) < pipe.batch_size:
            raise BenchError(f"{pipe.dataset.root if hasattr(pipe.dataset, 'root') else args.data_path} has "
                             f"{len(pipe.dataset)} images, fewer than one batch of {pipe.batch_size}; lower "
                             f"--batch-size or use more images")
    kind = "training" if is_train else "evaluation"
    rows = {p.name: [] for p in pipes}
    threads = torch.get_num_threads()
    # as in a worker; and no thread spin-up in the consuming process's CPU time
    torch.set_num_threads(1)
    try:
        in_proc = {p.name: [] for p in pipes}
        keys = pipes[0].keys(args.sample)  # timm's in-process pass reads the same images
        same_images = [k[0] if isinstance(k, tuple) else k for k in keys]
        for rnd in range(args.rounds):
            for p in (pipes if rnd % 2 == 0 else pipes[::-1]):
                log(f"  {kind}: {p.name} stages in one process on {args.sample} images, round {rnd + 1} ...")
                in_proc[p.name].append(measure_in_process(p, args.sample, keys if p is pipes[0] else same_images,
                                                          offset=rnd))
            for j, workers in enumerate(args.workers):
                order = pipes if (rnd + j) % 2 == 0 else pipes[::-1]
                for p in order:
                    row = measure_loader(p, workers, args.batches, args.warmup_batches)
                    row["round"] = rnd
                    rows[p.name].append(row)
                    log(f"  {kind}: {p.name:6s} {workers} worker(s), round {rnd + 1}: "
                        f"{row['images_per_sec']:.1f} images/s, "
                        f"{_fmt(row['images_per_cpu_second'])} images per CPU-second")
    finally:
        torch.set_num_threads(threads)
    result = {p.name: {**_summary(rows[p.name], in_proc[p.name]), "batch_size": p.batch_size, "where": p.where,
                       "transform": [type(s).__name__ for s in p.steps],
                       "in_training_process": p.in_training_process()} for p in pipes}
    ours, timm = result["vim_ds"]["images_per_sec_per_core"], result["timm"]["images_per_sec_per_core"]
    result["ratio"] = ours / timm if ours and timm else None
    pairs = [a["images_per_cpu_second"] / b["images_per_cpu_second"] for a, b in zip(rows["vim_ds"], rows["timm"])
             if a["images_per_cpu_second"] and b["images_per_cpu_second"]]
    result["pair_ratios"] = pairs
    return result


def _read_seconds(read, indices) -> float:
    """Wall seconds per image to read the image bytes of `indices` (a pass untimed first: warm page cache)."""
    for i in indices:
        read(i)
    t0 = time.perf_counter()
    for i in indices:
        read(i)
    return (time.perf_counter() - t0) / len(indices)


def _read_file(dataset, index) -> bytes:
    with open(dataset.samples[index][0], "rb") as f:
        return f.read()


def run_shards(args, train_args, shards: str, log) -> dict:
    """The trainer's training loader on the folder and on its shards (`--data-set shards`), alternating per round
    and worker count as the folder/timm pair; and the time to read one image's bytes from each (a file open and
    read vs one positioned read in a shard)."""
    shard_args = copy.copy(train_args)
    shard_args.data_set, shard_args.data_path = "shards", shards
    pipes = {"folder": VimDsPipeline(train_args, True, args.batch_size),
             "shards": VimDsPipeline(shard_args, True, args.batch_size)}
    if len(pipes["folder"].dataset) != len(pipes["shards"].dataset):
        raise BenchError(f"{shards} holds {len(pipes['shards'].dataset)} training images, {args.data_path} "
                         f"{len(pipes['folder'].dataset)}: not shards of this folder (vim-ds data shard writes them)")
    rows = {name: [] for name in pipes}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rnd in range(args.rounds):
            for j, workers in enumerate(args.workers):
                for name in (("folder", "shards") if (rnd + j) % 2 == 0 else ("shards", "folder")):
                    row = measure_loader(pipes[name], workers, args.batches, args.warmup_batches)
                    rows[name].append(row)
                    log(f"  training: vim_ds on the {name:6s} {workers} worker(s), round {rnd + 1}: "
                        f"{row['images_per_sec']:.1f} images/s, {_fmt(row['images_per_cpu_second'])} images per "
                        f"CPU-second")
    finally:
        torch.set_num_threads(threads)
    indices = spread(len(pipes["folder"].dataset), args.sample)
    read_us = {"folder": 1e6 * _read_seconds(lambda i: _read_file(pipes["folder"].dataset, i), indices),
               "shards": 1e6 * _read_seconds(pipes["shards"].dataset.read, indices)}
    result = {"shards": shards, "read_us_per_image": read_us}
    for name, mine in rows.items():
        cpu = [r["cpu_seconds"] for r in mine]
        result[name] = {"loader": mine, "images_per_sec": statistics.median(r["images_per_sec"] for r in mine),
                        "images_per_sec_per_core": sum(r["images"] for r in mine) / sum(cpu) if all(cpu) else None}
    return result


def _fmt(value, digits=1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(kind: str, res: dict, workers: list) -> str:
    ours, timm = res["vim_ds"], res["timm"]
    lines = [f"{kind} pipeline (batch {ours['batch_size']}):",
             f"  {'workers':>7}  {'vim_ds img/s':>12}  {'timm img/s':>10}  {'vim_ds /core':>12}  {'timm /core':>10}"]
    for w in workers:
        a, b = ours["by_workers"][str(w)], timm["by_workers"][str(w)]
        lines.append(f"  {w:>7}  {a['images_per_sec']:>12.1f}  {b['images_per_sec']:>10.1f}  "
                     f"{_fmt(a['images_per_cpu_second']):>12}  {_fmt(b['images_per_cpu_second']):>10}")
    lines.append(f"  time per image (ms of CPU, one process, {ours['images']} images; * = in the training process):")
    lines.append(f"    {'stage':<26}{'vim_ds':>8}{'timm':>8}")
    def cell(r, stage):
        if stage not in r["stages_ms"]:
            return f"{'-':>7} "
        mark = "*" if r["where"].get(stage, "").startswith("training process") else " "
        return f"{r['stages_ms'][stage]:>7.2f}{mark}"

    for stage in STAGES:
        if stage in ours["stages_ms"] or stage in timm["stages_ms"]:
            lines.append(f"    {STAGE_LABELS[stage]:<26}{cell(ours, stage)}{cell(timm, stage)}")
    lines.append(f"    {'sum of the stages':<26}{ours['stages_sum_ms']:>7.2f} {timm['stages_sum_ms']:>7.2f}")
    lines.append(f"    {'whole, untimed steps':<26}{ours['whole_ms']:>7.2f} {timm['whole_ms']:>7.2f}")
    lines.append(f"    {STAGE_LABELS['transfer'] + ' (a)':<26}{_fmt(ours['transfer_ms'], 2):>7} "
                 f"{_fmt(timm['transfer_ms'], 2):>7}")
    lines.append("    (a) the loaders' CPU time per image minus the whole in-process time")
    for name, r in (("vim_ds", ours), ("timm", timm)):
        c = r["loader_cpu_ms_per_image"]
        lines.append(f"  {name} loader, CPU per image (median over its runs): workers {_fmt(c['workers'], 2)} ms, "
                     f"training process {_fmt(c['training_process'], 2)} ms")
    return "\n".join(lines)


def run_data(args) -> dict:
    def log(text):
        print(text, file=sys.stderr, flush=True)

    for split in ("train", "val") if args.eval else ("train",):
        try:
            _checked_split(args.data_path, split)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    if getattr(args, "shards", None):
        try:
            check_shards(args.shards, need_train=True)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    train_args = train_namespace(args)
    settings = {"data_path": args.data_path, "workers": args.workers, "batch_size": args.batch_size,
                "batches": args.batches, "warmup_batches": args.warmup_batches, "rounds": args.rounds,
                "sample": args.sample, "train_args": args.train_args, "shards": getattr(args, "shards", None),
                "recipe": {k: getattr(train_args, k) for k in (
                    "input_size", "aa", "color_jitter", "train_interpolation", "scale", "ratio", "hflip", "reprob",
                    "remode", "recount", "mixup", "cutmix", "cutmix_minmax", "mixup_prob", "mixup_switch_prob",
                    "mixup_mode", "smoothing", "repeated_aug", "eval_crop_ratio", "seed")},
                "cpu": cpu_name(), "cores_available": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                "timm": timm.__version__, "pillow": PIL.__version__}
    results = {"settings": settings}
    results["train"] = run_pipeline_pair(args, train_args, True, log)
    if args.eval:
        results["eval"] = run_pipeline_pair(args, train_args, False, log)
    if getattr(args, "shards", None) is not None:
        results["shards"] = _with_shards(args, train_args, log)
    print(f"{PROG}: {args.data_path}, {train_args.input_size} px, {settings['cpu']}, "
          f"{settings['cores_available']} cores available; torch {torch.__version__}, timm {timm.__version__}, "
          f"Pillow {PIL.__version__}")
    r = settings["recipe"]
    print(f"recipe: aa {r['aa']}, reprob {r['reprob']}, mixup {r['mixup']}, cutmix {r['cutmix']}, "
          f"{r['train_interpolation']}; {args.rounds} round(s) of {args.batches} batches per loader, alternating")
    print(_table("training", results["train"], args.workers))
    if args.eval:
        print(_table("evaluation", results["eval"], args.workers))
    t = results["train"]
    ours, timm_rate = t["vim_ds"]["images_per_sec_per_core"], t["timm"]["images_per_sec_per_core"]
    if "shards" in results:
        sh = results["shards"]
        rate = {name: sh[name]["images_per_sec_per_core"] for name in ("folder", "shards")}
        print(f"shards vs folder (vim_ds training loader, {' '.join(map(str, args.workers))} worker(s)): folder "
              f"{_fmt(rate['folder'])}, shards {_fmt(rate['shards'])} images/s per core; one image's bytes read in "
              f"{sh['read_us_per_image']['folder']:.0f} us from the folder, "
              f"{sh['read_us_per_image']['shards']:.0f} us from the shards")
    print(f"training pipeline: vim_ds {_fmt(ours)} images/s per core, timm {_fmt(timm_rate)} images/s per core, "
          f"ratio {_fmt(t['ratio'], 2)}")
    return results


def _with_shards(args, train_args, log) -> dict:
    """run_shards on --shards DIR, or on shards of --data-path written into a temporary folder first."""
    if args.shards:
        return run_shards(args, train_args, args.shards, log)

    folder = tempfile.mkdtemp(prefix="vim-ds-bench-shards-")
    try:
        log(f"  writing shards of {args.data_path} into {folder} ...")
        write_shards(args.data_path, folder)
        return run_shards(args, train_args, folder, log)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_args(parser, args) -> None:
    for name, least in (("batch_size", 2), ("batches", 1), ("warmup_batches", 1), ("rounds", 1), ("sample", 2)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if not args.workers or min(args.workers) < 1:
        parser.error(f"--workers must be one or more counts of at least 1, got {args.workers}")


def add_parser(sub) -> None:
    d = sub.add_parser(
        "data", help="the input pipeline alone (decode, augment, collate, hand-over): ours vs timm's loader",
        description="Time the training and evaluation input pipelines on an ImageNet-layout folder of JPEGs "
        "(`vim-ds data photos --out DIR` writes one): the trainer's loader against timm.data.create_loader with the "
        "same transform arguments, alternating, for each worker count; images/s and images per CPU-second "
        "('per core'); and the time per image split into decode, resize/crop, RandAugment, tensor conversion and "
        "normalisation, random erasing, collation, Mixup and the inter-process transfer. The last line compares "
        "the training pipelines per core.")
    d.add_argument("--data-path", required=True, metavar="DIR", help="ImageNet-style root with train/ and val/")
    d.add_argument("--workers", type=int, nargs="+", default=[1, 2], metavar="N", help="worker counts [1 2]")
    d.add_argument("--batch-size", type=int, default=DEFAULT_MICRO_BATCH,
                   help="training batch (evaluation: 1.5x, as the trainer's)")
    d.add_argument("--batches", type=int, default=10, help="timed batches per loader measurement")
    d.add_argument("--warmup-batches", type=int, default=2, help="batches before the timed ones (worker start-up)")
    d.add_argument("--rounds", type=int, default=2, help="alternating measurements per loader and worker count")
    d.add_argument("--sample", type=int, default=128, help="images timed stage by stage in one process")
    d.add_argument("--train-args", default="", metavar="'ARGS'",
                   help="vim-ds train options that shape the pipeline, one quoted string, e.g. "
                   "'--aa none --reprob 0 --mixup 0 --cutmix 0' [the training recipe's defaults]")
    d.add_argument("--no-eval", dest="eval", action="store_false", help="skip the evaluation pipeline")
    d.add_argument("--shards", nargs="?", const="", metavar="SHARDS",
                   help="also time our training loader on shards of --data-path (`vim-ds data shard` wrote SHARDS; "
                   "without SHARDS they are written into a temporary folder first) beside the folder: one more line")
    d.add_argument("--json", metavar="FILE", help="also write the settings and every measurement as JSON")
