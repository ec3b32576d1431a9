"""`vim-ds zero-compare`: ZeRO stages side by side, measured model-state bytes per rank beside the theory.

Each configuration (ds_configs/zeroN.json, with --offload also zero2_offload / zero3_offload) is one real launch
of the trainer on synthetic data (`vim_ds.runtime.launched_runs.run_train_config`); its metrics.jsonl summary carries
the bytes of parameters, gradients and optimizer states that rank held (`vim_ds.engine.memory.state_bytes`, see its
docstring for what each number includes), peak memory, throughput and the per-step losses. Written to --out:

report.csv  one row per configuration
report.md   the table, the ZeRO paper's arithmetic and DeepSpeed's own estimators beside it, loss agreement
report.png  memory per rank by configuration, stacked by kind, with throughput on a second axis

With --baselines ddp fsdp the same training also runs under PyTorch DDP and FSDP2 (`vim_ds.train --engine`, see
`vim_ds/runtime/baselines.py`): the same launcher, model, AdamW groups, lr schedule, data order, batch and steps;
their rows carry the same measurements (FSDP: the local shards of the DTensor parameters, gradients and Adam
states) and their loss agreement with ZeRO-0. With baselines every run, ZeRO ones included, trains without EMA
(the baselines keep none), so all rows time the same loop.

A configuration that fails is a row with its one-line error; the others still run. Exit status 0 if all ran.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import sys

from ..config.training_engines import DEFAULT as DEFAULT_ENGINE
from ..config.training_engines import ENGINES, baseline_names, training_engine
from ..models import ModelConfig
from ..runtime import env_vars, launched_runs
from ..runtime.errors import first_line, report_error
from .run_options import add_model_kwargs

KINDS = ("param", "grad", "optim")
CSV_COLUMNS = ("config", "engine", "stage", "offload", "precision", "ranks", "param_bytes_per_rank",
               "grad_bytes_per_rank",
               "optim_bytes_per_rank", "master_bytes_per_rank", "model_state_bytes_per_rank",
               "expected_model_state_bytes_per_rank", "peak_mem_bytes", "samples_per_sec", "final_loss",
               "max_rel_loss_diff_vs_stage0", "loss_flag", "error")
# autocast-bf16: fp32 weights and updates, but bf16 matmuls whose rounding differs with the order of the (bf16)
# gradient reduction between stages: bf16's tolerance
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2, "autocast-bf16": 2e-2}


# -- the theory -------------------------------------------------------------------------------------------------

def expected_bytes(stage: int, psi: int, ranks: int, precision: str) -> dict:
    """The ZeRO paper's model-state bytes per rank for psi parameters on `ranks` data-parallel ranks.

    Mixed precision (bf16/fp16, K = 12): 2 psi parameters + 2 psi gradients + 12 psi optimizer states (fp32 master,
    Adam's two moments); stage 1 partitions the optimizer states, 2 also the gradients, 3 also the parameters.
    fp32: 4 psi parameters + 4 psi gradients + 8 psi Adam moments (the parameters are the masters).
    autocast-bf16 holds what fp32 holds (DeepSpeed's torch_autocast keeps fp32 parameters, fp32 gradients and no
    separate master; bf16 is only the dtype of the matmuls and of the nn.Linear/Conv gradients' reduction buckets,
    which are not model states)."""
    if precision in ("fp32", "autocast-bf16"):
        p, g, o = 4 * psi, 4 * psi, 8 * psi
    else:
        p, g, o = 2 * psi, 2 * psi, 12 * psi
    n = max(1, ranks)
    if stage >= 1:
        o /= n
    if stage >= 2:
        g /= n
    if stage >= 3:
        p /= n
    return {"param": p, "grad": g, "optim": o, "total": p + g + o}


def deepspeed_estimates(psi: int, largest_layer: int, ranks: int) -> dict:
    """DeepSpeed's own "all cold" estimators (printed tables) and the per-GPU bytes they compute without offload
    (these include DeepSpeed's additional_buffer_factor 1.5 on the CPU side only)."""
    out = {}
    try:  # DeepSpeed here, not at the top: seconds of start-up that the rest of the command does not need
        from deepspeed.runtime.zero.stage3 import (
            estimate_zero3_model_states_mem_needs,
            estimate_zero3_model_states_mem_needs_all_cold,
        )
        from deepspeed.runtime.zero.stage_1_and_2 import (
            estimate_zero2_model_states_mem_needs,
            estimate_zero2_model_states_mem_needs_all_cold,
        )
    except Exception as exc:  # noqa: BLE001 (an estimator is an extra, not the report)
        return {"error": f"DeepSpeed estimators unavailable: {exc}"}
    for name, cold, call in (
            ("zero2", lambda: estimate_zero2_model_states_mem_needs_all_cold(psi, num_gpus_per_node=ranks,
                                                                            num_nodes=1),
             lambda: estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=ranks, num_nodes=1,
                                                           cpu_offload=False)[1]),
            ("zero3", lambda: estimate_zero3_model_states_mem_needs_all_cold(psi, largest_layer,
                                                                            num_gpus_per_node=ranks, num_nodes=1),
             lambda: estimate_zero3_model_states_mem_needs(psi, largest_layer, num_gpus_per_node=ranks,
                                                           num_nodes=1, cpu_offload=False, cpu_offload_params=False,
                                                           zero_init=True)[1])):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                cold()
            out[name] = {"printed": buf.getvalue().rstrip(), "gpu_bytes_no_offload": int(call())}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"printed": f"estimator failed: {exc}", "gpu_bytes_no_offload": None}
    return out


def model_params(model: str, model_kwargs: dict, input_size: int, nb_classes: int) -> tuple[int, int, list]:
    """(parameters, largest layer's own parameters, every parameter's shape) of the model as the trainer builds
    it."""
    net = ModelConfig(model, nb_classes, input_size, model_kwargs, drop=None, drop_path=None).build()
    total = sum(p.numel() for p in net.parameters())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules()), default=0)
    return total, largest, [tuple(p.shape) for p in net.parameters()]


def fsdp_shard_numel(shape, rank: int, ranks: int) -> int:
    """Elements of one tensor that FSDP2's full sharding leaves on `rank`: dim 0 is cut into chunks of
    ceil(dim0 / ranks) rows (torch.chunk), so the last ranks may hold fewer rows, or none."""
    shape = tuple(shape) or (1,)
    rows = -(-shape[0] // max(1, ranks))
    start = min(shape[0], rank * rows)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return (min(shape[0], start + rows) - start) * rest


def expected_baseline_bytes(engine: str, shapes, ranks: int) -> dict:
    """Model-state bytes on the fullest rank (rank 0) of a DDP or FSDP2 baseline: fp32 parameters (4 bytes), fp32
    gradients (4) and Adam's two fp32 moments (8) per element, of the whole model under DDP, of rank 0's dim-0
    shard of every tensor under FSDP full sharding (about 1/N, rounded up per tensor). Adam's 4-byte step counter
    per tensor is not included (the measurement has it: at most 4 bytes x tensors more)."""
    kind = ENGINES.get(engine)
    if kind is None or not kind.baseline:
        raise ValueError(f"unknown baseline {engine!r}")
    n = sum(fsdp_shard_numel(s, 0, ranks if kind.shards_states else 1) for s in shapes)
    return {"param": 4 * n, "grad": 4 * n, "optim": 8 * n, "total": 16 * n}


# -- the runs ---------------------------------------------------------------------------------------------------

def read_run(out_dir: str) -> tuple[dict | None, dict[int, float]]:
    """(summary record, step -> loss) from a run's metrics.jsonl."""
    summary, losses = None, {}
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None, losses
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("summary"):
                summary = r
            elif "loss" in r and "eval_acc1" not in r:
                try:
                    losses[int(r["step"])] = float(r["loss"])
                except (TypeError, ValueError):
                    pass
    return summary, losses


def configurations(stages, offload: bool) -> list[tuple[str, int, str]]:
    out = [(f"zero{s}", s, "-") for s in stages]
    if offload:
        out += [(f"zero{s}_offload", s, "optimizer" if s == 2 else "optimizer+param") for s in stages if s in (2, 3)]
    return out


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float | None:
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in common)


def _is_baseline(row: dict) -> bool:
    """A row of a PyTorch baseline (a row that names no engine is DeepSpeed's)."""
    return training_engine(row.get("engine", DEFAULT_ENGINE)).baseline


def finish_rows(rows: list[dict], losses: dict[str, dict[int, float]], psi: int | None, shapes=None) -> None:
    """Fill the derived columns: totals, expectations, loss agreement with stage 0 (same precision)."""
    base = next((r for r in rows if r.get("stage") == 0 and r.get("offload") == "-" and not r.get("error")), None)
    for r in rows:
        if _is_baseline(r):
            if shapes:
                r["expected_model_state_bytes_per_rank"] = expected_baseline_bytes(r["engine"], shapes,
                                                                                   r["ranks"])["total"]
        elif psi:
            r["expected_model_state_bytes_per_rank"] = int(expected_bytes(r["stage"], psi, r["ranks"],
                                                                          r["precision"])["total"])
        if r.get("error"):
            continue
        per_rank = [r.get(f"{k}_bytes_per_rank") for k in KINDS]
        if all(isinstance(v, list) and v for v in per_rank):
            r["model_state_bytes_per_rank"] = max(sum(vals) for vals in zip(*per_rank))
        if base is not None and r is not base:
            diff = max_rel_diff(losses.get(r["config"], {}), losses.get(base["config"], {}))
            r["max_rel_loss_diff_vs_stage0"] = diff
            tol = LOSS_TOLERANCE.get(r["precision"], 2e-2)
            r["loss_flag"] = bool(diff is None or diff > tol)
        elif r is base:
            r["max_rel_loss_diff_vs_stage0"], r["loss_flag"] = 0.0, False


# -- the report -------------------------------------------------------------------------------------------------

def _cell(value):
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else value


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in CSV_COLUMNS})


def _mib(v):
    if isinstance(v, list):
        v = max(v) if v else None
    return "-" if v is None else f"{v / 2**20:.2f}"


def _split_note(sequence_parallel: int) -> str:
    if sequence_parallel <= 1:
        return ""
    return (f" (each image's tokens split over groups of {sequence_parallel} ranks; ZeRO partitions over every "
            f"rank)")


def markdown(rows, settings: dict, psi: int | None, estimates: dict | None) -> str:
    lines = ["# ZeRO comparison", "",
             f"{settings['model']} {settings['kwargs']} at {settings['input_size']}^2, {settings['ranks']} rank(s) "
             f"via {settings['launcher']}{_split_note(settings.get('sequence_parallel', 1))}, batch "
             f"{settings['batch_size']} per rank, {settings['steps']} steps, "
             f"{settings['precision']}." + (f" Ψ = {psi:,} parameters." if psi else ""), "",
             "Measured bytes are per rank (the largest rank), MiB; model states read from the engine at the end of "
             "the run (`vim_ds.engine.memory.state_bytes`: parameters as held, ZeRO-3 partitions only; optimizer = "
             "Adam moments + fp32 masters; gradients = the buffers between backward and step, sized from the "
             "engine's layout where step() already freed them). Peak = the process's peak memory (CPU: max RSS).", "",
             "| config | stage | offload | params | grads | optim (of which master) | model states | expected "
             "(paper) | peak | samples/s | final loss | max rel loss diff vs stage 0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    failed = []
    for r in rows:
        exp = _mib(r.get("expected_model_state_bytes_per_rank"))
        stage = "-" if r["stage"] is None else r["stage"]
        if r.get("error"):
            failed.append(r)
            lines.append(f"| {r['config']} | {stage} | {r['offload']} | FAILED | | | | {exp} | | | | |")
            continue
        diff = r.get("max_rel_loss_diff_vs_stage0")
        flag = " **DISAGREES**" if r.get("loss_flag") else ""
        sps = r.get("samples_per_sec")
        loss = r.get("final_loss")
        lines.append(
            f"| {r['config']} | {stage} | {r['offload']} | {_mib(r.get('param_bytes_per_rank'))} | "
            f"{_mib(r.get('grad_bytes_per_rank'))} | {_mib(r.get('optim_bytes_per_rank'))} "
            f"({_mib(r.get('master_bytes_per_rank'))}) | {_mib(r.get('model_state_bytes_per_rank'))} | {exp} | "
            f"{_mib(r.get('peak_mem_bytes'))} | {'-' if sps is None else f'{sps:.2f}'} | "
            f"{'-' if loss is None else f'{loss:.5f}'} | {'-' if diff is None else f'{diff:.2e}'}{flag} |")
    if failed:
        lines += ["", "Failed:"] + [f"- {r['config']}: {r['error']}" for r in failed]
    if psi:
        n = settings["ranks"]
        lines += ["", f"## Expectations (ZeRO paper, Ψ = {psi:,}, N = {n}, {settings['precision']})", "",
                  "| stage | params | grads | optim | total |", "|---|---|---|---|---|"]
        for s in (0, 1, 2, 3):
            e = expected_bytes(s, psi, n, settings["precision"])
            lines.append(f"| {s} | {_mib(e['param'])} | {_mib(e['grad'])} | {_mib(e['optim'])} | "
                         f"{_mib(e['total'])} |")
        lines += ["", "Mixed precision: 2Ψ params + 2Ψ grads + 12Ψ optimizer (fp32 master + 2 Adam moments); stage 1 "
                  "divides the optimizer by N, stage 2 also the grads, stage 3 everything. fp32: 4Ψ + 4Ψ + 8Ψ (no "
                  "master); autocast-bf16 holds what fp32 holds. Known departure: DeepSpeed 0.19.8 ZeRO 1-3 keep "
                  "an fp32 master partition (a clone, in parentheses) even in fp32: 4Ψ/N more optimizer bytes than "
                  "the paper's fp32 arithmetic; ZeRO-1 also holds only its partition of the gradients. "
                  "Offload configs keep the same bytes, on the CPU (on a CPU-only machine everything is CPU memory)."]
    if estimates:
        lines += ["", "## DeepSpeed's estimators (all cold, per node of N GPUs)", ""]
        if "error" in estimates:
            lines.append(estimates["error"])
        for name in ("zero2", "zero3"):
            if name in estimates:
                e = estimates[name]
                lines += [f"`{name}` (per GPU, no offload: {_mib(e['gpu_bytes_no_offload'])} MiB):", "", "```",
                          e["printed"], "```", ""]
    baselines = [r for r in rows if _is_baseline(r)]
    if baselines:
        lines += ["", "## Baselines (PyTorch, same model, AdamW groups, lr schedule, data, batch and steps)", ""]
        for r in baselines:
            lines.append(f"- {r['config']}: {training_engine(r['engine']).states_held}; precision "
                         f"{r.get('precision')}.")
        if any(r.get("precision") != settings["precision"] for r in baselines):
            lines.append(f"- The baselines keep fp32 parameters and run the forward under bf16 autocast, while "
                         f"DeepSpeed's {settings['precision']} mode keeps {settings['precision']} weights with fp32 "
                         f"masters: their losses are not expected to agree with ZeRO-0 beyond bf16 precision.")
        if settings["precision"] == "autocast-bf16":
            lines.append("- DeepSpeed's autocast-bf16 runs the baselines' recipe (fp32 parameters, forward under bf16 "
                         "autocast) but reduces nn.Linear/Conv gradients in bf16, the baselines all in fp32: losses "
                         "agree with ZeRO-0 to bf16 precision.")
        lines.append("- Every run of this report trained without EMA (the baselines keep none). Adam's step counter "
                     "(4 bytes per tensor) is in the measured optimizer bytes, not in the expectation.")
    lines += ["", "## Loss agreement", ""]
    tol = LOSS_TOLERANCE.get(settings["precision"], 2e-2)
    flagged = [r["config"] for r in rows if r.get("loss_flag")]
    lines.append(f"Per-step losses vs stage 0, tolerance {tol:g} relative ({settings['precision']}): "
                 + (f"DISAGREE: {', '.join(flagged)}" if flagged else "all agree" if any(
                     "max_rel_loss_diff_vs_stage0" in r for r in rows) else "no stage 0 run to compare with"))
    return "\n".join(lines) + "\n"


def plot(rows, path):
    # matplotlib here, not at the top: its start-up, and without it only the plot is missing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows) + 2), 4.5))
    labels = [r["config"] for r in rows]
    bottom = [0.0] * len(rows)
    for kind, color in zip(KINDS, ("#4c72b0", "#dd8452", "#55a868")):
        vals = []
        for r in rows:
            v = r.get(f"{kind}_bytes_per_rank")
            vals.append((max(v) if isinstance(v, list) and v else 0) / 2**20)
        ax.bar(labels, vals, bottom=bottom, label={"param": "params", "grad": "grads", "optim": "optimizer"}[kind],
               color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        if r.get("error"):
            ax.text(i, 0, "failed", ha="center", va="bottom", color="red")
    ax.set_ylabel("model-state memory per rank (MiB)")
    ax.set_xlabel("configuration")
    ax2 = ax.twinx()
    xs = [i for i, r in enumerate(rows) if not r.get("error") and r.get("samples_per_sec")]
    ax2.plot(xs, [rows[i]["samples_per_sec"] for i in xs], "ko-", label="samples/s")
    ax2.set_ylabel("throughput (samples/s)")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.set_title(f"ZeRO stages: memory per rank and throughput ({len(ok)}/{len(rows)} ran)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(rows, out: str, settings: dict, psi: int | None, estimates: dict | None) -> None:
    os.makedirs(out, exist_ok=True)
    write_csv(rows, os.path.join(out, "report.csv"))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(rows, settings, psi, estimates))
    try:
        plot(rows, os.path.join(out, "report.png"))
    except ImportError as exc:  # the measured part (report.md, report.csv) is already written
        print(f"vim-ds zero-compare: report.png not written: {exc.name or 'matplotlib'} is missing "
              f"(pip install matplotlib)", file=sys.stderr)


# -- the command ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vim-ds zero-compare", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    add_model_kwargs(p, default=[], help=None, metavar="KEY=VALUE")
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--offload", action="store_true", help="also zero2_offload and zero3_offload")
    p.add_argument("--precision", choices=["bf16", "fp32", "autocast-bf16"], default="bf16")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="split each image's tokens over groups of N of the ranks (vim-ds train --sequence-parallel; "
                        "ZeRO still partitions over every rank); not with --baselines")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-size", type=int, default=224)
    p.add_argument("--nb-classes", type=int, default=1000)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--launcher", choices=["torchrun", "deepspeed"], default="torchrun")
    p.add_argument("--baselines", nargs="+", choices=baseline_names(), default=[],
                   help="also train with PyTorch DDP and/or FSDP2 (full sharding) under the same launcher, model, "
                        "optimizer, data and steps; all runs then train without EMA")
    p.add_argument("--lr", type=float, default=None, help="the trainer's --lr for every run [its default]")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help="the trainer's --warmup-epochs for every run [its default]; 0 trains at the full lr from "
                        "the first step, so that the loss comparison sees real updates")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration")
    p.add_argument("--out", required=True)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sequence_parallel < 1 or args.ranks % args.sequence_parallel:
        parser.error(f"--sequence-parallel {args.sequence_parallel} must be at least 1 and divide --ranks {args.ranks}")
    if args.sequence_parallel > 1 and args.baselines:
        parser.error("--baselines (DDP, FSDP) do not split the sequence: drop them with --sequence-parallel")
    return args


def _row_precision(engine, precision: str) -> str:
    """The precision a run's row names: the one its engine runs `precision` in, or `precision` where the engine
    refuses it (the run's error then says why)."""
    try:
        return engine.runs_precision(precision)
    except ValueError:
        return precision


def main(argv=None) -> int:
    args = parse_args(argv)
    refused = env_vars.refusal("vim-ds zero-compare")  # a VIM_DS_* variable it cannot read: one line
    if refused:
        return refused
    model_kwargs = dict(args.model_kwargs)
    os.makedirs(args.out, exist_ok=True)
    try:
        psi, largest, shapes = model_params(args.model, model_kwargs, args.input_size, args.nb_classes)
    except Exception as exc:  # noqa: BLE001 (the runs report the same error; the report says why no theory)
        print(f"vim-ds zero-compare: cannot build {args.model} to count its parameters: {first_line(exc)}",
              file=sys.stderr)
        psi, largest, shapes = None, 0, None
    warmup = 1 if args.steps > 1 else 0
    extra = [] if args.lr is None else ["--lr", args.lr]
    extra += [] if args.warmup_epochs is None else ["--warmup-epochs", args.warmup_epochs]
    # the baselines keep no EMA: time the same loop
    extra += ["--no-model-ema"] if args.baselines else []
    extra += ["--sequence-parallel", args.sequence_parallel] if args.sequence_parallel > 1 else []
    runs = [(name, stage, offload, DEFAULT_ENGINE, name) for name, stage, offload in configurations(args.stages,
                                                                                               args.offload)]
    # zero0.json: batch, AdamW, lr
    runs += [(engine, None, "-", engine, "zero0") for engine in args.baselines]
    rows, losses = [], {}
    # an earlier comparison's runs (metrics.jsonl is appended to), all checked before the first is removed: a folder
    # that is not one of them stops the comparison before anything is removed or trained
    run_dirs = [os.path.join(args.out, "runs", name) for name, *_ in runs]
    problem = next(filter(None, map(launched_runs.foreign_run_folder, run_dirs)), None)
    if problem:
        return report_error("vim-ds zero-compare", problem)
    for run_dir in run_dirs:
        launched_runs.clear_run_folder(run_dir)
    for name, stage, offload, engine, config in runs:
        kind = training_engine(engine)
        run_dir = os.path.join(args.out, "runs", name)
        print(f"[{name}] training ...", flush=True)
        res = launched_runs.run_train_config(config, nproc=args.ranks, launcher=args.launcher, model=args.model,
                               model_kwargs=model_kwargs, input_size=args.input_size, batch_size=args.batch_size,
                               steps=args.steps - warmup, warmup=warmup, precision=args.precision,
                               workers=args.num_workers, out_dir=run_dir, nb_classes=args.nb_classes,
                               timeout=args.timeout,
                               extra_args=extra + (["--engine", engine] if kind.baseline else []))
        row = {"config": name, "engine": engine, "stage": stage, "offload": offload, "ranks": args.ranks,
               "precision": _row_precision(kind, args.precision),
               "error": res.get("error")}
        summary, step_losses = read_run(run_dir)
        if not row["error"]:
            if summary is None or "param_bytes_per_rank" not in summary:
                row["error"] = "the run's summary has no model-state bytes"
            else:
                for k in ("param", "grad", "optim", "master"):
                    row[f"{k}_bytes_per_rank"] = summary.get(f"{k}_bytes_per_rank")
                peaks = summary.get("peak_memory_mb_per_rank") or []
                row["peak_mem_bytes"] = int(max(peaks) * 2**20) if peaks else None
                row["samples_per_sec"] = res.get("images_per_sec")
                row["final_loss"] = res.get("final_loss")
                losses[name] = step_losses
        print(f"[{name}] " + (f"FAILED: {row['error']}" if row["error"] else "done"), flush=True)
        rows.append(row)
    finish_rows(rows, losses, psi, shapes)
    estimates = deepspeed_estimates(psi, largest, args.ranks) if psi else None
    settings = dict(model=args.model, kwargs=" ".join(f"{k}={v}" for k, v in args.model_kwargs),
                    input_size=args.input_size, ranks=args.ranks, launcher=args.launcher, batch_size=args.batch_size,
                    steps=args.steps, precision=args.precision, sequence_parallel=args.sequence_parallel)
    write_report(rows, args.out, settings, psi, estimates)
    print(open(os.path.join(args.out, "report.md")).read())
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
