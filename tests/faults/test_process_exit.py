"""A rank process's exit code is its run's, whatever the interpreter's finalisation would do.

gloo's threads outlive destroy_process_group() and are torn down in the interpreter's finalisation, where a rank
once aborted (SIGABRT, "terminate called without an active exception") after a 2-rank ZeRO-3 run had finished and
saved everything, and torchrun reported the job as failed (vim_ds.engine.distributed.end_rank_process). That race
cannot be started on demand, so a stand-in crashes every rank's finalisation for sure: a `sitecustomize` module
that registers os.abort with atexit in each rank process (LOCAL_RANK set by torchrun; the launcher's own process
is left alone). vim-ds train and eval end the process before finalisation: their jobs still exit 0, complete; a
rank process that ends the ordinary way (the negative control) is killed by the stand-in.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from train_utils import ROOT, TINY, config_run_args, evals, records, run_train

pytestmark = pytest.mark.slow

ABORT_AT_EXIT = """\
import atexit
import os

if os.environ.get("LOCAL_RANK") is not None:
    atexit.register(os.abort)  # stands for a crash in the interpreter's finalisation
"""


@pytest.fixture
def aborting_finalisation(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ABORT_AT_EXIT)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}


def test_the_stand_in_kills_a_rank_process_that_ends_the_ordinary_way(aborting_finalisation):
    proc = subprocess.run([sys.executable, "-c", "print('done')"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **aborting_finalisation, "LOCAL_RANK": "0"})
    assert proc.stdout == "done\n" and proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr[-2000:])


def test_train_and_eval_exit_0_when_finalisation_would_abort(digits, tmp_path, aborting_finalisation):
    out = tmp_path / "run"
    run_train(config_run_args(digits, out, "zero3", "--max-steps", 2), nproc=2, env=aborting_finalisation)
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]
    assert records(out)[-1].get("summary") and os.path.isdir(out / "checkpoints" / "global_step2")
    scored = tmp_path / "eval"
    run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", scored, "--num_workers", "0", *TINY,
               "--resume", out / "checkpoints"], nproc=2, module="vim_ds.eval", env=aborting_finalisation)
    assert evals(scored)[-1]["eval_images"] == 360
