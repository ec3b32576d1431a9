"""A training (or, with --eval, evaluation) run from its RunConfig to an exit code: the one library call of
`vim-ds train` and `vim-ds eval` (which parse argv into the config: cli/run_options.parse_config), and of a
program that makes the config in code (docs/python_api.md); one-line errors and non-zero exit codes (2: bad input;
1: the run failed; 128 + N: stopped by signal N, state saved)."""
from __future__ import annotations

import os

from ..checkpoint.files import CheckpointError
from ..config import options_file
from ..config.run_config import RunConfig
from ..config.run_rules import validate
from ..data.loader import DataStall
from ..runtime import build_tools, cuda_arch, distributed, launcher_watch, signals, versions, write_journal
from ..runtime.env_vars import refusal
from ..runtime.errors import first_line, report_error
from ..runtime.signals import StopRequested
from . import output_dir, preflight
from .checkpointing import SaveError
from .evaluate import evaluate_weights
from .parts import build_datasets, build_trainer
from .trainer import TrainingError


def run(config: RunConfig, prog: str = "vim-ds train") -> int:
    """Train, or with `config.run.eval` evaluate, the run `config` describes; `prog` names the command in its
    messages. A config that breaks a rule between options (run_rules.validate; the command line refuses such a
    config before) ends here in the same one line, exit 2."""
    rank = os.environ.get("RANK", "0")
    # a torch or DeepSpeed too old (each rank of a launcher, `python -m vim_ds.train`): before DeepSpeed starts
    unsupported = versions.unsupported()
    if unsupported:
        return report_error(prog, unsupported, rank=rank)
    # a VIM_DS_* variable it cannot read: said before anything starts, on every rank (however it was launched)
    refused = refusal(prog, rank=rank)
    if refused:
        return refused
    problem = validate(config)
    if problem:
        return report_error(prog, problem, rank=rank)
    # found first: see its start below
    launchers = None if config.run.eval else launcher_watch.LauncherWatch()
    # as parsed, before the checks resolve any name
    options = options_file.record(config)
    # before deepspeed.initialize JIT-builds an op (cpu_adam, FusedAdam on a GPU): an arch
    # list its builder can parse, and the ninja installed beside this Python (over ssh it may not be on PATH)
    for note in (cuda_arch.readable_by_deepspeed(os.environ), build_tools.interpreter_ninja_first(os.environ)):
        if note and rank == "0":
            print(note, flush=True)
    # what the command line names, checked by every rank before the process group and DeepSpeed start
    try:
        config = preflight.check(config, is_main=rank == "0")
    except (ValueError, CheckpointError) as exc:
        return report_error(prog, exc, rank=rank)
    # what runs where the DeepSpeed config and the command line both set a value
    options = options_file.with_settled(options, config)
    try:
        dist_info = distributed.setup(config.run.local_rank, config.run.dist_timeout)
    except Exception as exc:  # noqa: BLE001 - a launcher/environment problem: say it in one line
        # what it waited for and what bounded the wait: a node that never starts (or cannot reach the master) ends
        # here after --dist-timeout, as torch's TCPStore times out waiting for the other ranks to join
        env = os.environ
        return report_error(prog, f"cannot initialise the process group ({env.get('WORLD_SIZE', '?')} ranks "
                                  f"meeting at {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}, "
                                  f"--dist-timeout {config.run.dist_timeout:g} s): {first_line(exc)}", rank=rank)
    trainer = None
    # what the run writes until its first step (its folder's claim, options.yaml, metrics.jsonl, ...): taken back
    # below unless it ends as it should (trained, or stopped by a signal)
    write_journal.start()
    ended_well = False
    try:
        if config.run.eval:
            evaluate_weights(config, dist_info, build_datasets(config, train=False))
            ended_well = True
            return 0
        # SIGTERM/SIGINT from here on: save and stop (see runtime/signals.py)
        signals.install(dist_info.is_main)
        # and the same when the launcher is gone
        launchers.start(prog, dist_info.rank, dist_info.local_rank)
        # no other run's checkpoints, no second live run
        output_dir.claim(config, dist_info)
        trainer = build_trainer(config, dist_info)
        resuming = bool(trainer.parts.resume_path)
        if resuming:
            trainer.resume(trainer.parts.resume_path)
        # `--config OUTPUT_DIR/options.yaml` starts this run again; a resume with other options adds a segment to
        # it (from which step they ran), said in a note; a run refused before its first step puts it back as it was
        if dist_info.is_main and config.run.output_dir:
            note = options_file.write_run(os.path.join(config.run.output_dir, options_file.OPTIONS_FILE), options,
                                          step=trainer.state.progress.step if resuming else None)
            if note:
                print(note, flush=True)
        record = trainer.fit()
        if record and dist_info.is_main:
            ema = f", EMA {record['ema_eval_acc1']:.2f}%" if "ema_eval_acc1" in record else ""
            print(f"validation top-1 {record['eval_acc1']:.2f}% top-5 {record['eval_acc5']:.2f}%{ema} "
                  f"on {record['eval_images']} images after {trainer.state.progress.step} steps", flush=True)
        ended_well = True
        return 0
    except StopRequested as stop:
        # what a shell reports for the signal: stopped early, on purpose, state saved
        ended_well = True
        return 128 + stop.signum
    except (ValueError, CheckpointError, TrainingError, SaveError, OSError, RuntimeError) as exc:
        # 1: the run failed; 2: bad input
        code = 1 if isinstance(exc, (TrainingError, SaveError, DataStall)) else 2
        return report_error(prog, exc, code=code, rank=dist_info.rank)
    finally:
        if trainer is not None:
            trainer.close()
        if not ended_well:
            # refused or failed before its first step: every folder as it was (nothing, once it has trained a
            # step); the lock file it created is removed while still held
            write_journal.undo()
        output_dir.release()
        distributed.teardown()
