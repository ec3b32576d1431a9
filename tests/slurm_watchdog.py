"""Watch the process that started a test SLURM cluster (tests/test_slurm.py) and clean the cluster up if that process
dies without doing so itself (SIGKILL, a CI timeout, an out-of-memory kill: its finalizers never run).

    python tests/slurm_watchdog.py ROOT SLURM_CONF  < the read end of a pipe

The starting process holds the only write end of the pipe on this script's stdin. When it stops its cluster it
writes `done` and closes the pipe: this script then exits at once, touching nothing. End of file without `done`
(the writer is gone: every descriptor of a dead process is closed by the kernel), or this script's parent changing
(the starter died and this script was handed to init while some forked child still holds the write end), means
nobody is left to clean up: it SIGKILLs every process of the cluster's jobs (their environment has SLURM_CONF, which
sbatch passes on to them), the daemons (started with the same SLURM_CONF, or naming ROOT on their command line:
munged) and their job steps (slurmstepd, which holds files under ROOT open), until none is left, then removes ROOT.

It runs in its own session, so a signal to the starter's process group (Ctrl-C, `kill -- -PGID`) does not end it
with the others. Exit code 0 when told `done`, 3 after cleaning up.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time

import psutil

DONE = b"done"


def _holds_a_file_in(pid: int, root: str) -> bool:
    """Whether the process has a file under ROOT open (deleted ones too: their link ends in ' (deleted)')."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root + "/"):
                return True
        except OSError:
            pass
    return False


def cluster_processes(root: str, conf: str) -> list[psutil.Process]:
    """The live processes of the cluster: SLURM_CONF=conf in their environment (the daemons, the jobs' processes),
    ROOT on their command line (munged), or a file under ROOT open: slurmstepd, which slurmd starts with an empty
    environment and a command line of `slurmstepd: [JOB.batch]`, detached from it, but which keeps slurmd's log and
    the job's output open."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("SLURM_CONF") == conf or any(arg == root or root + "/" in arg for arg in p.cmdline()) \
                    or _holds_a_file_in(p.pid, root):
                found.append(p)
        except psutil.Error:
            pass
    return found


def clean_up(root: str, conf: str) -> int:
    """SIGKILL the cluster's processes until none is left (a dying slurmstepd may still start one); returns how many
    were killed."""
    killed = set()
    deadline = time.time() + 60
    while time.time() < deadline:
        left = cluster_processes(root, conf)
        if not left:
            break
        for p in left:
            try:
                p.send_signal(signal.SIGKILL)
                killed.add(p.pid)
            except psutil.Error:
                pass
        time.sleep(0.2)
    shutil.rmtree(root, ignore_errors=True)
    return len(killed)


def wait_for_the_starter(fd: int, parent: int) -> bool:
    """Block until the starter says `done` (True) or is gone (False)."""
    got = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 64)
            if not chunk:
                return got.strip() == DONE
            got += chunk
        elif os.getppid() != parent:
            return False


def main() -> int:
    root, conf = sys.argv[1], sys.argv[2]
    parent = os.getppid()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # only the starter's end decides
    if wait_for_the_starter(sys.stdin.fileno(), parent):
        return 0
    killed = clean_up(root, conf)
    print(f"slurm_watchdog: the process that started the SLURM cluster in {root} is gone; killed {killed} of its "
          f"processes and removed the folder", file=sys.stderr, flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
