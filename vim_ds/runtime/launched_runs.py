"""Runs of the real trainer started by a real launcher (torchrun or deepspeed) as a child process group, for the
commands that measure training (`vim-ds bench train`, `vim-ds zero-compare`): DeepSpeed config names, the launcher
command line, the launcher's process group, its one-line error, and the summary of its metrics.jsonl."""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

from .errors import first_line
from .ports import free_port

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_config(config: str) -> tuple[str, str]:
    """(label, absolute path) of a `--configs` entry: a name in ds_configs/ (`zero2`) or a path to a JSON file."""
    if os.path.isfile(config):
        return os.path.splitext(os.path.basename(config))[0], os.path.abspath(config)
    if config.endswith(".json") or os.sep in config:
        raise FileNotFoundError(f"DeepSpeed config {config}: no such file")
    dirs = [os.path.join(os.getcwd(), "ds_configs"), os.path.join(REPO_DIR, "ds_configs")]
    for d in dirs:
        if os.path.isfile(os.path.join(d, config + ".json")):
            return config, os.path.abspath(os.path.join(d, config + ".json"))
    names = sorted({f[:-5] for d in dirs if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".json")})
    raise FileNotFoundError(f"unknown DeepSpeed config {config!r}: no such file, and not a name in ds_configs/ "
                            f"({', '.join(names) or 'none found'})")


def describe_config(path: str) -> dict:
    """What the JSON file itself says: ZeRO stage, what is offloaded, its precision, a fixed accumulation. Only
    for labelling and sizing: the trainer checks the file and reports what is wrong with it."""
    with open(path) as f:
        cfg = json.load(f)

    def section(node, key):
        value = node.get(key) if isinstance(node, dict) else None
        return value if isinstance(value, dict) else {}

    zero = section(cfg, "zero_optimization")
    offloaded = [what for what in ("optimizer", "param")
                 if str(section(zero, f"offload_{what}").get("device", "none")).lower() not in ("none", "")]
    enabled = {k: section(cfg, k).get("enabled") is True for k in ("fp16", "bf16", "torch_autocast")}
    stage = zero.get("stage", 0)
    accum = cfg.get("gradient_accumulation_steps") if isinstance(cfg, dict) else None
    return {"stage": stage if isinstance(stage, int) else None, "offload": "+".join(offloaded) or "-",
            "file_precision": "fp16" if enabled["fp16"] else "bf16" if enabled["bf16"] else
            "autocast-bf16" if enabled["torch_autocast"] else "fp32",
            "accum": accum if isinstance(accum, int) and accum > 0 else 1}


def synthetic_size(global_batch: int, total_steps: int) -> int:
    """Training images for `total_steps` optimizer steps with one spare global batch, so that the epoch cannot end
    during the timed steps. The trainer's synthetic validation set is a tenth of this: the final evaluation is
    small."""
    return global_batch * (total_steps + 1)


def launcher_command(nproc: int, launcher: str) -> list[str]:
    """The command that starts `nproc` trainer processes on this machine."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "vim_ds.train"]
    if launcher == "deepspeed":  # the `deepspeed` script, run by this interpreter
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
                "--master_port", str(free_port()), "--module", "vim_ds.train"]
    raise ValueError(f"unknown launcher {launcher!r}: choose torchrun or deepspeed")


def train_arguments(config_path: str, *, nproc: int, model: str, model_kwargs: dict, input_size: int,
                    batch_size: int, steps: int, warmup: int, precision: str | None, workers: int, out_dir: str,
                    nb_classes: int = 1000, extra_args=()) -> list[str]:
    """`vim_ds.train` options for a benchmark run: synthetic data, steps + warmup optimizer steps inside one
    epoch, evaluation only at the end, EMA on (it is part of the training loop)."""
    total = steps + warmup
    global_batch = batch_size * nproc * describe_config(config_path)["accum"]
    argv = ["--deepspeed_config", config_path, "--data-set", "synthetic",
            "--synthetic-size", str(synthetic_size(global_batch, total)), "--nb-classes", str(nb_classes),
            "--model", model, "--input-size", str(input_size), "--batch-size", str(batch_size),
            "--epochs", "1", "--max-steps", str(total), "--num_workers", str(workers), "--model-ema",
            "--output_dir", out_dir, "--log-interval", str(max(1, total // 4))]
    if precision:
        argv += ["--precision", precision]
    if model_kwargs:
        argv += ["--model-kwargs", *[f"{k}={v}" for k, v in model_kwargs.items()]]
    return argv + [str(a) for a in extra_args]


def _run_group(cmd: list[str], timeout: float | None, env: dict) -> tuple[int | None, str, str]:
    """Run a launcher in its own process group; on a timeout or Ctrl-C end that group (its ranks too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)

    def end_group():
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        end_group()
        out, err = proc.communicate()
        return None, out, err
    except BaseException:
        end_group()
        raise


def error_line(stderr: str, returncode: int | None) -> str:
    """The trainer's one-line error (`vim-ds train: error ...`, rank 0's first), else the last exception line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    mine = [line for line in lines if line.startswith("vim-ds train: error")]
    if mine:
        return next((line for line in mine if "(rank 0)" in line), mine[0])
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return line
    return f"the launcher exited with status {returncode} (no error line; see the run's train.log)"


def _float(value):
    try:
        return float(value)  # metrics.jsonl writes NaN/inf as strings
    except (TypeError, ValueError):
        return None


def summarise_metrics(path: str, warmup: int) -> dict:
    """Throughput, memory and loop overhead of one run from its metrics.jsonl.

    images_per_sec  global batch x timed steps / their summed step_time (steps after the first `warmup`)
    loop_overhead   from the trainer's summary: the fraction of loop time spent outside the engine's
                    forward/backward/step (data wait + bookkeeping), over all steps of the run, warmup included
    step_time_sum   all steps' step_time; compared with the summary's data_time + compute_time it shows loop time
                    that the summary puts in none of its buckets
    """
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "loss" in r and "summary" not in r and "eval_acc1" not in r]
    evals = [r for r in records if "eval_acc1" in r]
    summary = next((r for r in reversed(records) if r.get("summary")), None)
    timed = [r for r in steps if r["step"] > warmup]
    if not timed:
        raise ValueError(f"{path} has {len(steps)} step records, none after the {warmup} warmup steps")
    if summary is None:
        raise ValueError(f"{path} has no summary record: the run did not finish")
    global_batch = summary["global_batch"]
    seconds = sum(r["step_time"] for r in timed)
    peaks = summary.get("peak_memory_mb_per_rank") or []
    world = summary.get("world_size") or 1
    ips = global_batch * len(timed) / seconds if seconds > 0 else None
    return {
        "stage": summary.get("zero_stage"), "precision": summary.get("precision"), "ranks": world,
        "device": summary.get("device"), "global_batch": global_batch, "steps_timed": len(timed),
        "images_per_sec": ips, "images_per_sec_per_rank": ips / world if ips else None,
        "median_samples_per_sec": statistics.median(r["samples_per_sec"] for r in timed),
        "median_step_time": statistics.median(r["step_time"] for r in timed),
        "first_step_time": steps[0]["step_time"],
        "peak_memory_mb_per_rank": peaks, "peak_memory_mb_max": max(peaks) if peaks else None,
        "loop_overhead": summary.get("loop_overhead"), "data_time": summary.get("data_time"),
        "compute_time": summary.get("compute_time"), "other_time": summary.get("other_time"),
        "step_time_sum": sum(r["step_time"] for r in steps),
        "final_loss": _float(steps[-1]["loss"]),
        "eval_acc1": evals[-1]["eval_acc1"] if evals else None,
    }


LOG = "train.log"  # the launcher's command line, exit status and output, in each run's folder


def _write_log(out_dir: str, cmd: list[str], rest: str) -> None:
    with open(os.path.join(out_dir, LOG), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{rest}")


def foreign_run_folder(out_dir: str) -> str | None:
    """Why `out_dir` must not be removed to make room for a run, in one line, or None (nothing there, or the folder
    of an earlier run `run_train_config` launched: its train.log, `$ COMMAND` then `# ...`). Anything else is a
    user's folder (a training run of theirs, notes) and is never removed."""
    if not os.path.lexists(out_dir):
        return None
    try:
        with open(os.path.join(out_dir, LOG)) as f:
            ours = f.readline().startswith("$ ") and f.readline().startswith("# ")
    except (OSError, UnicodeDecodeError):
        ours = False
    if ours and not os.path.islink(out_dir):
        return None
    return (f"{out_dir} exists and is not a run this command launched (no {LOG} of one): it is never removed; give "
            f"another folder, or move it away")


def clear_run_folder(out_dir: str) -> None:
    """Remove the folder of an earlier launched run (its metrics.jsonl would be appended to); `foreign_run_folder`
    must have said None."""
    if os.path.lexists(out_dir):
        shutil.rmtree(out_dir)


def run_train_config(config: str, *, nproc: int, launcher: str, model: str, model_kwargs: dict, input_size: int,
                     batch_size: int, steps: int, warmup: int, precision: str | None, workers: int, out_dir: str,
                     nb_classes: int = 1000, extra_args=(), timeout: float | None = None) -> dict:
    """Train with one DeepSpeed config through a real launcher and summarise its metrics; never raises for a
    failed run: the row then has an "error" (one line) and the launcher's output is in OUT_DIR/train.log."""
    row = {"config": config, "launcher": launcher, "ranks": nproc, "model": model, "precision": precision}
    try:
        label, path = resolve_config(config)
        row.update(config=label, config_path=path, **describe_config(path))
        if precision is None:
            row["precision"] = row["file_precision"]
        cmd = launcher_command(nproc, launcher) + train_arguments(
            path, nproc=nproc, model=model, model_kwargs=model_kwargs, input_size=input_size, batch_size=batch_size,
            steps=steps, warmup=warmup, precision=precision, workers=workers, out_dir=out_dir,
            nb_classes=nb_classes, extra_args=extra_args)
    except (OSError, ValueError) as exc:  # unknown name, unreadable or invalid JSON
        return {**row, "error": first_line(exc)}
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the folder's mark as one of these runs (see clear_run_folder) from the start: a run killed midway has it too
    _write_log(out_dir, cmd, "# running")
    start = time.perf_counter()
    returncode, out, err = _run_group(cmd, timeout, env)
    row["wall_s"] = time.perf_counter() - start
    _write_log(out_dir, cmd, f"# exit status {returncode}\n--- stdout\n{out}\n--- stderr\n{err}")
    if returncode is None:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    if returncode != 0:
        return {**row, "error": error_line(err, returncode)}
    try:
        row.update(summarise_metrics(os.path.join(out_dir, "metrics.jsonl"), warmup))
    except (OSError, ValueError, KeyError) as exc:
        row["error"] = f"cannot read the run's metrics: {first_line(exc)}"
    return row

