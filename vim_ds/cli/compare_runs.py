"""`vim-ds compare-runs` = `python -m vim_ds.compare_runs`: do training runs follow the reference run's loss curve?

    vim-ds compare-runs runs/reference runs/new_cluster [more runs...] [--tolerance 0.01] [--out compare/]

Each argument is a `vim-ds train --output_dir` or its metrics.jsonl. The first run is the reference; each other run
is compared with it over the optimizer steps both recorded: the largest and the mean relative loss difference per
step, the learning rate, the evaluation accuracies at the steps both evaluated, and the settings that differ
(ranks, ZeRO stage, device, versions: what one usually compares; reported, not refused). Runs of another global
batch train on other images at each step and are refused, as are runs without a common step.

Exit status: 0 when every run's largest relative loss difference is within --tolerance, 1 when one is not, 2 when
the runs cannot be compared (missing or malformed metrics, no common step, different global batch).
The `vim-ds train` options that differ between the reference and a run are named from each run's options.yaml
(`options that differ: --lr 0.002 (reference) vs 0.001 (run X)`): the options each run started with; a run resumed
with other options is named with the step each change took effect at (its options.yaml's `segments:`).
With --out, writes compare_runs.png (loss, relative difference and lr vs step), compare_runs.csv (per step) and
compare_runs.md (one markdown row per run).

Two runs agree step by step only if they start from the same weights (`vim-ds train --save-init-weights FILE` on
the reference, `--init-weights FILE` elsewhere), see the same global batch in the same order (vim_ds guarantees it
for any rank count and accumulation split) and use the same recipe; what remains is the numerics of kernels and
collectives: ~1e-7 in fp32 on one machine, ~1e-3 in bf16 over the first steps, growing slowly as the runs train.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from dataclasses import dataclass, field

from ..config.options_file import (
    NOT_PART_OF_THE_RUN,
    SEGMENTS_KEY,
    describe_segments,
    option_name,
    read,
    read_segments,
    same_value,
    shown,
)
from ..runtime.errors import first_line, report_error

PROG = "vim-ds compare-runs"
DEFAULT_TOLERANCE = 0.01
# settings shown when they differ from the reference's (global_batch must be equal)
SHOWN = ("world_size", "micro_batch", "accum_steps", "zero_stage", "precision", "seed", "lr", "model", "model_kwargs",
         "input_size", "num_classes", "train_images", "device_type", "device_name", "accelerator_runtime", "vim_ds",
         "torch", "deepspeed", "timm")
EVAL_KEYS = ("eval_acc1", "eval_acc5", "ema_eval_acc1")
OPTIONS_FILE = "options.yaml"  # vim_ds.config.options_file.OPTIONS_FILE, beside metrics.jsonl


class RunError(ValueError):
    """The runs cannot be compared (exit 2)."""


@dataclass
class Run:
    path: str                       # the metrics.jsonl
    label: str
    header: dict | None = None      # the first header record (a resumed run appends more)
    # step -> loss (a resumed run's later record of a step wins)
    losses: dict = field(default_factory=dict)
    lrs: dict = field(default_factory=dict)      # step -> lr
    evals: dict = field(default_factory=dict)    # step -> evaluation record
    global_batch: int | None = None
    # the run's options.yaml (`vim-ds train` writes it), None without one: the options it started with; a run
    # resumed with other options records the later ones in segments
    options: dict | None = None
    # [{"from_step": N, "options": {changed}}], in order
    segments: list = field(default_factory=list)

    def describe(self) -> str:
        h = self.header or {}
        steps = f"{len(self.losses)} steps ({min(self.losses)}-{max(self.losses)})"
        if not h:
            return f"{steps}; no header record (a run from before vim_ds recorded its settings)"
        init = f", init {h['init_weights_sha256'][:12]}" if h.get("init_weights_sha256") else ""
        return (f"{h.get('world_size')} rank(s) x {h.get('micro_batch')} x {h.get('accum_steps')} accum = global "
                f"batch {h.get('global_batch')}, ZeRO-{h.get('zero_stage')} {h.get('precision')}, "
                f"{h.get('device_type')} ({h.get('device_name')}){init}; {steps}")


def metrics_path(path: str) -> str:
    return os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path


def _float(value, where: str) -> float:
    try:
        return float(value)  # the trainer writes NaN/inf as strings, which float() reads back
    except (TypeError, ValueError):
        raise RunError(f"{where}: {value!r} is not a number") from None


def read_run(path: str, label: str) -> Run:
    file = metrics_path(path)
    if not os.path.isfile(file):
        raise RunError(f"{path}: no metrics.jsonl there (pass a `vim-ds train --output_dir` or its metrics.jsonl)"
                       if os.path.isdir(path) else f"{path}: no such file")
    run = Run(file, label)
    summary_batch = None
    try:
        with open(file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{file}: cannot read it ({exc})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file} line {n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # no newline after it: the line a live run is writing
                continue
            raise RunError(f"{where}: not JSON ({exc.msg}); is this a vim-ds metrics.jsonl?") from None
        if not isinstance(r, dict):
            raise RunError(f"{where}: not a JSON object; is this a vim-ds metrics.jsonl?")
        if r.get("header"):
            if run.header is None:
                run.header = r
            elif r.get("global_batch") != run.header.get("global_batch"):
                raise RunError(f"{where}: the run was resumed with global batch {r.get('global_batch')}, it started "
                               f"with {run.header.get('global_batch')}")
        elif r.get("summary"):
            summary_batch = r.get("global_batch", summary_batch)
        elif "eval_acc1" in r:
            if r.get("step") is not None:
                run.evals[int(r["step"])] = r
        elif "loss" in r:
            if not isinstance(r.get("step"), int):
                raise RunError(f"{where}: a loss record without an integer step")
            run.losses[r["step"]] = _float(r["loss"], where)
            if "lr" in r:
                run.lrs[r["step"]] = _float(r["lr"], where)
    if not run.losses:
        raise RunError(f"{file}: no training step recorded")
    run.global_batch = (run.header or {}).get("global_batch", summary_batch)
    run.options = read_options(os.path.join(os.path.dirname(file), OPTIONS_FILE))
    if run.options is not None:
        where = os.path.join(os.path.dirname(file), OPTIONS_FILE)
        try:
            run.segments = read_segments(run.options, where)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        run.options = {k: v for k, v in run.options.items() if k != SEGMENTS_KEY}
    return run


def read_options(path: str) -> dict | None:
    """A run's recorded `vim-ds train` options, or None when it has none (a run from before vim_ds wrote them)."""
    if not os.path.isfile(path):
        return None

    try:
        return read(path)
    except ValueError as exc:
        raise RunError(str(exc).replace("--config ", "", 1)) from None


def option_differences(ref: Run, run: Run) -> list[str]:
    """`--lr 0.002 (reference) vs 0.001 (run X)` for each `vim-ds train` option the two runs' options.yaml set to
    different values. Options that change how or where a run runs, not what it computes (--output_dir, which tells
    runs apart, --resume, --num_workers, ...: options_file.NOT_PART_OF_THE_RUN, which a resume does not count
    either) are left out, and two spellings of one file (a relative and an absolute path, a shipped DeepSpeed
    config's name and its path) are the same value."""
    if ref.options is None or run.options is None:
        return []

    keys = list(ref.options) + [k for k in run.options if k not in ref.options]
    return [f"{option_name(k)} {shown(ref.options.get(k))} (reference) vs {shown(run.options.get(k))} "
            f"({run.label})" for k in keys
            if k not in NOT_PART_OF_THE_RUN and not same_value(k, ref.options.get(k), run.options.get(k))]


def rel_diff(reference: float, value: float) -> float:
    if math.isnan(reference) and math.isnan(value) or reference == value:
        return 0.0  # equal, NaN and inf included: both runs hit the same bad step
    if not (math.isfinite(reference) and math.isfinite(value)):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def compare(ref: Run, run: Run, tolerance: float) -> dict:
    if ref.global_batch is not None and run.global_batch is not None and ref.global_batch != run.global_batch:
        raise RunError(f"{run.label} trained with a global batch of {run.global_batch}, {ref.label} with "
                       f"{ref.global_batch}: each step saw other images, the losses cannot be compared step by step")
    common = sorted(set(ref.losses) & set(run.losses))
    if not common:
        raise RunError(f"{run.label} (steps {min(run.losses)}-{max(run.losses)}) and {ref.label} (steps "
                       f"{min(ref.losses)}-{max(ref.losses)}) share no step")
    diffs = {s: rel_diff(ref.losses[s], run.losses[s]) for s in common}
    worst = max(common, key=lambda s: diffs[s])
    lr_steps = [s for s in common if s in ref.lrs and s in run.lrs]
    lr_diff = max((rel_diff(ref.lrs[s], run.lrs[s]) for s in lr_steps), default=None)
    evals = []
    for s in sorted(set(ref.evals) & set(run.evals)):
        values = {}
        for key in EVAL_KEYS:
            a, b = ref.evals[s].get(key), run.evals[s].get(key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                values[key] = (a, b, b - a)  # reference, run, difference (percentage points)
        evals.append({"step": s, "values": values})
    notes = []
    h_ref, h_run = ref.header or {}, run.header or {}
    if ref.global_batch is None or run.global_batch is None:
        notes.append("global batch not recorded by " + " and ".join(
            r.label for r in (ref, run) if r.global_batch is None) + ": cannot check that both saw the same images")
    differs = [(k, h_ref.get(k), h_run.get(k)) for k in SHOWN
               if h_ref and h_run and h_ref.get(k) != h_run.get(k)]
    a, b = h_ref.get("init_weights_sha256"), h_run.get("init_weights_sha256")
    if a and b and a != b:
        notes.append(f"initial weights differ (--init-weights sha256 {a[:12]} vs {b[:12]}): expect different curves")
    elif not (a and b):
        unpinned = [r.label for r, h in ((ref, a), (run, b)) if not h]
        notes.append(f"initial weights not pinned in {' and '.join(unpinned)} (no --init-weights/--save-init-weights):"
                     f" they agree only if both vendors' RNGs drew the same weights from the seed")
    p_ref, p_run = h_ref.get("precision"), h_run.get("precision")
    if p_ref and p_run and p_ref != p_run:
        notes.append(f"the precisions differ ({p_ref} vs {p_run}): expect differences of half-precision "
                     f"rounding, not of fp32's")
    unrecorded = [r.label for r in (ref, run) if r.options is None]
    # both without: runs from before vim_ds recorded options, nothing to add
    if len(unrecorded) == 1:
        notes.append(f"no {OPTIONS_FILE} in {unrecorded[0]} (a run from before vim_ds recorded its "
                     f"options): the options are not compared")
    for r in (ref, run):
        if r.segments:
            notes.append(f"{r.label} was resumed with other options ("
                         f"{'; '.join(describe_segments(r.options or {}, r.segments))}); "
                         f"`options that differ` compares the options each run started with")
    if lr_diff is not None and lr_diff > 1e-6:
        notes.append(f"the learning rates differ (max relative difference {lr_diff:.2e}): another recipe")
    return {"label": run.label, "steps": common, "diffs": diffs, "max_rel": diffs[worst], "max_step": worst,
            "mean_rel": sum(diffs.values()) / len(common), "lr_rel": lr_diff, "evals": evals, "differs": differs,
            "notes": notes, "within": diffs[worst] <= tolerance, "options": option_differences(ref, run),
            "only_ref": len(set(ref.losses) - set(common)), "only_run": len(set(run.losses) - set(common))}


def _steps(steps: list[int]) -> str:
    return f"{len(steps)} common step{'s' if len(steps) != 1 else ''} ({steps[0]}-{steps[-1]})"


def report(ref: Run, runs: list[Run], results: list[dict], tolerance: float) -> str:
    lines = [f"reference {ref.label}: {ref.describe()}"]
    for run, res in zip(runs, results):
        extra = [f"{n} only in {label}" for n, label in ((res["only_ref"], ref.label), (res["only_run"], run.label))
                 if n]
        lines.append(f"{run.label} vs {ref.label}: {_steps(res['steps'])}" + ("; " + ", ".join(extra) if extra else ""))
        lines.append(f"  run: {run.describe()}")
        lr = "" if res["lr_rel"] is None else f"; lr max rel diff {res['lr_rel']:.2e}"
        worst = res["max_step"]
        lines.append(f"  loss: max rel diff {res['max_rel']:.2e} (step {worst}: {ref.losses[worst]:.6g} vs "
                     f"{run.losses[worst]:.6g}), mean {res['mean_rel']:.2e}{lr}")
        for row in res["evals"]:
            parts = [f"{key.replace('eval_', '')} {a:.2f} vs {b:.2f} ({d:+.2f})"
                     for key, (a, b, d) in row["values"].items()]
            lines.append(f"  eval step {row['step']}: " + ", ".join(parts))
        if not res["evals"]:
            lines.append("  eval: no evaluation at a common step")
        if res["differs"]:
            lines.append("  differs (reported, not refused): "
                         + ", ".join(f"{k} {a} vs {b}" for k, a, b in res["differs"]))
        if res["options"]:
            lines.append("  options that differ: " + "; ".join(res["options"]))
        for note in res["notes"]:
            lines.append(f"  warning: {note}")
        verdict = "within" if res["within"] else "OUTSIDE"
        lines.append(f"  verdict: {verdict} tolerance {tolerance:g} (max rel loss diff {res['max_rel']:.2e})")
    bad = [res["label"] for res in results if not res["within"]]
    lines.append(f"all {len(results)} run(s) agree with {ref.label} within {tolerance:g}" if not bad else
                 f"{len(bad)} of {len(results)} run(s) differ from {ref.label} beyond {tolerance:g}: {', '.join(bad)}")
    return "\n".join(lines)


def markdown(ref: Run, runs: list[Run], results: list[dict], tolerance: float) -> str:
    lines = [f"Reference: `{ref.label}`: {ref.describe()}", "",
             "| run | common steps | max rel loss diff (step) | mean rel loss diff | lr max rel diff | "
             "last common eval acc1 (diff) | differs | verdict |", "|---|---|---|---|---|---|---|---|"]
    for run, res in zip(runs, results):
        ev = next((row for row in reversed(res["evals"]) if "eval_acc1" in row["values"]), None)
        acc = f"{ev['values']['eval_acc1'][1]:.2f} ({ev['values']['eval_acc1'][2]:+.2f}) @ {ev['step']}" if ev else "-"
        lr = "-" if res["lr_rel"] is None else f"{res['lr_rel']:.2e}"
        differs = ", ".join(f"{k} {a} → {b}" for k, a, b in res["differs"]) or "-"
        lines.append(f"| `{run.label}` | {len(res['steps'])} ({res['steps'][0]}-{res['steps'][-1]}) | "
                     f"{res['max_rel']:.2e} ({res['max_step']}) | {res['mean_rel']:.2e} | {lr} | {acc} | {differs} | "
                     f"{'within' if res['within'] else 'OUTSIDE'} {tolerance:g} |")
    notes = [f"- `{res['label']}`: {note}" for res in results for note in res["notes"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write_csv(path: str, ref: Run, runs: list[Run], results: list[dict]):
    everyone = [ref] + runs
    steps = sorted(set().union(*(r.losses for r in everyone)))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"{r.label}:{kind}" for r in everyone for kind in ("loss", "lr")]
                   + [f"{res['label']}:rel_diff" for res in results])
        for s in steps:
            w.writerow([s] + [v for r in everyone for v in (r.losses.get(s, ""), r.lrs.get(s, ""))]
                       + [res["diffs"].get(s, "") for res in results])


def plot(path: str, ref: Run, runs: list[Run], results: list[dict], tolerance: float):
    # matplotlib here, not at the top: its start-up, and without it only the plot is missing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_lr) = plt.subplots(3, 1, figsize=(8, 9), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 2, 1.5]})
    for i, r in enumerate([ref] + runs):
        steps = sorted(r.losses)
        style = {"linewidth": 2.5, "alpha": 0.6} if i == 0 else {"linewidth": 1, "linestyle": "--"}
        ax_loss.plot(steps, [r.losses[s] for s in steps], label=r.label + (" (reference)" if i == 0 else ""), **style)
        lr_steps = sorted(r.lrs)
        ax_lr.plot(lr_steps, [r.lrs[s] for s in lr_steps], **style)
    for res in results:
        steps = res["steps"]
        ax_diff.plot(steps, [max(res["diffs"][s], 1e-12) for s in steps], marker=".", label=res["label"])
    ax_diff.axhline(tolerance, color="red", linestyle=":", label=f"tolerance {tolerance:g}")
    ax_diff.set_yscale("log")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=8)
    ax_loss.set_title(f"loss curves vs {ref.label}")
    ax_diff.set_ylabel("|rel. loss diff|")
    ax_diff.legend(fontsize=8)
    ax_lr.set_ylabel("lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0), useOffset=False)
    ax_lr.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def labels_for(paths: list[str]) -> list[str]:
    """A short name per run: its directory's name, the path itself where two would look alike."""
    short = []
    for p in paths:
        directory = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
        short.append(os.path.basename(os.path.normpath(directory)) or p)
    return [s if short.count(s) == 1 else p for s, p in zip(short, paths)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[3:]))
    p.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_METRICS",
                   help="the reference run first, then the runs to check against it")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="largest relative loss difference per step accepted (default %(default)g)")
    p.add_argument("--out", default="", help="write compare_runs.png/.csv/.md into this directory")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two runs: the reference first, then the runs to compare with it")
    if not args.tolerance >= 0:
        p.error(f"--tolerance must be 0 or more, got {args.tolerance}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = [read_run(path, label) for path, label in zip(args.runs, labels_for(args.runs))]
        ref, others = runs[0], runs[1:]
        results = [compare(ref, run, args.tolerance) for run in others]
    except RunError as exc:
        return report_error(PROG, exc)
    print(report(ref, others, results, args.tolerance), flush=True)
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "compare_runs.md"), "w") as f:
                f.write(markdown(ref, others, results, args.tolerance))
            write_csv(os.path.join(args.out, "compare_runs.csv"), ref, others, results)
        except OSError as exc:
            return report_error(PROG, f"cannot write to {args.out}: {first_line(exc)}")
        try:
            plot(os.path.join(args.out, "compare_runs.png"), ref, others, results, args.tolerance)
        except ImportError as exc:  # the numbers (stdout, .md, .csv) are already out
            print(f"{PROG}: compare_runs.png not written: {exc.name or 'matplotlib'} is missing "
                  f"(pip install matplotlib)", file=sys.stderr)
    return 0 if all(res["within"] for res in results) else 1


if __name__ == "__main__":
    sys.exit(main())
