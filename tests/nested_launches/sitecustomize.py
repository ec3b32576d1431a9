"""Imported at the start of a command the suite runs with `preloaded.nested_env` (its PYTHONPATH names this folder):
the training runs that `vim_ds.engine.launched_runs` starts with torchrun are forked from the test's preloaded
server (tests/preloaded.py) instead of started as new interpreters, with the same command, environment and timeout,
and the same result (exit code, stdout, stderr). Every other command goes to the real launcher as before; the real
torchrun path of `launched_runs` keeps tests of its own (tests/test_zero_compare_baselines.py, test_bench_train.py)."""
import subprocess

import preloaded
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
