"""The SLURM scripts of launch/ under a real SLURM: Debian's slurmctld, slurmd and munged, started by a fixture for
this module with a one-node cluster (localhost, 2 CPUs) in a temporary folder, and stopped (their jobs cancelled,
their processes killed, the folder removed) whatever happens: should the test process itself be killed (SIGKILL, a CI
timeout) before its finalizer runs, a watchdog process (tests/slurm_watchdog.py, started with the cluster, the read
end of a pipe only the test process can write to) sees the pipe close and does the same.

- `GPUS_PER_NODE=2 sbatch --nodes=1 --gpus-per-node=0 launch/slurm_mi300x.sbatch ...` trains a tiny Vim on CPU
  (2 ranks, the deepspeed launcher, gloo) to the end: COMPLETED, exit code 0:0.
- `scontrol requeue` while it trains: every process of the job gets SIGTERM, the ranks save ("stopping on SIGTERM
  after step N ... saved"), SLURM queues the job again (same id, same arguments, SLURM_RESTART_COUNT=1), and
  `--resume auto` continues to the same weights, Adam moments, EMA, scheduler and position as the uninterrupted job,
  bit for bit. Also in the two other phases a signal can find the ranks in, on a 3-step epoch: during the
  evaluation at the epoch's end (cut short, the epoch's checkpoint saved owing it; the requeued job evaluates those
  weights first, then starts the next epoch) and half-way through saving the epoch's checkpoint (the save completes
  and is the one resumed).
- The time limit with `--signal=TERM@N`: the ranks save before the kill, and a job chained with
  `--dependency=afternotok:JOBID` continues to the same end.
- `scancel`: the ranks save, the job is CANCELLED and not queued again; a later `--resume auto` can continue.
- Two nodes: a second cluster, node0 and node1, one slurmd in each of two network namespaces joined by a veth
  (the `two_hosts` fixture of tests/test_launch.py; slurmctld beside node0, `SlurmctldHost=localhost(10.77.0.1)`,
  spool, pid and log per node with %n). `GPUS_PER_NODE=1 sbatch --nodes=2 launch/slurm_mi300x.sbatch` trains 2 ranks
  across them with the one-node job's losses. The daemons enter a namespace with `nsenter --net`: `ip netns exec`
  also mounts a fresh /sys without /sys/fs/cgroup, and slurmd then fails ("Unable to initialize cgroup plugin").
  The node names do not resolve, so the test gives MASTER_ADDR as node0's address.
- The watchdog: a process that started a cluster (with a `sleep` job) and is SIGKILLed leaves no daemon, job
  process or folder behind 30 s later; one that stops its cluster itself leaves the watchdog nothing to do.

There is no slurmdbd here, so no `sacct` ("Slurm accounting storage is disabled"): a job's state and exit code are
read from `scontrol show job` (kept MinJobAge = 600 s after the end) and from the jobcomp/filetxt log, which hold the
same JobState and ExitCode fields sacct shows. The signals come from SLURM itself; `VIM_DS_INJECT=wait_for_signal@N`
only makes the ranks wait at step N until it arrives, so the job is mid-training whenever SLURM gets to it
(`wait_for_signal_in_eval@N`, `wait_for_signal_in_save@N`: in the evaluation after step N, in the step-N save).
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from slurm_watchdog import cluster_processes
from test_launch import clean_env, small_digits, two_hosts  # noqa: F401  (fixtures used here)
from train_utils import QUIET_AUG, ROOT, TINY, _free_port, assert_same_state, config, evals, step_losses

pytestmark = pytest.mark.slow

WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_watchdog.py")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # the daemons are in sbin, which a user's PATH may lack
STEPS = 5            # the uninterrupted job's length
SIGNAL_STEP = 3      # interrupted jobs wait at this step for SLURM's signal
CONF = """\
ClusterName=vimds
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
KillWait=60
MinJobAge=600
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MpiDefault=none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _cannot_start() -> str:
    """Why this machine cannot run the daemons ('' when it can)."""
    if os.geteuid() != 0:
        return "slurmd and slurmctld must run as root (this is not root)"
    missing = [name for name in DAEMONS + CLIENTS if not shutil.which(name, path=SYSTEM_PATH)]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    return ""


class Slurm:
    """A one-node SLURM cluster whose every file is under `root`, its daemons children of this process."""

    def __init__(self, root: str, hosts: list[tuple[str, str]] | None = None):
        """hosts: [(network namespace, address)] for one node each (node0, node1, ...), slurmctld on the first; None:
        one node, localhost, in this process's network."""
        self.root = root
        self.hosts = hosts
        self.conf = os.path.join(root, "slurm.conf")
        self.daemons: list[subprocess.Popen] = []
        self.watchdog: subprocess.Popen | None = None
        self._watch_fd: int | None = None

    def start(self):
        root = self.root
        self._start_watchdog()
        for sub in ("munge", "state", "spool", "log", "jobs"):
            os.makedirs(os.path.join(root, sub))
        os.chmod(root, 0o755)  # munged checks every folder above its socket
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        try:
            munge = pwd.getpwnam("munge")
            os.chown(os.path.join(root, "munge"), munge.pw_uid, munge.pw_gid)
            os.chown(key, munge.pw_uid, munge.pw_gid)
            as_munge = dict(user=munge.pw_uid, group=munge.pw_gid, extra_groups=[])
            force = []
        except KeyError:  # no munge user: munged runs as root only when forced
            as_munge, force = {}, ["--force"]
        conf = CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port())
        if self.hosts:
            names = [f"node{i}" for i in range(len(self.hosts))]
            conf = conf.replace("localhost(127.0.0.1)", f"localhost({self.hosts[0][1]})")  # 'localhost': any host
            for setting in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):  # one of each per node: %n
                line = next(ln for ln in conf.splitlines() if ln.startswith(setting + "="))
                conf = conf.replace(line, line.replace("spool", "spool/%n").replace("slurmd.", "slurmd-%n."))
            conf = conf.replace("NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN", "\n".join(
                f"NodeName={n} NodeAddr={addr} CPUs=1 State=UNKNOWN" for n, (_, addr) in zip(names, self.hosts)))
            conf = conf.replace("Nodes=localhost", f"Nodes={','.join(names)}")
            for n in names:
                os.makedirs(os.path.join(root, "spool", n))
        with open(self.conf, "w") as f:
            f.write(conf)
        log = open(os.path.join(root, "log", "daemons.log"), "w")
        munge_dir = os.path.join(root, "munge")
        self._daemon(["munged", "--foreground", *force, f"--key-file={key}", f"--socket={munge_dir}/munge.sock",
                      f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
                      f"--seed-file={munge_dir}/munged.seed"], log, **as_munge)
        self._wait_for(lambda: os.path.exists(f"{munge_dir}/munge.sock"), "munged's socket")
        if not self.hosts:
            self._daemon(["slurmctld", "-D", "-i", "-f", self.conf], log)
            self._daemon(["slurmd", "-D", "-N", "localhost", "-f", self.conf], log)
        else:
            self._daemon(["slurmctld", "-D", "-i", "-f", self.conf], log, netns=self.hosts[0][0])
            for i, (ns, _) in enumerate(self.hosts):
                self._daemon(["slurmd", "-D", "-N", f"node{i}", "-f", self.conf], log, netns=ns)
        self._wait_for(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False).stdout, "an idle node")

    def _in_netns(self, netns: str | None) -> list[str]:
        """The prefix that runs a command in that network namespace: nsenter, not `ip netns exec`, which also mounts
        a new /sys, without the cgroup file system slurmd's cgroup plugin needs ("No filesystem mounted on
        /sys/fs/cgroup ... slurmd initialization failed")."""
        return ["nsenter", f"--net=/var/run/netns/{netns}"] if netns else []

    def _daemon(self, argv, log, netns: str | None = None, **kw):
        argv = self._in_netns(netns) + [shutil.which(argv[0], path=SYSTEM_PATH), *argv[1:]]
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), **kw))

    def _wait_for(self, ready, what: str, timeout: float = 60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for d in self.daemons:
                if d.poll() is not None:
                    raise RuntimeError(f"{d.args[0]} exited ({d.returncode}) while waiting for {what}:\n"
                                       + self.logs())
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"no {what} after {timeout} s:\n" + self.logs())

    def logs(self) -> str:
        out = []
        for name in ("log/daemons.log", "munge/munged.log", "log/slurmctld.log", "log/slurmd.log",
                     "log/slurmd-node0.log", "log/slurmd-node1.log"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"== {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def env(self, **extra) -> dict:
        """The test's environment for SLURM's commands and the jobs (sbatch exports it to them)."""
        env = clean_env(**extra)
        env["SLURM_CONF"] = self.conf
        env["PYTHONPATH"] = ROOT + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def run(self, *argv, check: bool = True, **env) -> subprocess.CompletedProcess:
        netns = self.hosts[0][0] if self.hosts else None  # the clients talk to slurmctld from its host
        proc = subprocess.run(self._in_netns(netns) + list(argv), cwd=ROOT, env=self.env(**env), capture_output=True,
                              text=True, timeout=60)
        if check:
            assert proc.returncode == 0, f"{argv}: {proc.stdout}{proc.stderr}\n{self.logs()}"
        return proc

    def sbatch(self, batch: str, options: list[str], args: list[str], **env) -> str:
        """Submit launch/BATCH from the repository as a user would; returns the job id."""
        proc = self.run("sbatch", "--parsable", f"--output={self.root}/jobs/%j.out", "--open-mode=append",
                        *options, os.path.join("launch", batch), *args, **env)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def output(self, job_id: str) -> str:
        path = os.path.join(self.root, "jobs", f"{job_id}.out")
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def wait(self, job_id: str, states: tuple[str, ...], timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            time.sleep(1)
        pytest.fail(f"job {job_id} not {'/'.join(states)} after {timeout} s: {job}\n{self.output(job_id)[-4000:]}"
                    f"\n{self.logs()}")

    def jobcomp(self, job_id: str) -> list[dict]:
        """The job's lines in the jobcomp/filetxt log: one per time it ended (a requeue ends it too)."""
        path = os.path.join(self.root, "log", "jobcomp.txt")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            lines = [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in f]
        return [line for line in lines if line.get("JobId") == job_id]

    def job_processes(self) -> list[psutil.Process]:
        """Processes of this cluster's jobs (they carry its SLURM_CONF in their environment)."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == self.conf:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def _start_watchdog(self):
        """tests/slurm_watchdog.py, in its own session, holding the read end of a pipe whose only write end is ours:
        should this process die before `stop` (SIGKILL, a CI timeout), the kernel closes that end and the watchdog
        kills the daemons and every process of their jobs and removes the folder. Started before the daemons, so
        it covers a death during the start too."""
        read, self._watch_fd = os.pipe()  # not inheritable: no other child of this process holds the write end
        try:
            self.watchdog = subprocess.Popen([sys.executable, WATCHDOG, self.root, self.conf], stdin=read, cwd="/",
                                             start_new_session=True)
        finally:
            os.close(read)

    def release_watchdog(self) -> int | None:
        """Tell the watchdog that this process cleaned up (it exits touching nothing); its exit code (0)."""
        if self._watch_fd is None:
            return None
        try:
            os.write(self._watch_fd, b"done")
        finally:
            os.close(self._watch_fd)
            self._watch_fd = None
        try:
            return self.watchdog.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.watchdog.kill()
            return self.watchdog.wait()

    def stop(self):
        """Clean up, then dismiss the watchdog."""
        try:
            self.clean_up()
        finally:
            self.release_watchdog()

    def clean_up(self):
        """Cancel every job, then kill what is left of them and the daemons this object started; remove the folder."""
        if self.daemons and all(d.poll() is None for d in self.daemons):
            self.run("scancel", "--full", "--user=root", check=False)
            deadline = time.time() + 30
            while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
        for p in cluster_processes(self.root, self.conf):  # the jobs, their slurmstepd, the daemons (their env)
            try:
                if not self.watchdog or p.pid != self.watchdog.pid:
                    p.kill()
            except psutil.Error:
                pass
        for d in reversed(self.daemons):
            if d.poll() is None:
                d.terminate()
                try:
                    d.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    d.kill()
                    d.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def new_root() -> str:
    return tempfile.mkdtemp(prefix="vim_ds_slurm.")  # short: munged's socket path has a length limit


def running_cluster(hosts=None, missing: str = ""):
    """For a fixture: yields a started cluster (see `Slurm`), or skips with the reason it cannot start; stops it
    afterwards whatever happens, and should this process be killed first, its watchdog does (test_the_watchdog_...)."""
    reason = _cannot_start() or missing
    if reason:
        pytest.skip(reason)
    cluster = Slurm(new_root(), hosts=hosts)
    try:
        try:
            cluster.start()
        except (OSError, RuntimeError) as e:
            pytest.skip(f"the SLURM daemons did not start here: {str(e).splitlines()[0]}")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slurm():
    yield from running_cluster()


def job_args(data, out) -> list[str]:
    """2 ranks x micro batch 8, fp32, lr 2e-3, EMA 0.8: every part of the training state moves each step."""
    return ["--deepspeed_config", config("zero2"), "--data-set", "folder", "--data-path", data, "--output_dir",
            str(out), "--num_workers", "0", "--seed", "3", "--precision", "fp32", "--batch-size", "8",
            "--max-steps", str(STEPS), "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0",
            "--model-ema-decay", "0.8", "--resume", "auto", *TINY, *QUIET_AUG]


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
ON_CPU = ["--nodes=1", "--gpus-per-node=0"]  # the scripts ask for 2 nodes of 8 GPUs; this cluster has 1 node, 0 GPUs


def job_env(**extra) -> dict:
    # a free port, not the scripts' 20000 + job id: other SLURM clusters on this machine count job ids from 1 too
    return dict(GPUS_PER_NODE=2, MASTER_PORT=_free_port(), **extra)


def wait_for_step(slurm: Slurm, job_id: str, out, step: int, timeout: float = 300):
    """Until rank 0 has logged optimizer step `step` of the job (a job that ends before fails the test)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(os.path.join(out, "metrics.jsonl")) and step in step_losses(out):
            return
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, slurm.output(job_id)[-4000:])
        time.sleep(0.5)
    pytest.fail(f"job {job_id} logged no step {step} in {timeout} s:\n{slurm.output(job_id)[-4000:]}")


def stopped_after(output: str) -> list[int]:
    """The steps after which the job's ranks stopped on SIGTERM and saved (the trainer's own line)."""
    steps = []
    for line in output.splitlines():
        if line.startswith("stopping on SIGTERM after step ") and " saved " in line:
            steps.append(int(line.split("after step ")[1].split()[0]))
    return steps


def assert_nothing_left(slurm: Slurm, out, timeout: float = 15):
    """No process of the job that trained into `out` is left (zombies nobody reaped yet do not count)."""
    def left():
        found = []
        for p in slurm.job_processes():
            try:
                if str(out) in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    deadline = time.time() + timeout
    while left() and time.time() < deadline:
        time.sleep(0.5)
    assert not left(), [p.cmdline() for p in left()]


BANNERS = {  # what each batch script says about the job first (GPUS_PER_NODE=2)
    "slurm_mi300x.sbatch": "1 nodes (localhost) x 2 MI300X",
    "slurm_torchrun.sbatch": "1 nodes (localhost) x 2 GPUs, torchrun",
}


EPOCH_STEPS = 3  # epoch_digits: 48 training images, 3 steps of the global batch of 16 an epoch
EPOCH_ARGS = ["--epochs", "2"]  # with epoch_digits: an evaluation and a checkpoint after step 3, mid-training


@pytest.fixture(scope="module")
def epoch_digits(small_digits, tmp_path_factory):
    """small_digits with 48 training images: the jobs' epoch ends at step EPOCH_STEPS (of STEPS), where the trainer
    evaluates and saves, so that a signal can find the ranks there."""
    root = tmp_path_factory.mktemp("digits_epoch")
    shutil.copytree(os.path.join(small_digits, "val"), root / "val")
    names = [(cls, name) for cls in sorted(os.listdir(os.path.join(small_digits, "train")))
             for name in sorted(os.listdir(os.path.join(small_digits, "train", cls)))[:5]][:16 * EPOCH_STEPS]
    for cls, name in names:
        os.makedirs(root / "train" / cls, exist_ok=True)
        shutil.copy(os.path.join(small_digits, "train", cls, name), root / "train" / cls / name)
    return str(root)


@pytest.fixture(scope="module")
def straight_job(slurm, small_digits, epoch_digits, tmp_path_factory):
    """straight_job(batch, epochs=False) -> (job id, output dir) of the uninterrupted job of launch/BATCH, run on
    first use; with `epochs`, the job on epoch_digits (evaluations and checkpoints after steps 3 and 5)."""
    done = {}

    def get(batch: str, epochs: bool = False):
        if (batch, epochs) not in done:
            name = f"straight_{batch.split('.')[0]}" + ("_epochs" if epochs else "")
            out = tmp_path_factory.mktemp(name) / "run"
            args = job_args(epoch_digits, out) + EPOCH_ARGS if epochs else job_args(small_digits, out)
            job_id = slurm.sbatch(batch, ON_CPU, args, **job_env())
            slurm.wait(job_id, ENDED)
            done[batch, epochs] = job_id, out
        return done[batch, epochs]

    return get


# slurm_mi250.sbatch is slurm_mi300x.sbatch with another job name and banner (the banner and its commands are
# checked under a fake SLURM in tests/test_launch.py): one deepspeed script and the torchrun one train for real.
@pytest.mark.parametrize("batch", ["slurm_mi300x.sbatch", "slurm_torchrun.sbatch"])
def test_sbatch_trains_to_the_end(slurm, straight_job, batch):
    """The job trains its 2 CPU ranks to the last step, saves, and ends COMPLETED 0:0; both scripts give the
    same per-step losses (the same 2-rank arithmetic, whichever launcher starts the ranks)."""
    job_id, out = straight_job(batch)
    job = slurm.job(job_id)
    output = slurm.output(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), (job, output[-4000:])
    assert [(c["JobState"], c["ExitCode"]) for c in slurm.jobcomp(job_id)] == [("COMPLETED", "0:0")]
    assert f"job {job_id}: {BANNERS[batch]}" in output
    if "torchrun" not in batch:
        assert "nnodes=1, num_local_procs=2, node_rank=0" in output  # the deepspeed launcher's line
    assert "2 rank(s) on cpu" in output
    assert sorted(step_losses(out)) == list(range(1, STEPS + 1))
    assert os.path.isfile(out / "checkpoints" / f"global_step{STEPS}" / "vim_ds_complete.json")
    assert_nothing_left(slurm, out)
    if batch != "slurm_mi300x.sbatch":
        assert step_losses(out) == step_losses(straight_job("slurm_mi300x.sbatch")[1])


def wait_for_eval(slurm: Slurm, job_id: str, out, step: int, timeout: float = 300):
    """Until rank 0 has logged the evaluation after step `step`, and the step's checkpoint folder exists (the ranks
    are saving it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(os.path.join(out, "metrics.jsonl")) and any(r["step"] == step for r in evals(out)) \
                and os.path.isdir(os.path.join(out, "checkpoints", f"global_step{step}")):
            return
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, slurm.output(job_id)[-4000:])
        time.sleep(0.2)
    pytest.fail(f"job {job_id} logged no evaluation at step {step} in {timeout} s:\n{slurm.output(job_id)[-4000:]}")


EVAL_KEYS = ("step", "epoch", "eval_loss", "eval_acc1", "eval_acc5", "ema_eval_loss", "ema_eval_acc1")


def eval_results(out) -> list[tuple]:
    return [tuple(r.get(k) for k in EVAL_KEYS) for r in evals(out)]


@pytest.mark.parametrize("batch, phase", [("slurm_mi300x.sbatch", "step"), ("slurm_torchrun.sbatch", "step"),
                                          ("slurm_mi300x.sbatch", "eval"), ("slurm_mi300x.sbatch", "save")])
def test_scontrol_requeue_saves_and_the_requeued_job_resumes_exactly(slurm, straight_job, small_digits, epoch_digits,
                                                                     tmp_path, batch, phase):
    """`scontrol requeue` while the ranks wait for a signal, in one of three phases:

    - step: at the start of step SIGNAL_STEP (mid-epoch): they take the step, save, stop after it;
    - eval: at the first batch of the evaluation at the end of epoch 0 (after step EPOCH_STEPS, on epoch_digits): the
      evaluation is cut short, the epoch's checkpoint is saved (owing that evaluation), and the requeued job first
      evaluates those weights, then starts epoch 1 (the epoch is not trained again, its evaluation is not lost);
    - save: half-way through saving that epoch's checkpoint (its evaluation logged): the save completes and is the
      checkpoint the ranks stop with.

    The requeued job (released at once instead of SLURM's ~120 s requeue delay) resumes from that checkpoint and
    ends COMPLETED with Restarts=1 and the uninterrupted job's losses, evaluations and training state, bit for bit
    (same ranks, same arithmetic)."""
    out = tmp_path / "run"
    epochs = phase != "step"
    args = job_args(epoch_digits, out) + EPOCH_ARGS if epochs else job_args(small_digits, out)
    inject = {"step": f"wait_for_signal@{SIGNAL_STEP}", "eval": f"wait_for_signal_in_eval@{EPOCH_STEPS}",
              "save": f"wait_for_signal_in_save@{EPOCH_STEPS}"}[phase]
    job_id = slurm.sbatch(batch, ON_CPU, args, **job_env(VIM_DS_INJECT=inject))
    if phase == "step":
        wait_for_step(slurm, job_id, out, SIGNAL_STEP - 1)
    elif phase == "eval":
        wait_for_step(slurm, job_id, out, EPOCH_STEPS)  # then the ranks evaluate, and wait at its first batch
    else:
        wait_for_eval(slurm, job_id, out, EPOCH_STEPS)  # then the ranks save, and wait half-way
    slurm.run("scontrol", "requeue", job_id)
    job = slurm.wait(job_id, ("PENDING", "RUNNING", "COMPLETED"), timeout=120)
    if job["JobState"] == "PENDING":
        slurm.run("scontrol", "update", f"jobid={job_id}", "StartTime=now")
    job = slurm.wait(job_id, ENDED)
    output = slurm.output(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), (job, output[-5000:])
    # jobcomp logs each end of the job: the requeue (as the state it left the job in, PENDING), then the end
    assert [c["JobState"] for c in slurm.jobcomp(job_id)] == ["PENDING", "COMPLETED"], slurm.jobcomp(job_id)
    stop_step = SIGNAL_STEP if phase == "step" else EPOCH_STEPS
    assert stopped_after(output) == [stop_step], output[-5000:]
    assert "(requeued 1 times)" in output
    # the step phase stops mid-epoch 0; the others after epoch 0's checkpoint, which resumes at epoch 1
    assert f"at epoch {int(epochs)}, step {stop_step}" in output and "resumed " in output, output[-5000:]
    straight_out = straight_job(batch, epochs)[1]
    assert step_losses(out) == step_losses(straight_out)
    assert_same_state(out / "checkpoints" / f"global_step{STEPS}", straight_out / "checkpoints" / f"global_step{STEPS}")
    if epochs:
        straight_evals = eval_results(straight_out)
        assert [r[0] for r in straight_evals] == [EPOCH_STEPS, STEPS]
        # eval: the evaluation the signal cut short is done by the requeued job first, with the same results
        assert eval_results(out) == straight_evals, output[-5000:]
        assert (f"evaluating step {EPOCH_STEPS} first" in output) == (phase == "eval"), output[-5000:]
    assert_nothing_left(slurm, out)


def test_the_time_limit_signal_saves_and_an_afternotok_job_continues_to_the_end(slurm, straight_job, small_digits,
                                                                              tmp_path):
    """`--time=3 --signal=TERM@60` (the sbatch file's TERM@120, scaled down; SLURM may send it up to its 30 s check
    period early: with --time=4 the jobs here ended 150-180 s after the start): the ranks, waiting at step
    SIGNAL_STEP (or, on a machine so busy that their start-up took longer, at an earlier step), save and exit before
    the kill at the limit (180 s); a job submitted with `--dependency=afternotok:<first>` starts because the first did
    not end COMPLETED, resumes, and ends with the uninterrupted job's training state."""
    out = tmp_path / "run"
    first = slurm.sbatch("slurm_mi300x.sbatch", ON_CPU + ["--time=3", "--signal=TERM@60"],
                         job_args(small_digits, out), **job_env(VIM_DS_INJECT=f"wait_for_signal@{SIGNAL_STEP}"))
    chained = slurm.sbatch("slurm_mi300x.sbatch", ON_CPU + [f"--dependency=afternotok:{first}"],
                           job_args(small_digits, out), **job_env())
    started = time.time()
    job1 = slurm.wait(first, ENDED, timeout=400)
    ended_after = time.time() - started
    output1 = slurm.output(first)
    print(f"first job: {job1['JobState']} {job1['ExitCode']} after {ended_after:.0f} s; "
          f"{[line for line in output1.splitlines() if line.startswith('stopping on')]}")
    # the ranks stopped on SIGTERM (143) well before the limit's kill: the job FAILED, it did not run into TIMEOUT
    assert (job1["JobState"], job1["ExitCode"]) == ("FAILED", "143:0"), (job1, output1[-5000:])
    assert ended_after < 175, ended_after
    saved = stopped_after(output1)
    assert len(saved) == 1 and 1 <= saved[0] <= SIGNAL_STEP, output1[-5000:]
    assert os.path.isfile(out / "checkpoints" / f"global_step{saved[0]}" / "vim_ds_complete.json")

    job2 = slurm.wait(chained, ENDED, timeout=300)
    output2 = slurm.output(chained)
    assert (job2["JobState"], job2["ExitCode"]) == ("COMPLETED", "0:0"), (job2, output2[-5000:])
    assert f"at epoch 0, step {saved[0]}" in output2, output2[-5000:]
    straight_out = straight_job("slurm_mi300x.sbatch")[1]
    assert step_losses(out) == step_losses(straight_out)
    assert_same_state(out / "checkpoints" / f"global_step{STEPS}", straight_out / "checkpoints" / f"global_step{STEPS}")
    assert_nothing_left(slurm, out)


def test_scancel_saves_a_checkpoint_and_the_job_ends_cancelled_not_requeued(slurm, small_digits, tmp_path):
    """`scancel JOBID` while the job trains: SLURM sends SIGTERM to every process of the job (SIGKILL after
    KillWait), the ranks save and stop, and the job ends CANCELLED, not queued again despite --requeue: continuing
    is a new submission with `--resume auto`."""
    out = tmp_path / "run"
    job_id = slurm.sbatch("slurm_mi300x.sbatch", ON_CPU, job_args(small_digits, out),
                          **job_env(VIM_DS_INJECT=f"wait_for_signal@{SIGNAL_STEP}"))
    wait_for_step(slurm, job_id, out, SIGNAL_STEP - 1)
    slurm.run("scancel", job_id)
    job = slurm.wait(job_id, ENDED, timeout=120)
    assert_nothing_left(slurm, out, timeout=90)
    output = slurm.output(job_id)
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), (job, output[-5000:])
    assert stopped_after(output) == [SIGNAL_STEP], output[-5000:]
    assert os.path.isfile(out / "checkpoints" / f"global_step{SIGNAL_STEP}" / "vim_ds_complete.json")
    time.sleep(2)
    assert slurm.job(job_id)["JobState"] == "CANCELLED"


CLUSTER_THEN = """
import subprocess, sys, time
sys.path.insert(0, {tests!r})
from test_slurm import Slurm, new_root
cluster = Slurm(new_root())
cluster.start()
job = cluster.run("sbatch", "--parsable", f"--output={{cluster.root}}/jobs/%j.out", "--wrap", "sleep 600").stdout
cluster.wait(job.strip(), ("RUNNING",), timeout=120)
print("cluster", cluster.root, cluster.conf, cluster.watchdog.pid, flush=True)
if sys.argv[1] == "stopped":
    sys.stdin.readline()  # the test has seen the cluster
    cluster.clean_up()
    canary = subprocess.Popen(["sleep", "300"], env=cluster.env(), start_new_session=True)  # would be swept
    print("canary", canary.pid, "watchdog", cluster.release_watchdog(), flush=True)
else:
    time.sleep(3600)  # until the test SIGKILLs this process
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("end", ["killed", "stopped"])
def test_the_watchdog_cleans_up_after_a_killed_test_process_and_nothing_after_a_clean_stop(tmp_path, end):
    """A process starts a cluster with this module's code (as the fixture does) and a `sbatch --wrap 'sleep 600'` job.
    killed: SIGKILL to that process (its finalizers never run): within 30 s its watchdog has killed munged,
    slurmctld, slurmd, the job's slurmstepd and sleep, and removed the folder. stopped: the process cleans up itself
    and dismisses the watchdog, which exits 0 and touches nothing (a process with the cluster's SLURM_CONF started
    after the clean-up is still alive after it)."""
    reason = _cannot_start()
    if reason:
        pytest.skip(reason)
    log = tmp_path / "starter.log"
    code = CLUSTER_THEN.format(tests=os.path.dirname(os.path.abspath(__file__)))
    with open(log, "w") as f:
        starter = subprocess.Popen([sys.executable, "-c", code, end], cwd=ROOT, env=clean_env(),
                                   stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while "cluster " not in log.read_text() and starter.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        line = next((ln for ln in log.read_text().splitlines() if ln.startswith("cluster ")), None)
        assert line, log.read_text()[-5000:]
        _, root, conf, watchdog = line.split()
        deadline = time.time() + 60  # RUNNING comes a moment before slurmstepd has started the script
        while True:
            processes = [p for p in cluster_processes(root, conf) if p.pid != int(watchdog)]
            names = sorted({p.name() for p in processes})
            if {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"} <= set(names) or time.time() > deadline:
                break
            time.sleep(0.5)
        assert {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"} <= set(names), names
        if end == "killed":
            starter.kill()
            starter.wait()
            deadline = time.time() + 30
            while time.time() < deadline and (os.path.exists(root) or any(_alive(p.pid) for p in processes)):
                time.sleep(0.5)
            left = [p.pid for p in processes if _alive(p.pid)]
            assert not left and not os.path.exists(root), (left, os.path.exists(root), log.read_text()[-3000:])
            assert not _alive(int(watchdog))
            assert "is gone; killed " in log.read_text()
        else:
            starter.stdin.close()  # go on: clean up
            assert starter.wait(timeout=120) == 0, log.read_text()[-5000:]
            words = next(ln for ln in log.read_text().splitlines() if ln.startswith("canary ")).split()
            assert words[3] == "0" and _alive(int(words[1])), log.read_text()[-3000:]
            assert not os.path.exists(root) and not any(_alive(p.pid) for p in processes)
            assert "is gone" not in log.read_text()
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for line in log.read_text().splitlines():
            if line.startswith("canary "):
                os.kill(int(line.split()[1]), signal.SIGKILL)


@pytest.fixture
def slurm_two_nodes(two_hosts):
    """A two-node cluster: node0 and node1, one CPU each, one slurmd in each of two_hosts' network namespaces
    (10.77.0.1, 10.77.0.2), slurmctld beside node0's; stopped and removed as `slurm` is."""
    yield from running_cluster([(ns, addr) for ns, _, addr in two_hosts],
                               "" if shutil.which("nsenter") else "nsenter (util-linux) is missing")


def test_sbatch_on_two_nodes_trains_like_one_node(slurm_two_nodes, straight_job, small_digits, two_hosts, tmp_path):
    """`GPUS_PER_NODE=1 sbatch --nodes=2 launch/slurm_mi300x.sbatch` on two SLURM nodes, each a network namespace
    (MASTER_ADDR given as node0's address: the node names do not resolve here): srun starts one launcher per node,
    each node's gloo uses its veth, and the 2-rank job ends COMPLETED with the one-node job's per-step losses
    (fp32: 1e-6 relative)."""
    out = tmp_path / "run"
    job_id = slurm_two_nodes.sbatch("slurm_mi300x.sbatch", ["--nodes=2", "--gpus-per-node=0"],
                                    job_args(small_digits, out),
                                    **dict(job_env(MASTER_ADDR=two_hosts[0][2]), GPUS_PER_NODE=1))
    job = slurm_two_nodes.wait(job_id, ENDED)
    output = slurm_two_nodes.output(job_id)
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "node[0-1]"), \
        (job, output[-5000:])
    assert f"job {job_id}: 2 nodes (node[0-1]) x 1 MI300X" in output
    for _, dev, _ in two_hosts:
        assert f"gloo uses network interface {dev} toward the master {two_hosts[0][2]}" in output, output[-5000:]
    assert "2 rank(s) on cpu" in output
    losses, one_node = step_losses(out), step_losses(straight_job("slurm_mi300x.sbatch")[1])
    assert losses.keys() == one_node.keys() == set(range(1, STEPS + 1))
    for step in one_node:
        assert abs(one_node[step] - losses[step]) <= 1e-6 * abs(one_node[step]), (one_node, losses)
