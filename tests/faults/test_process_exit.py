"""A rank process's exit code is its run's, whatever the interpreter's finalisation would do.

gloo's threads outlive destroy_process_group() and are torn down in the interpreter's finalisation, where a rank
once aborted (SIGABRT, "terminate called without an active exception") after a 2-rank ZeRO-3 run had finished and
saved everything, and torchrun reported the job as failed (vim_ds.runtime.distributed.end_rank_process). That race
cannot be started on demand, so a stand-in crashes every rank's finalisation for sure: a `sitecustomize` module
that registers os.abort with atexit in each rank process (LOCAL_RANK set by torchrun; the launcher's own process
is left alone). vim-ds train and eval end the process before finalisation: their jobs still exit 0, complete; a
rank process that ends the ordinary way (the negative control) is killed by the stand-in.

Ending with os._exit skips multiprocessing's exit handler too, which removes the `pymp-*` folder it makes in $TMPDIR
for the data loaders' fork-server socket: every rank left one behind. The runs here (with data-loader workers, a
fresh TMPDIR, and a hook that logs each folder multiprocessing makes, so the check is not vacuous) leave none: a
2-rank training run forked from the suite's server, and a real 1-rank `python -m vim_ds.eval` process.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from train_utils import ROOT, TINY, config_run_args, digits80, evals, records, run_train

pytestmark = pytest.mark.slow

ABORT_AT_EXIT = """\
import atexit
import os

if os.environ.get("LOCAL_RANK") is not None:
    atexit.register(os.abort)  # stands for a crash in the interpreter's finalisation
"""

LOG_TEMP_DIRS = """\
import os
from multiprocessing import util

_get_temp_dir = util.get_temp_dir


def get_temp_dir():  # logs each pymp-* folder multiprocessing makes (or reuses) in a process
    folder = _get_temp_dir()
    with open(os.environ["PYMP_LOG"], "a") as log:
        log.write(f"{os.getpid()} {folder}\\n")
    return folder


util.get_temp_dir = get_temp_dir
"""


@pytest.fixture
def temp_dirs(tmp_path):
    """Environment for a fresh TMPDIR whose pymp-* folders are logged (with the `hook` folder on PYTHONPATH), and a
    check that the processes made some and that none is left."""
    import tempfile

    # short: the data loader's fork server listens on a socket in it, whose path (pymp-*/listener-*) must fit in
    # AF_UNIX's 108 bytes, which a pytest-xdist tmp_path may not leave room for
    tmp, log = Path(tempfile.mkdtemp(prefix="vd", dir="/tmp")), tmp_path / "pymp.log"
    env = {"TMPDIR": str(tmp), "PYMP_LOG": str(log)}

    def check(processes: int):
        made = {line.split()[1] for line in log.read_text().splitlines()}
        pids = {line.split()[0] for line in log.read_text().splitlines()}
        assert len(pids) >= processes and all(os.path.dirname(f) == str(tmp) for f in made), made
        assert not [name for name in os.listdir(tmp) if name.startswith("pymp-")], os.listdir(tmp)
        log.unlink()

    yield env, check
    shutil.rmtree(tmp, ignore_errors=True)


def hook_env(tmp_path, *sources, name: str = "hook") -> dict:
    hook = tmp_path / name
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("\n".join(sources))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def aborting_finalisation(tmp_path):
    return hook_env(tmp_path, ABORT_AT_EXIT, LOG_TEMP_DIRS)


def test_the_stand_in_kills_a_rank_process_that_ends_the_ordinary_way(aborting_finalisation):
    proc = subprocess.run([sys.executable, "-c", "print('done')"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **aborting_finalisation, "LOCAL_RANK": "0"})
    assert proc.stdout == "done\n" and proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr[-2000:])


def test_train_and_eval_exit_0_when_finalisation_would_abort(digits, tmp_path, aborting_finalisation, temp_dirs):
    env, check_temp_dirs = temp_dirs
    out = tmp_path / "run"
    run_train(config_run_args(digits, out, "zero3", "--max-steps", 2, "--num_workers", 1), nproc=2,
              env={**aborting_finalisation, **env})
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]
    assert records(out)[-1].get("summary") and os.path.isdir(out / "checkpoints" / "global_step2")
    check_temp_dirs(processes=2)  # both ranks made one (their data loaders' fork server); neither is left
    scored = tmp_path / "eval"
    run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", scored, "--num_workers", "0", *TINY,
               "--resume", out / "checkpoints"], nproc=2, module="vim_ds.eval", env=aborting_finalisation)
    assert evals(scored)[-1]["eval_images"] == 360
    # and a real `python -m vim_ds.eval` process (not forked from the suite's server), 1 rank, with a worker
    data = digits80(digits, tmp_path / "data")
    proc = subprocess.run([sys.executable, "-m", "vim_ds.eval", "--data-set", "folder", "--data-path", data,
                           "--output_dir", str(tmp_path / "eval1"), "--num_workers", "1", *TINY,
                           "--resume", str(out / "checkpoints")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, **hook_env(tmp_path, LOG_TEMP_DIRS, name="log_hook"), **env})
    assert proc.returncode == 0 and evals(tmp_path / "eval1")[-1]["eval_images"] == 30, proc.stderr[-3000:]
    check_temp_dirs(processes=1)
