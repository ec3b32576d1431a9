"""`vim-ds bench model`: a Vim training step vs timm's DeiT of the same size, and high-resolution inference (time
and peak memory), each measurement in a fresh process so that peak memory belongs to that model alone."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import torch
from torch._dynamo.utils import counters

from ...models import ModelConfig
from .timing import timeit


def child(spec: dict) -> dict:
    """One measurement, in the fresh process that `measure` starts (`python -m vim_ds.bench _child SPEC`)."""
    torch.manual_seed(0)
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    # each architecture's own dropout and stochastic depth (Vim's 0.1, DeiT's none), as published
    model = ModelConfig(spec["model"], 1000, spec["img_size"], spec.get("model_kwargs", {}), drop=None,
                        drop_path=None).build().to(device)
    if spec.get("compiled"):
        model = torch.compile(model)  # inductor; the warmup steps pay for the compilation
    x = torch.randn(spec["batch"], 3, spec["img_size"], spec["img_size"], device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        import psutil  # here, not at the top: a package `import vim_ds` does not load (start-up)

        base = psutil.Process().memory_info().rss
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if spec["mode"] == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        target = torch.randint(0, 1000, (spec["batch"],), device=device)

        def step():
            with autocast:
                loss = torch.nn.functional.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model.eval()

        def step():
            with torch.no_grad(), autocast:
                model(x)

    seconds = timeit(step, device, warmup=spec["warmup"], repeat=spec["repeat"])
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    result = {**spec, "seconds": seconds, "peak_mem_bytes": int(peak)}
    if spec.get("compiled"):
        result["graphs"] = int(counters["stats"]["unique_graphs"])
        result["graph_breaks"] = int(sum(counters["graph_break"].values()))
    return result


def measure(spec: dict) -> dict:
    """Run one model measurement in a fresh interpreter and return its result."""
    out = subprocess.run([sys.executable, "-m", "vim_ds.cli.bench", "_child", json.dumps(spec)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        return {**spec, "error": tail[0]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_pair(a: dict, b: dict, rounds: int):
    """Measure two configurations alternately, `rounds` times each: each one's fastest time and highest peak.

    Alternating and taking the minimum keeps the ratio meaningful on a machine whose speed drifts (shared hosts).
    """
    best = {}
    for _ in range(rounds):
        for spec in (a, b):
            r, key = measure(spec), (spec["model"], spec.get("compiled", False))
            old = best.get(key)
            if old is None or "error" in r:
                best[key] = r
            elif "error" not in old:  # fastest time, highest peak memory over the rounds
                faster = r if r["seconds"] < old["seconds"] else old
                best[key] = {**faster, "peak_mem_bytes": max(r["peak_mem_bytes"], old["peak_mem_bytes"])}
    return best[(a["model"], a.get("compiled", False))], best[(b["model"], b.get("compiled", False))]


def run_model(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    pairs = [("vim_tiny", "deit_tiny_patch16_224")]
    if device == "cuda":
        pairs.append(("vim_small", "deit_small_patch16_224"))
    for vim, deit in pairs:
        batch = args.train_batch if device == "cpu" else 64
        dtype = "float32" if device == "cpu" else "bfloat16"
        cases = [("train", False, batch, 224, "training step (eager)")]
        if not args.no_compile:
            cases.append(("train", True, batch, 224, "training step (torch.compile)"))
        cases.append(("infer", False, 1, args.hires, f"inference at {args.hires}^2"))
        for mode, compiled, batch_, size, label in cases:
            specs = [dict(model=name, mode=mode, batch=batch_, img_size=size, device=device, dtype=dtype,
                          compiled=compiled, warmup=3 if compiled else 1, repeat=args.repeat) for name in (vim, deit)]
            pair = measure_pair(*specs, rounds=args.rounds)
            rows.extend(pair)
            for r in pair:
                print(_model_row(r), flush=True)
            ratio = _ratio(*pair)
            if ratio:
                print(f"  {vim} {label} = {ratio:.2f} x {deit}", flush=True)
    return rows


def _ratio(a, b):
    if "seconds" in a and "seconds" in b:
        return a["seconds"] / b["seconds"]
    return None


def _model_row(r):
    what = (f"[{r['device']}] {r['model']} {r['mode']}{' compiled' if r.get('compiled') else ''} batch {r['batch']} "
            f"{r['img_size']}^2 {r['dtype']}")
    if "error" in r:
        return f"{what}: FAILED ({r['error']})"
    graphs = f", {r['graphs']} graphs, {r['graph_breaks']} graph breaks" if "graphs" in r else ""
    return f"{what}: {r['seconds'] * 1e3:.0f} ms, peak memory {r['peak_mem_bytes'] / 2**20:.0f} MiB{graphs}"
