"""`vim-ds bench split`: one training step (forward, cross-entropy, backward) of a Vim with each image's tokens split
over N ranks (`models.sequence_parallel`, as `vim-ds train --sequence-parallel N` runs it), for each N asked, beside
the unsplit model (N = 1): peak memory per rank, forward and backward time, the split's communication per block on
paper, and how far its logits are from the unsplit model's (the measured step must be the same computation).

Memory: on a GPU the peak of allocated memory during the first step above what was allocated before it (model,
images); on a CPU the growth of the process's peak resident set during the first step (the allocator's caching
included; a coarser measure). Time: the median of the following `--repeat` steps. The ranks are processes on this
machine (gloo on CPU, one thread each's share of the cores; NCCL on GPUs, one GPU each; with `--share-gpu` every
rank on GPU 0 through gloo, for the memory per rank on a machine with fewer GPUs than ranks).

The time goal is the split step against the unsplit step / N on the same hardware per rank. On GPUs that is the
unsplit model's row (one GPU). On a CPU the N ranks share its cores, so the unsplit model is also timed with each
rank's threads (cores // N, at least 1: the row "N = 1, T threads"), and a rank's step is compared with that
time x max(1, N / cores) / N: with more ranks than cores each rank has N / cores of a core's time to itself.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...engine.trainer import peak_memory_mb
from ...models.factory import ModelConfig
from ...models.sequence_parallel import split_error, split_over
from ...runtime.distributed import free_port
from ..run_options import add_model_kwargs
from .data import BenchError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_parser(sub) -> None:
    p = sub.add_parser("split", help="a training step with the tokens split over N ranks: memory and time per N")
    p.add_argument("--model", default="vim_tiny")
    add_model_kwargs(p, default=[], help="model constructor overrides, e.g. depth=2 embed_dim=32",
                     metavar="KEY=VALUE")
    p.add_argument("--input-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                   help="ranks per image; 1 is the unsplit model [1 2 4]")
    p.add_argument("--repeat", type=int, default=2, help="timed steps after the first (median)")
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--nb-classes", type=int, default=1000)
    p.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0, collectives through gloo: the memory per rank of a split on a machine "
                        "with fewer GPUs than ranks (its times are not the split's: the ranks share the GPU)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(run=run_split, check=check_args)


def check_args(parser, args) -> None:
    args.model_kwargs = dict(args.model_kwargs)
    for name, least in (("input_size", 8), ("batch_size", 1), ("repeat", 1), ("nb_classes", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if any(n < 1 for n in args.ranks):
        parser.error(f"--ranks must be at least 1 each, got {args.ranks}")
    problem = _split_problem(args)
    if problem:
        parser.error(problem)


def _split_problem(args) -> str | None:
    """Why the model cannot be built (an unknown name, a bad --model-kwargs) or split over the largest N asked (not
    a Vim; fewer tokens than ranks), found on the meta device before any rank process starts, else None."""
    try:
        with torch.device("meta"):
            model = ModelConfig(args.model, args.nb_classes, args.input_size, args.model_kwargs).build()
    except ValueError as exc:
        return str(exc)
    most = max(args.ranks)
    problem = split_error(model, most)
    return f"--ranks {most} with --model {args.model} at --input-size {args.input_size}: {problem}" if problem else None


def communication_per_block(model, batch: int, dtype: torch.dtype) -> dict:
    """What one rank sends per block and direction pair, in bytes (docs/sequence-parallel.md): its conv edges (2(K-1)
    tokens of d_inner channels, the activations' dtype) and both directions' chunk pairs (4 x d_inner x d_state,
    float32), received from each of the N - 1 others; and the class token's broadcast once per forward."""
    mixer = model.layers[0].mixer
    d_inner, d_state, k = mixer.d_inner, mixer.d_state, mixer.d_conv
    item = torch.finfo(dtype).bits // 8
    pair_item = 8 if dtype == torch.float64 else 4
    return {"edges": 2 * (k - 1) * batch * d_inner * item, "pairs": 4 * batch * d_inner * d_state * pair_item,
            "class_token": batch * model.embed_dim * item}


def run_split(args) -> dict:
    cuda = torch.cuda.is_available()
    if args.share_gpu and not cuda:
        raise BenchError("--share-gpu needs a GPU; this machine has none")
    if cuda and not args.share_gpu and max(args.ranks) > torch.cuda.device_count():
        raise BenchError(f"--ranks {max(args.ranks)} needs as many GPUs (or --share-gpu); this machine has "
                         f"{torch.cuda.device_count()}")
    settings = {"model": args.model, "model_kwargs": args.model_kwargs, "input_size": args.input_size,
                "batch_size": args.batch_size, "repeat": args.repeat, "precision": args.precision,
                "nb_classes": args.nb_classes, "device": "cuda" if cuda else "cpu",
                "cores": len(os.sched_getaffinity(0)), "share_gpu": bool(args.share_gpu)}
    shared = " (every rank on GPU 0: memory per rank; times not comparable)" if args.share_gpu else ""
    print(f"vim-ds bench split: {args.model} {args.input_size}^2, batch {args.batch_size}, {args.precision}, on "
          f"{settings['device']}; ranks per image {args.ranks}{shared}", flush=True)
    cores = settings["cores"]
    runs = [(n, _threads(n, cores, cuda)) for n in args.ranks]
    if not cuda and 1 in args.ranks:  # the unsplit model at each split's threads per rank (module docstring)
        runs += [(1, t) for t in sorted({t for n, t in runs if n > 1} - {cores})]
    rows, reference = [], None
    with tempfile.TemporaryDirectory(prefix="vim-ds-bench-split-") as work:
        for n, threads in runs:
            out = os.path.join(work, f"n{n}t{threads}.pt")
            torch.multiprocessing.spawn(_rank, args=(n, free_port(), {**settings, "threads": threads}, out),
                                        nprocs=n, join=True)
            result = torch.load(out, weights_only=True)
            logits = result.pop("logits")
            if reference is None and n == 1:
                reference = logits
            result["logits_max_rel_diff"] = None if reference is None else \
                float((logits - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
            rows.append({"ranks": n, "threads": threads, **result})
        for row in rows:
            print(_line(row, rows, cores), flush=True)
    return {"settings": settings, "rows": rows}


def _threads(n: int, cores: int, cuda: bool):
    """Threads per rank on a CPU (cores // N, at least 1); None on GPUs."""
    return None if cuda else max(1, cores // n)


def _step(row: dict) -> float:
    return row["forward_s"] + row["backward_s"]


def _line(row: dict, rows: list, cores: int) -> str:
    unsplit = next((r for r in rows if r["ranks"] == 1 and r["threads"] in (None, cores)), None)
    same = next((r for r in rows if r["ranks"] == 1 and r["threads"] == row["threads"]), None)
    threads = "" if row["threads"] is None else f", {row['threads']} thread{'s' * (row['threads'] > 1)}"
    text = (f"N = {row['ranks']}{threads}: peak {row['peak_bytes'] / 2**20:.1f} MiB per rank, forward "
            f"{row['forward_s']:.3f} s, backward {row['backward_s']:.3f} s")
    if unsplit is not None and row["ranks"] > 1:
        text += (f"; memory {row['peak_bytes'] / max(unsplit['peak_bytes'], 1):.2f}x the unsplit model's, step "
                 f"{_step(row) / (_step(unsplit) / row['ranks']):.2f}x the unsplit step / N")
        if same is not None and same is not unsplit:
            share = max(1.0, row["ranks"] / cores)
            text += (f" ({_step(row) / (_step(same) * share / row['ranks']):.2f}x against the unsplit model at "
                     f"{row['threads']} thread{'s' * (row['threads'] > 1)} per process)")
        text += (f"; sends per block {(row['comm']['edges'] + row['comm']['pairs']) / 1024:.1f} KiB to each other "
                 f"rank; logits {row['logits_max_rel_diff']:.1e} from the unsplit model's")
    return text


def _rank(rank: int, world: int, port: int, settings: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = settings["device"] == "cuda"
    device = torch.device("cuda", 0 if settings["share_gpu"] else rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(settings["threads"])
    # NCCL refuses two ranks on one GPU; gloo moves the (small) collectives through the host
    dist.init_process_group("nccl" if cuda and not settings["share_gpu"] else "gloo", rank=rank, world_size=world)
    try:
        dtype = DTYPES[settings["precision"]]
        torch.manual_seed(0)
        # the published stochastic depth (Vim's own 0.1): the step a Vim trains with
        model = ModelConfig(settings["model"], settings["nb_classes"], settings["input_size"],
                            settings["model_kwargs"], drop=None, drop_path=None).build().to(device, dtype)
        generator = torch.Generator().manual_seed(1)
        size, batch = settings["input_size"], settings["batch_size"]
        images = torch.randn(batch, 3, size, size, generator=generator).to(device, dtype)
        targets = torch.randint(settings["nb_classes"], (batch,), generator=generator).to(device)
        if world > 1:
            split_over(model, dist.group.WORLD)
        forward, backward, logits, peak = [], [], None, 0
        for step in range(1 + settings["repeat"]):
            before = _memory(device)
            _reset_peak(device)
            t0 = _now(device)
            out_logits = model(images)
            t1 = _now(device)
            F.cross_entropy(out_logits.float(), targets).backward()
            t2 = _now(device)
            if step == 0:
                peak, logits = max(int(peak_memory_mb(device) * 2**20) - before, 0), out_logits.detach().float().cpu()
            else:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
            model.zero_grad(set_to_none=True)
            del out_logits
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        if rank == 0:
            torch.save({"peak_bytes": max(peaks), "forward_s": statistics.median(forward),
                        "backward_s": statistics.median(backward), "logits": logits,
                        "comm": communication_per_block(model, batch, dtype) if world > 1 else None}, out)
    finally:
        dist.destroy_process_group()


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


