"""Imported at the start of a command the suite runs with `preloaded.nested_env` (its PYTHONPATH names this folder):
the vim_ds commands it starts itself are forked from the test's preloaded server (tests/preloaded.py) instead of
started as new interpreters, with the same command and environment and the same result (exit code, stdout,
stderr): the training runs that `vim_ds.runtime.launched_runs` starts with torchrun (`vim-ds zero-compare`), and the
`ds_to_universal` conversion a resumed run starts (`vim_ds.engine.checkpointing`). Every other command is started as
before; the real paths keep tests of their own (`launched_runs` with the real torchrun: the lr control of
tests/test_zero_compare_baselines.py; the conversion as a real process: `vim-ds convert --universal` in
tests/faults/test_convert_faults.py and test_untrusted_files.py, and the control of tests/test_resume_exact.py)."""
import os
import subprocess

import preloaded
import vim_ds.engine.checkpointing as checkpointing
import vim_ds.runtime.launched_runs as launched_runs

_real_run_group = launched_runs._run_group


def _run_group(cmd, timeout, env):
    if preloaded.parse_command(cmd) is None:
        return _real_run_group(cmd, timeout, env)
    try:
        proc = preloaded.run(cmd, timeout=timeout, env=preloaded.outer_env(env), capture_output=True, text=True)
    except subprocess.TimeoutExpired as stopped:  # preloaded.run has stopped it
        return None, stopped.stdout, stopped.stderr
    return proc.returncode, proc.stdout, proc.stderr


def _start_in_session(cmd):
    return preloaded.popen(cmd, env=preloaded.outer_env(dict(os.environ)), start_new_session=True)


launched_runs._run_group = _run_group
checkpointing._start_in_session = _start_in_session
