"""A launcher killed with SIGKILL under running ranks: the deepspeed runner (`deepspeed ...`, what a user or a
scheduler sees as "the job"), its per-node `deepspeed.launcher.launch`, or torchrun's agent. Nothing is passed on to
the ranks (SIGKILL cannot be caught); they used to be re-parented to init and train to the end, holding the output
folder's lock. Now each rank watches the launchers above it (vim_ds/runtime/launcher_watch.py) and stops as on
SIGTERM: one line saying why, the usual stop line, one complete checkpoint, exit 143 on every rank, every process
of the job gone, the lock released (a `--resume auto` into the folder continues the run).

Real launchers, real SIGKILL. The job runs under a small subreaper (`REAPER`): the ranks a killed launcher orphans
are re-parented to it rather than to init, so the test sees every process of the job end and reads each rank's exit
code (nobody else can: their launcher is dead)."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import complete_tags, finish, steps_logged, wait_for_step
from train_utils import QUIET_AUG, ROOT, TINY, config, digits80, run_train, train_command, train_env
from vim_ds.runtime import launcher_watch

# argv: CODES_FILE COMMAND...: run COMMAND as a child subreaper; when no descendant is left, write {pid: exit code}
# of every process it reaped (the launcher and whatever the launcher's death left to it) to CODES_FILE.
REAPER = r"""
import ctypes, json, os, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("reaper: prctl failed")
subprocess.Popen(sys.argv[2:])
codes = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes[pid] = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    json.dump(codes, f)
"""


@pytest.fixture(scope="module")
def small(digits, tmp_path_factory):
    return digits80(digits, tmp_path_factory.mktemp("digits80"))


def args(data, out, *extra, workers: int = 1) -> list[str]:
    """2 ranks x 8, 5 steps an epoch, an epoch-end evaluation and checkpoint; far more epochs than a test waits
    for (a run nobody stops trains for minutes)."""
    return ["--data-set", "folder", "--data-path", data, "--output_dir", str(out), "--num_workers", str(workers),
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero2"), "--precision", "fp32",
            "--batch-size", "8", "--no-repeated-aug", "--epochs", "200", "--log-interval", "1", *extra]


def _first_module(cmdline: list[str]) -> str | None:
    return cmdline[cmdline.index("-m") + 1] if "-m" in cmdline[:-1] else None


def _job(reaper: subprocess.Popen) -> dict:
    """The processes of the job under `reaper`: {"launcher": its child, "launch": deepspeed's per-node launcher
    (or None), "ranks": the training processes, "all": every descendant}."""
    import psutil

    top = psutil.Process(reaper.pid)
    launcher = top.children()[0]
    everything = top.children(recursive=True)
    ranks = [p for p in everything if _first_module(p.cmdline()) == "vim_ds.train"]
    launch = [p for p in everything if _first_module(p.cmdline()) == "deepspeed.launcher.launch"]
    assert len(ranks) == 2, [p.cmdline() for p in everything]
    return {"launcher": launcher, "launch": launch[0] if launch else None, "ranks": ranks, "all": everything}


def kill_launcher_and_check(data, tmp_path, launcher: str, target: str, name: str, workers: int = 1) \
        -> tuple[str, int]:
    """Start a 2-rank job with `launcher`, SIGKILL its `target` process ("launcher" or "launch") after the first
    step, and check the ranks stop as on SIGTERM, naming `name`. Returns (output folder, the step it stopped at).
    `workers`: data-loader workers per rank (with 1, each rank also has a fork server: processes of the job the
    stop must end too; 0 spares the variants their start-up)."""
    import psutil

    out = tmp_path / "run"
    codes_file = tmp_path / "codes.json"
    command = [sys.executable, "-c", REAPER, str(codes_file),
               *train_command(args(data, out, workers=workers), 2, launcher)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
                            cwd=ROOT, start_new_session=True)
    wait_for_step(proc, out, 1)
    job = _job(proc)
    victim = job[target]
    os.kill(victim.pid, signal.SIGKILL)
    waited, stdout, stderr = finish(proc, timeout=60)  # the reaper ends when no process of the job is left
    assert proc.returncode == 0, stderr[-3000:]
    assert waited < 30, f"the job took {waited:.0f} s to end after its launcher was killed"
    left = [p for p in job["all"] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    codes = {int(pid): code for pid, code in json.loads(codes_file.read_text()).items()}
    if target == "launcher" and job["launch"] is not None:  # launch.py lived on and reaped the ranks: it exits with
        # the first failed rank's code (and SIGTERMs the other rank, which is stopping already)
        assert codes.get(job["launch"].pid) == 143, (codes, stderr[-3000:])
    else:  # the ranks' parent was killed: they were orphans, reaped by the reaper
        assert [codes.get(p.pid) for p in job["ranks"]] == [143, 143], (codes, stderr[-3000:])  # as on SIGTERM
    if target == "launcher":  # (a killed launch.py is reaped by the runner, which then exits)
        assert codes.get(victim.pid) == -signal.SIGKILL
    why = [line for line in stderr.splitlines() if "is gone" in line]
    assert why == [f"vim-ds train: rank 0: the launcher ({name}, pid {victim.pid}) is gone; saving a checkpoint "
                   f"and stopping"], stderr[-3000:]
    stop = [line for line in stdout.splitlines() if line.startswith("stopping on SIGTERM after step ")]
    assert len(stop) == 1, stdout[-3000:]
    step = int(stop[0].split("after step ")[1].split()[0])
    assert stop[0].endswith(f": saved {out / 'checkpoints' / f'global_step{step}'}; continue with --resume auto")
    assert complete_tags(out)[-1] == f"global_step{step}"
    assert steps_logged(out) == step
    with open(out / ".vim_ds.lock") as f:  # released: free, and emptied (no dead holder for the next run to report)
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert f.read() == ""
    return str(out), step


@pytest.mark.slow
def test_the_deepspeed_runner_killed_stops_the_ranks_with_a_checkpoint_and_frees_the_folder(small, tmp_path):
    """The issue's case: `kill -KILL <runner pid>`. Then `--resume auto` into the same folder is not refused and
    continues from the stop's checkpoint."""
    out, step = kill_launcher_and_check(small, tmp_path, "deepspeed", "launcher", "deepspeed")
    resumed = run_train(args(small, out, "--resume", "auto"), nproc=2, check=False,
                        env={"VIM_DS_INJECT": f"signal_in_step@{step + 1}",  # one step more, then stop
                             "VIM_DS_INJECT_SIGNAL": "SIGTERM:rank"})
    assert f"stopping on SIGTERM after step {step + 1} " in resumed.stdout, resumed.stderr[-3000:]
    assert f"global_step{step} at epoch" in resumed.stdout, resumed.stdout[-3000:]
    assert "in use by another run" not in resumed.stderr and "taking it over" not in resumed.stdout
    assert complete_tags(out)[-1] == f"global_step{step + 1}"


@pytest.mark.slow
def test_deepspeeds_per_node_launcher_killed_stops_the_ranks(small, tmp_path):
    """The other deepspeed launcher process: `deepspeed.launcher.launch` (the ranks' parent), killed alone."""
    kill_launcher_and_check(small, tmp_path, "deepspeed", "launch", "deepspeed.launcher.launch", workers=0)


@pytest.mark.slow
def test_torchruns_agent_killed_stops_the_ranks(small, tmp_path):
    """torchrun's agent, a real `python -m torch.distributed.run` (not the suite's preloaded stand-in); its ranks run
    in sessions of their own, so not even a signal to the agent's process group would reach them."""
    kill_launcher_and_check(small, tmp_path, "torchrun", "launcher", "torch.distributed.run", workers=0)


PY = "/usr/bin/python3"


@pytest.mark.parametrize("cmdline, name", [
    ([PY, "/venv/bin/deepspeed", "--num_gpus", "2", "--module", "vim_ds.train"], "deepspeed"),
    ([PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--module", "vim_ds.train"],
     "deepspeed.launcher.launch"),
    ([PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"], "deepspeed.launcher.runner"),
    ([PY, "/venv/bin/torchrun", "--nproc_per_node=2", "-m", "vim_ds.train"], "torchrun"),
    ([PY, "-X", "utf8", "-mtorch.distributed.run", "--standalone", "train.py"], "torch.distributed.run"),
    (["torchrun", "--nproc_per_node=2", "train.py"], "torchrun"),
    # never a launcher: the rank itself, what sits above a plain run, SLURM, the suite's preloaded server (whose
    # forked ranks have nothing to watch), a wrapper script, the data loader's fork server
    ([PY, "-u", "-m", "vim_ds.train", "--local_rank=0", "--module", "torch.distributed.run"], None),
    ([PY, "-m", "pytest", "-q", "tests/faults"], None),
    (["/venv/bin/vim-ds", "train", "--deepspeed_config", "deepspeed"], None),
    (["-bash"], None), (["slurmstepd: [12.0]"], None), (["/usr/bin/srun", "torchrun"], None),
    ([PY, "/work/main/tests/preloaded.py", "/tmp/socket", "16"], None),
    (["bash", "launch/single_node.sh", "--deepspeed_config", "x.json"], None),
    ([PY, "-B", "-c", "from multiprocessing.forkserver import main; main(20, 22)"], None),
    ([], None),
])
def test_which_processes_count_as_a_launcher(cmdline, name):
    assert launcher_watch.launcher_name(cmdline) == name


def test_a_process_under_no_launcher_has_nothing_to_watch():
    """This test process runs under pytest (and a shell, or pytest-xdist's main process): nothing is watched, no
    thread is started."""
    import threading

    watch = launcher_watch.LauncherWatch()
    assert watch.chain == []
    before = threading.active_count()
    watch.start("vim-ds train", 0, 0)
    assert threading.active_count() == before
