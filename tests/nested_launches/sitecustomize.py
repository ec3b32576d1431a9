"""Imported at the start of a command the suite runs with `preloaded.nested_env` (its PYTHONPATH names this folder):
the vim_ds commands it starts itself are forked from the test's preloaded server (tests/preloaded.py) instead of
started as new interpreters, with the same command and environment and the same result (exit code, stdout,
stderr): the training runs that `vim_ds.engine.launched_runs` starts with torchrun (`vim-ds zero-compare`), and the
`ds_to_universal` conversion a resumed run starts (`vim_ds.engine.checkpointing`). Every other command is started as
before; the real paths keep tests of their own (zero-compare with torchrun: tests/test_zero_compare_baselines.py and
test_bench_train.py; the conversion as a real process: `vim-ds convert --universal` in
tests/faults/test_convert_faults.py and test_untrusted_files.py, and the control of tests/test_resume_exact.py)."""
import os
import subprocess

import preloaded
import vim_ds.engine.checkpointing as checkpointing
import vim_ds.engine.launched_runs as launched_runs

_real_run_group = launched_runs._run_group


def _run_group(cmd, timeout, env):
    parsed = preloaded.parse_command(cmd)
    if parsed is None:
        return _real_run_group(cmd, timeout, env)
    proc = preloaded.Process(*parsed, env=preloaded.outer_env(env), new_session=True)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return (None, *proc.output())
    return (proc.returncode, *proc.output())


launched_runs._run_group = _run_group


_real_start_in_session = checkpointing._start_in_session


def _start_in_session(cmd):
    parsed = preloaded.parse_command(cmd)
    if parsed is None:
        return _real_start_in_session(cmd)
    return preloaded.Process(*parsed, env=preloaded.outer_env(dict(os.environ)), new_session=True)


checkpointing._start_in_session = _start_in_session
