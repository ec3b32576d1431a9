"""The launch/ scripts, run for real on one machine.

- Two "nodes" on localhost: two `launch/multi_node.sh` per-node launches (`--no_ssh --node_rank 0|1`, one CPU
  process each, gloo) train exactly like one node with two processes; when one node's rank is SIGKILLed, the other
  node's launcher exits non-zero instead of hanging.
- Two hosts on a veth network (two network namespaces): they train like one host; when the link goes down
  mid-run both nodes end within --dist-timeout with one line each and the run resumes from its last complete
  checkpoint; a node 0 whose node 1 never arrives ends after --dist-timeout with one line saying what it waited for.
- SIGTERM or SIGINT to a launch script reaches the ranks, the trainer checkpoints, and the script waits for it (what
  SLURM's `--signal=TERM@120` relies on), also when the script started with SIGINT ignored (from a background job).
- Arguments with spaces and `$` reach the trainer verbatim.
- The per-node SLURM logic (node rank, master address, GPU count) and every script's `--dry-run` output, with
  SLURM's variables set by the test and stand-ins for `scontrol` and `srun`.
- shellcheck and `bash -n` for every script in launch/ and tools/.
"""
from __future__ import annotations

import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from train_utils import QUIET_AUG, ROOT, TINY, _free_port, config, records, run_train, step_losses
from vim_ds.checkpoint.deepspeed_dir import complete_tags

LAUNCH = os.path.join(ROOT, "launch")
SCRIPTS = sorted(glob.glob(os.path.join(LAUNCH, "*.sh")) + glob.glob(os.path.join(LAUNCH, "*.sbatch"))
                 + glob.glob(os.path.join(ROOT, "tools", "**", "*.sh"), recursive=True)
                 + [os.path.join(ROOT, ".ci", "run")])


def script(name: str) -> str:
    return os.path.join(LAUNCH, name)


def clean_env(**extra) -> dict:
    """The test's environment without launcher settings a developer may have exported, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "NCCL_", "MASTER_", "VIM_DS_")) and k not in
           ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "NPROC", "HOSTFILE", "NO_SSH", "DRY_RUN", "LAUNCHER",
            "TORCHRUN_RDZV", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    # CPU ranks even on a GPU machine (as tests/test_train.py does); no env_rocm/env_nvidia unless a test asks
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", VIM_DS_GPU_ENV="none")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def bash(name: str, *args, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", script(name), *map(str, args)], cwd=ROOT, env=clean_env(**env),
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def commands(output: str) -> list[list[str]]:
    """The commands a --dry-run printed (comment lines left out), split as bash would split them."""
    return [shlex.split(line) for line in output.splitlines() if line.strip() and not line.startswith("#")]


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def user_args(cmd: list[str], module_flag: str = "--module") -> list[str]:
    """What follows `--module vim_ds.train` (deepspeed) or `-m vim_ds.train` (torchrun)."""
    i = cmd.index(module_flag)
    assert cmd[i + 1] == "vim_ds.train", cmd
    return cmd[i + 2:]


TRICKY = ["--output_dir", "runs/out dir $HOME x", "--model-kwargs", "depth=2", "a b='c'", "--lr", "*"]


# -- real training -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_digits(digits, tmp_path_factory):
    """The digits with a 20-image validation split (the runs end with an evaluation; it need not be long)."""
    root = tmp_path_factory.mktemp("digits_small")
    shutil.copytree(os.path.join(digits, "train"), root / "train")
    for cls in sorted(os.listdir(os.path.join(digits, "val"))):
        os.makedirs(root / "val" / cls)
        for name in sorted(os.listdir(os.path.join(digits, "val", cls)))[:2]:
            shutil.copy(os.path.join(digits, "val", cls, name), root / "val" / cls / name)
    return str(root)


def train_args(data, out, steps: int, *extra) -> list[str]:
    return ["--deepspeed_config", config("zero2"), "--data-set", "folder", "--data-path", data, "--output_dir",
            str(out), "--num_workers", "0", "--seed", "3", "--precision", "fp32", "--batch-size", "8",
            "--max-steps", str(steps), "--no-model-ema", *TINY, *QUIET_AUG, *extra]


class Node:
    """One `launch/multi_node.sh` per-node launch, as node NODE_RANK of a two-node job on this machine."""

    def __init__(self, rank: int, hostfile, port: int, args: list[str], log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = clean_env(HOSTFILE=hostfile, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        self.proc = subprocess.Popen(["bash", script("multi_node.sh"), *args], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)
        self.tree = psutil.Process(self.proc.pid)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def ranks(self) -> list[psutil.Process]:
        """The node's training processes (python -m vim_ds.train --local_rank=...), found from its launcher."""
        found = []
        for p in self.tree.children(recursive=True):
            try:
                argv = p.cmdline()
            except psutil.Error:
                continue
            if "vim_ds.train" in argv and any(a.startswith("--local_rank") for a in argv):
                found.append(p)
        return found

    def descendants(self) -> list[psutil.Process]:
        try:
            return self.tree.children(recursive=True)
        except psutil.Error:
            return []

    def stop(self):
        """Leave nothing running: SIGTERM to the script (it passes it on), then SIGKILL what is left."""
        left = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.log.close()


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def hostfile(tmp_path):
    """Two "nodes" that are both this machine (the deepspeed launcher refuses the same name twice)."""
    path = tmp_path / "hostfile"
    path.write_text("# two entries that resolve to this machine\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    return str(path)


def wait_for_first_step(procs, logs, out, timeout=240):
    """Until rank 0 has logged a training step to OUT/metrics.jsonl; fails if a launch exits meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(os.path.join(out, "metrics.jsonl")) and any("loss" in r for r in records(out)):
            return
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, f"a launch exited early:\n{open(log).read()[-3000:]}"
        time.sleep(0.5)
    pytest.fail("no training step logged in time:\n" + "\n".join(open(log).read()[-2000:] for log in logs))


@pytest.fixture(scope="module")
def one_node(small_digits, tmp_path_factory) -> dict:
    """The per-step losses of the 4 steps every multi-node form is compared with: 2 processes on one node (run once,
    for the module's tests that need it)."""
    out = tmp_path_factory.mktemp("one_node")
    run_train(train_args(small_digits, out, 4), nproc=2)
    return step_losses(out)


def assert_losses_of_one_node(one_node: dict, losses: dict):
    """The per-step losses of a job spread over nodes equal those of the same 4 steps run as 2 processes on one
    node (fp32: the same arithmetic; 1e-6 relative)."""
    assert one_node.keys() == losses.keys()
    for step in one_node:
        assert abs(one_node[step] - losses[step]) <= 1e-6 * abs(one_node[step]), (one_node, losses)


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_exactly_like_one_node_with_two_processes(small_digits, hostfile, one_node,
                                                                                   tmp_path):
    """`NODE_RANK=1 ... multi_node.sh` and `NODE_RANK=0 ... multi_node.sh` (deepspeed --no_ssh, one CPU process
    each, MASTER_ADDR=127.0.0.1) form one 2-rank job whose per-step losses equal a 2-process single-node run's."""
    port = _free_port()
    outs = [tmp_path / "node0", tmp_path / "node1"]
    nodes = [Node(rank, hostfile, port, train_args(small_digits, outs[rank], 4), tmp_path / f"node{rank}.log")
             for rank in (1, 0)]
    try:
        for node in nodes:
            node.proc.wait(timeout=300)
    finally:
        for node in nodes:
            node.stop()
    for node in nodes:
        assert node.proc.returncode == 0, node.output()[-4000:]
    node1, node0 = (node.output() for node in nodes)
    assert "nnodes=2, num_local_procs=1, node_rank=0" in node0
    assert "nnodes=2, num_local_procs=1, node_rank=1" in node1
    assert "2 rank(s) on cpu" in node0
    # only global rank 0 (on node 0) writes metrics
    assert not os.path.exists(outs[1] / "metrics.jsonl")
    two_nodes = step_losses(outs[0])
    assert sorted(two_nodes) == [1, 2, 3, 4]

    assert_losses_of_one_node(one_node, two_nodes)


@pytest.mark.parametrize("env, expected", [
    (dict(WORLD_SIZE="2", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1"), "lo"),           # deepspeed's LOCAL_SIZE
    (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="localhost"), "lo"),     # torchrun's, a host name
    (dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"), None),     # one host: gloo's own choice
    (dict(WORLD_SIZE="2", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="eth9"), "eth9"),  # the user's
], ids=["two hosts", "host name", "one host", "set by the user"])
def test_vim_ds_sets_gloo_interface_toward_the_master_only_across_hosts(monkeypatch, env, expected):
    from vim_ds.runtime.distributed import _choose_gloo_interface

    # a copy of the environment: _choose_gloo_interface sets GLOO_SOCKET_IFNAME itself, which monkeypatch would not
    # undo, and "lo" left in this process's environment sent the later two-host launches' gloo to loopback
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _choose_gloo_interface()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == expected


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2: two hosts on a real (virtual) network,
    each with its own loopback. Yields [(namespace, interface, address)] x 2; removes both namespaces (and so the
    pair) and kills what still runs in them, whatever happens."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 100000}"
    hosts = [(f"vimds{tag}_{i}", f"vd{tag}{'ab'[i]}", f"10.77.0.{i + 1}") for i in range(2)]
    made = []
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (RuntimeError, OSError) as e:
        for ns in made:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", hosts[0][1], check=False)
        pytest.skip(f"cannot make two network namespaces here: {e}")
    try:
        yield hosts
    finally:
        for ns, _, _ in hosts:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ValueError, OSError):
                    pass
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", hosts[0][1], check=False)  # gone with its namespace, unless it was never moved


@pytest.mark.slow
def test_two_hosts_on_a_veth_network_train_like_one_host_and_gloo_uses_the_veth(small_digits, two_hosts, one_node,
                                                                                 tmp_path):
    """`ip netns exec HOST bash launch/multi_node.sh` with NODE_RANK=0|1 and MASTER_ADDR=10.77.0.1 on two network
    namespaces (one CPU rank each): the scripts choose and print the veth as gloo's interface (gloo's own choice, the
    address the host name resolves to, is loopback here: each node would advertise 127.0.0.1 to the other), and the
    2-rank job's per-step losses equal one host's 2-process run."""
    port = _free_port()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{addr} slots=1\n" for _, _, addr in two_hosts))
    outs = [tmp_path / "node0", tmp_path / "node1"]
    procs, logs = [], []
    try:
        for rank in (1, 0):
            ns = two_hosts[rank][0]
            logs.append(open(tmp_path / f"node{rank}.log", "w"))
            env = clean_env(HOSTFILE=hostfile, NODE_RANK=rank, MASTER_ADDR=two_hosts[0][2], MASTER_PORT=port)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "bash", script("multi_node.sh"),
                                           *train_args(small_digits, outs[rank], 4)],
                                          cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
    node1, node0 = ((tmp_path / f"node{rank}.log").read_text() for rank in (1, 0))
    assert [p.returncode for p in procs] == [0, 0], node0[-3000:] + node1[-3000:]
    for rank, output in ((0, node0), (1, node1)):
        ns, dev, _ = two_hosts[rank]
        assert f"launch: gloo uses network interface {dev} toward the master 10.77.0.1 " in output, output[-3000:]
    assert "2 rank(s) on cpu" in node0
    two_hosts_losses = step_losses(outs[0])
    assert sorted(two_hosts_losses) == [1, 2, 3, 4]
    assert_losses_of_one_node(one_node, two_hosts_losses)


def _start_on_host(two_hosts, rank: int, hostfile, port: int, args: list[str], log_path, **env):
    """`ip netns exec HOST bash launch/multi_node.sh ARGS` as node RANK (MASTER_ADDR: host 0), output to log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen(["ip", "netns", "exec", two_hosts[rank][0], "bash", script("multi_node.sh"), *args],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=clean_env(HOSTFILE=hostfile, NODE_RANK=rank, MASTER_ADDR=two_hosts[0][2],
                                              MASTER_PORT=port, **env))


def _kill_launch(proc: subprocess.Popen):
    """SIGKILL a launch and everything under it (run_in_group puts deepspeed in a session of its own, so its process
    group is not the script's; the two_hosts fixture also kills whatever still runs in the namespaces)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in [proc, *tree]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, AttributeError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _max_step(out) -> int:
    try:
        return max((r["step"] for r in records(out) if "loss" in r), default=0)
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


def _one_line_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("vim-ds train: error")]


@pytest.mark.slow
def test_the_link_between_two_hosts_taken_down_mid_run_ends_both_within_dist_timeout_and_the_run_resumes(
        small_digits, two_hosts, tmp_path):
    """Two hosts on the veth train (one CPU rank each, --dist-timeout 45, a checkpoint every 2 steps into a folder
    both see); after step 5 the veth goes down on host 1's side, which no socket notices: no FIN, no RST, only
    silence. Both nodes must end on their own within the timeout plus a margin, each with a one-line cause and no
    traceback, the step-4 (or a later) checkpoint complete, and `--resume auto` on one host continues from it."""
    port = _free_port()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{addr} slots=1\n" for _, _, addr in two_hosts))
    out = tmp_path / "run"
    # --dist-timeout also bounds the rendezvous: 20 s failed it once on loaded cores, node 1's rank reaching
    # init_process_group more than 20 s after node 0's ("1/2 clients joined"); 45 s leaves room for that
    args = train_args(small_digits, out, 1000, "--save-interval", "2", "--log-interval", "1", "--dist-timeout", "45")
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    procs = []
    try:
        for rank in (1, 0):
            procs.insert(0, _start_on_host(two_hosts, rank, hostfile, port, args, logs[rank]))
        deadline = time.time() + 300
        while _max_step(out) < 5:
            for proc, log in zip(procs, logs):
                assert proc.poll() is None, f"a node exited early:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, "step 5 not reached in 300 s:\n" + logs[0].read_text()[-3000:]
            time.sleep(0.2)
        ns, dev, _ = two_hosts[1]
        _ip("-n", ns, "link", "set", dev, "down")
        down = time.time()
        ended = [None, None]
        # 45 s of --dist-timeout, then the failed rank's own exit (a few s on loaded cores) and its launcher's
        # (2-4 s after the timeout when measured); 40 s more of margin for 2 shared cores
        while None in ended and time.time() - down < 85:
            for i, proc in enumerate(procs):
                if ended[i] is None and proc.poll() is not None:
                    ended[i] = time.time() - down
            time.sleep(0.2)
        outputs = [log.read_text() for log in logs]
        assert None not in ended, (ended, outputs[0][-3000:], outputs[1][-3000:])
    finally:
        for proc in procs:
            _kill_launch(proc)
    print(f"the nodes ended {ended[0]:.1f} s and {ended[1]:.1f} s after the link went down")
    for rank, output in enumerate(outputs):
        assert procs[rank].returncode != 0, output[-3000:]
        assert "Traceback" not in output, output[-5000:]
        errors = _one_line_errors(output)
        assert len(errors) == 1 and f"(rank {rank})" in errors[0], output[-3000:]
        print(f"node {rank} (exit {procs[rank].returncode}): {errors[0]}")
    saved = complete_tags(str(out / "checkpoints"))
    assert saved and int(saved[-1].removeprefix("global_step")) >= 4, saved
    last = int(saved[-1].removeprefix("global_step"))
    # the link up again is not needed: the same 2-rank world on one host resumes from the shared folder (torchrun,
    # ranks forked from the preloaded server: the launchers were tested above, the checkpoint is what is tested here)
    proc = run_train(train_args(small_digits, out, last + 2, "--save-interval", "2", "--log-interval", "1",
                                "--resume", "auto"), nproc=2)
    assert f"global_step{last} at epoch" in proc.stdout, proc.stdout[-3000:]
    assert {last + 1, last + 2} <= set(step_losses(out)), step_losses(out)


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_node_0_within_dist_timeout_with_one_line(small_digits, two_hosts, tmp_path):
    """Only node 0 of two starts (host 1 never runs its launch): its rank waits in the rendezvous (the TCPStore
    and init_process_group, bounded by --dist-timeout, here 20 s) and must then exit non-zero with one line saying
    what it waited for, leaving nothing running."""
    port = _free_port()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{addr} slots=1\n" for _, _, addr in two_hosts))
    log = tmp_path / "node0.log"
    started = time.time()
    proc = _start_on_host(two_hosts, 0, hostfile, port, train_args(small_digits, tmp_path / "run", 4,
                                                                   "--dist-timeout", "20"), log)
    try:
        tree = {}  # every process the launch started (runner, per-node launcher, rank), seen while it ran
        seen_rank = False
        while proc.poll() is None and time.time() - started < 120:
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    tree[p.pid] = p
                    seen_rank = seen_rank or "vim_ds.train" in p.cmdline()
            except psutil.Error:
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            pytest.fail("node 0 still waits 120 s after its start (--dist-timeout 20):\n" + log.read_text()[-3000:])
        rc = proc.returncode
        waited = time.time() - started
        assert seen_rank, "no rank process was seen:\n" + log.read_text()[-3000:]
        gone, alive = psutil.wait_procs(list(tree.values()), timeout=10)
        alive = [p for p in alive if _running(p)]
        assert not alive, [p.cmdline() for p in alive]
    finally:
        _kill_launch(proc)
    output = log.read_text()
    print(f"node 0 exited with {rc} {waited:.1f} s after its start")
    assert rc != 0, output[-3000:]
    assert waited > 20, f"ended {waited:.0f} s after the start: before the timeout, so not by it"
    assert "Traceback" not in output, output[-5000:]
    errors = _one_line_errors(output)
    assert len(errors) == 1 and errors[0].startswith("vim-ds train: error (rank 0): cannot initialise the process "
                                                     f"group (2 ranks meeting at 10.77.0.1:{port}, --dist-timeout 20 s)"
                                                     ), output[-3000:]
    assert "1/2 clients joined" in errors[0], errors[0]  # torch's TCPStore: what it waited for
    print(errors[0])


@pytest.fixture
def sshd_on_both(two_hosts, tmp_path):
    """An sshd in each of the two hosts' namespaces (root logs in with a key made here), and a folder whose `ssh`
    uses that key and trusts any host key: put it first on PATH. Yields that folder; stops both sshd."""
    tools = ["ssh", "ssh-keygen", "pdsh"]
    if not os.path.exists("/usr/sbin/sshd") or not all(shutil.which(t) for t in tools):
        pytest.skip("openssh-server, openssh-client and pdsh are needed (apt-get install openssh-server pdsh)")
    d = tmp_path / "ssh"
    (d / "bin").mkdir(parents=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    (d / "ssh_config").write_text(f"Host *\n  IdentityFile {d}/id\n  StrictHostKeyChecking no\n"
                                  "  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n")
    (d / "bin" / "ssh").write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {d}/ssh_config \"$@\"\n")
    (d / "bin" / "ssh").chmod(0o755)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder (made at boot by its service)
    daemons = []
    try:
        for i, (ns, _, addr) in enumerate(two_hosts):
            (d / f"sshd_{i}").write_text(
                f"ListenAddress {addr}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                f"UsePAM no\nStrictModes no\nPidFile {d}/sshd_{i}.pid\n")
            daemons.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-f",
                                             str(d / f"sshd_{i}"), "-E", str(d / f"sshd_{i}.log")]))
        env = {**os.environ, "PATH": f"{d}/bin:{os.environ['PATH']}"}
        deadline = time.time() + 30
        while True:  # until host 0 reaches both hosts over ssh
            probe = subprocess.run(["ip", "netns", "exec", two_hosts[0][0], "ssh", two_hosts[1][2], "true"],
                                   env=env, capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if time.time() > deadline:
                pytest.skip(f"sshd in a network namespace does not answer: {probe.stderr.strip()[-300:]}")
            time.sleep(0.5)
        yield d / "bin"
    finally:
        for daemon in daemons:
            daemon.terminate()
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()


@pytest.mark.slow
def test_pdsh_mode_starts_both_hosts_over_ssh_and_each_picks_its_veth(small_digits, two_hosts, sshd_on_both,
                                                                     one_node, tmp_path):
    """`HOSTFILE=... bash launch/multi_node.sh` on host 0 (ssh mode: deepspeed starts both hosts over pdsh/ssh,
    passing on only NCCL_*/PYTHON* variables): each host's ranks choose their own veth for gloo (vim_ds does, as the
    shell cannot choose for the other hosts), and the losses equal one host's 2-process run."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{addr} slots=1\n" for _, _, addr in two_hosts))
    out = tmp_path / "run"
    env = clean_env(HOSTFILE=hostfile, MASTER_PORT=_free_port(), MASTER_ADDR=two_hosts[0][2])
    env["PATH"] = f"{sshd_on_both}:{env['PATH']}"
    proc = subprocess.run(["ip", "netns", "exec", two_hosts[0][0], "bash", script("multi_node.sh"),
                           *train_args(small_digits, out, 4)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    for ns, dev, addr in two_hosts:
        assert f"{addr}: vim-ds: gloo uses network interface {dev} ({addr}) toward the master 10.77.0.1" in output, \
            output[-5000:]
    # ssh does not activate the environment: rank 0 puts this Python's folder first on PATH, so that DeepSpeed's ops
    # are not compiled again by another ninja (tests/test_build_tools.py)
    if shutil.which("ninja", path=os.path.dirname(sys.executable)):
        assert f"this Python's {os.path.dirname(sys.executable)}/ninja" in output, output[-5000:]
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]
    assert_losses_of_one_node(one_node, losses)


@pytest.mark.slow
def test_when_one_node_dies_the_other_nodes_launcher_exits_instead_of_hanging(small_digits, hostfile, tmp_path):
    """A long two-node run; after the first logged step node 1's rank is SIGKILLed (found from its launcher's
    process tree). Node 0's launcher must exit non-zero within 60 s, leaving no process behind."""
    port = _free_port()
    outs = [tmp_path / "node0", tmp_path / "node1"]
    nodes = [Node(rank, hostfile, port, train_args(small_digits, outs[rank], 1000), tmp_path / f"node{rank}.log")
             for rank in (0, 1)]
    try:
        wait_for_first_step([n.proc for n in nodes], [n.log_path for n in nodes], str(outs[0]))
        victims = nodes[1].ranks()
        assert len(victims) == 1, [p.cmdline() for p in nodes[1].descendants()]
        survivors = nodes[0].descendants()
        assert nodes[0].ranks(), "node 0 has no rank process"
        victims[0].kill()
        killed = time.time()
        try:
            rc = nodes[0].proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("node 0's launcher still runs 60 s after node 1's rank died:\n"
                        + nodes[0].output()[-3000:])
        elapsed = time.time() - killed
        # each launcher exits with its own failed rank's code: node 0's rank fails its collective (vim_ds exits 2),
        # node 1's rank was SIGKILLed (-9, which the launcher's sys.exit(-9) makes 247)
        assert rc == 2, (rc, nodes[0].output()[-3000:])
        assert nodes[1].proc.wait(timeout=60) == 247
        gone, alive = psutil.wait_procs(survivors, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        print(f"node 0's launcher exited with {rc} {elapsed:.1f} s after node 1's rank was killed")
    finally:
        for node in nodes:
            node.stop()


# How the script starts: with SIGINT at its default action (from a terminal, or a foreground job), or with SIGINT
# ignored, as every process started in the background (`cmd &`, `nohup cmd &`) by a non-interactive shell inherits it,
# and everything that process starts after it (a backgrounded CI script or pytest: Python keeps an inherited SIG_IGN
# and subprocess passes it on). bash cannot trap a signal that was ignored when it started, so the script first
# re-executes itself with SIGINT's default action (launch/common.sh); without that its INT trap did nothing, and the
# run trained to its end and exited 0 (the lost SIGINTs of 2026-11-26, docs/tests.md). The disposition is set for
# every case, so none depends on how pytest itself was started.
@pytest.mark.slow
# SIGTERM covers the plain start and the TERM trap; SIGINT with SIGINT ignored at the start covers the re-execution
# and then the INT trap, the same trap a script started with SIGINT at its default reaches (no third case needed).
@pytest.mark.parametrize("sig, sigint_at_start", [(signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_IGN)],
                         ids=["SIGTERM", "SIGINT-ignored-at-start"])
def test_a_signal_to_the_launch_script_reaches_the_ranks_which_checkpoint_before_it_exits(small_digits, tmp_path,
                                                                                          sig, sigint_at_start):
    """What SLURM's `--signal=TERM@120` does to a node, and Ctrl-C in the script's terminal: the signal to
    `single_node.sh` goes to the deepspeed launcher and the rank; the trainer saves a complete checkpoint, and the
    script returns only after every process of the launch is gone (a SLURM step ends, killing what is left, when its
    task exits). Also when the script was started with SIGINT ignored (`bash launch/single_node.sh ... &` from a
    script)."""
    out = tmp_path / "run"
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", script("single_node.sh"), *train_args(small_digits, out, 1000)], cwd=ROOT,
                                env=clean_env(NPROC=1), stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, sigint_at_start))
    launched = []
    try:
        wait_for_first_step([proc], [log_path], str(out))
        launched = psutil.Process(proc.pid).children(recursive=True)  # runner, per-node launcher, rank
        assert any("vim_ds.train" in p.cmdline() for p in launched)
        proc.send_signal(sig)
        assert proc.wait(timeout=90) != 0
        gone, alive = psutil.wait_procs(launched, timeout=1)
        alive = [p for p in alive if _running(p)]  # an exited child nobody has reaped yet (a zombie) has stopped
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in launched:
            try:
                p.kill()
            except psutil.Error:
                pass
    log = log_path.read_text()
    assert f"launch: {sig.name}: passed on to the launcher and its ranks" in log, log[-3000:]
    stopped = [line for line in log.splitlines() if line.startswith(f"stopping on {sig.name} after step ")]
    assert stopped, log[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert os.path.isfile(out / "checkpoints" / f"global_step{step}" / "vim_ds_complete.json"), log[-3000:]


@pytest.mark.slow
def test_arguments_with_spaces_and_dollar_signs_reach_the_trainer_verbatim(small_digits, tmp_path):
    """`--output_dir 'out dir $HOME x'` through single_node.sh and the deepspeed launcher: one real step, and the
    directory with exactly that name holds the run (nothing split, nothing expanded)."""
    out = tmp_path / "out dir $HOME x"
    proc = subprocess.run(["bash", script("single_node.sh"), *train_args(small_digits, out, 1)], cwd=ROOT,
                          env=clean_env(NPROC=1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["out dir $HOME x"]
    assert sorted(step_losses(out)) == [1]


# -- dry runs: multi_node.sh, single_node.sh -----------------------------------------------------------------------

def test_multi_node_dry_run_prints_this_nodes_no_ssh_command(tmp_path):
    proc = bash("multi_node.sh", "--dry-run", *TRICKY, HOSTFILE="launch/hostfile.example", NNODES=2, NODE_RANK=1,
                GPUS_PER_NODE=8)
    assert proc.stdout.startswith("# node 1 (mi300x-002)\n")
    (cmd,) = commands(proc.stdout)
    assert cmd[0] == "deepspeed" and "--no_ssh" in cmd
    assert option(cmd, "--hostfile") == "launch/hostfile.example"
    assert option(cmd, "--node_rank") == "1" and option(cmd, "--num_nodes") == "2"
    assert option(cmd, "--num_gpus") == "8"
    assert option(cmd, "--master_addr") == "mi300x-001" and option(cmd, "--master_port") == "29500"
    assert user_args(cmd) == TRICKY
    # DRY_RUN=1 is the same as --dry-run; MASTER_ADDR/MASTER_PORT are taken as given
    same = bash("multi_node.sh", *TRICKY, DRY_RUN=1, HOSTFILE="launch/hostfile.example", NNODES=2, NODE_RANK=1,
                GPUS_PER_NODE=8)
    assert same.stdout == proc.stdout
    other = bash("multi_node.sh", "--dry-run", HOSTFILE="launch/hostfile.example", NODE_RANK=3,
                 MASTER_ADDR="10.0.0.1", MASTER_PORT=1234)
    (cmd,) = commands(other.stdout)
    assert option(cmd, "--master_addr") == "10.0.0.1" and option(cmd, "--master_port") == "1234"
    assert option(cmd, "--num_nodes") == "4" and "--num_gpus" not in cmd  # the hostfile's slots


def test_multi_node_dry_run_without_node_rank_prints_every_nodes_command():
    proc = bash("multi_node.sh", "--dry-run", "--lr", "1e-3", HOSTFILE="launch/hostfile.example", NO_SSH=1,
                NNODES=3)
    cmds = commands(proc.stdout)
    assert [option(c, "--node_rank") for c in cmds] == ["0", "1", "2"]
    assert {option(c, "--master_addr") for c in cmds} == {"mi300x-001"}
    assert "# node 2 (mi300x-003)" in proc.stdout.splitlines()


def test_multi_node_dry_run_over_ssh_is_one_pdsh_command():
    proc = bash("multi_node.sh", "--dry-run", *TRICKY, HOSTFILE="launch/hostfile.example", GPUS_PER_NODE=4)
    (cmd,) = commands(proc.stdout)
    assert "--no_ssh" not in cmd and "--node_rank" not in cmd and "--master_addr" not in cmd
    assert option(cmd, "--launcher") == "pdsh" and option(cmd, "--num_gpus") == "4"
    assert user_args(cmd) == TRICKY


def test_single_node_dry_run(tmp_path):
    proc = bash("single_node.sh", "--dry-run", *TRICKY, NPROC=4, MASTER_PORT=29555)
    assert commands(proc.stdout) == [["deepspeed", "--num_gpus", "4", "--master_port", "29555", "--module",
                                      "vim_ds.train", *TRICKY]]
    proc = bash("single_node.sh", "--lr", "1", DRY_RUN=1, GPUS_PER_NODE=3)
    (cmd,) = commands(proc.stdout)
    # a port of its own choosing, from below the kernel's ephemeral range (vim_ds/runtime/ports.py)
    from vim_ds.runtime.ports import LOWEST, ephemeral_low

    assert option(cmd, "--num_gpus") == "3" and LOWEST <= int(option(cmd, "--master_port")) < ephemeral_low()
    # with ROCm present the env file is sourced (VIM_DS_GPU_ENV forces the detection here)
    proc = bash("single_node.sh", "--dry-run", NPROC=1, VIM_DS_GPU_ENV="rocm")
    assert f"# environment: source {script('env_rocm.sh')}" in proc.stdout


@pytest.mark.parametrize("name, env, message", [
    ("multi_node.sh", {"HOSTFILE": "no/such/hostfile"}, "hostfile not found: 'no/such/hostfile'"),
    ("multi_node.sh", {"HOSTFILE": "launch/hostfile.example", "NO_SSH": 1}, "NODE_RANK is required"),
    ("multi_node.sh", {"HOSTFILE": "launch/hostfile.example", "NODE_RANK": 4}, "NODE_RANK must be 0..3"),
    ("multi_node.sh", {"HOSTFILE": "launch/hostfile.example", "NNODES": 9}, "lists only 4 hosts"),
    ("multi_node.sh", {"HOSTFILE": "launch/hostfile.example", "GPUS_PER_NODE": "x"}, "GPUS_PER_NODE must be"),
    ("single_node.sh", {"NPROC": 0}, "NPROC must be a positive integer"),
    ("slurm_node.sh", {}, "SLURM_JOB_NODELIST is not set"),
])
def test_bad_settings_are_one_line_errors(name, env, message):
    proc = bash(name, "--lr", "1", check=False, **env)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{name}: error: ")


def test_a_malformed_hostfile_is_a_one_line_error(tmp_path):
    bad = tmp_path / "hostfile"
    bad.write_text("node1 slots=8\nnode2 8\n")
    proc = bash("multi_node.sh", "--dry-run", check=False, HOSTFILE=bad)
    assert proc.returncode == 2 and "every line must be 'HOST slots=N'" in proc.stderr


# -- SLURM ---------------------------------------------------------------------------------------------------------

EXPAND = r'''
import re, sys

def expand(nodelist):
    """mi300x-[007-008,010],gpu1 -> mi300x-007 mi300x-008 mi300x-010 gpu1 (SLURM's hostlist syntax)."""
    hosts = []
    for prefix, ranges, rest in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        if not ranges:
            hosts.append(prefix + rest)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{rest}")
    return hosts
'''

FAKE_SCONTROL = EXPAND + r'''
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(expand(sys.argv[3])))
'''

FAKE_SRUN = EXPAND + r'''
import os, subprocess
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
for i, host in enumerate(expand(os.environ["SLURM_JOB_NODELIST"])):  # one task per node, one after the other
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURMD_NODENAME=host)
    rc = subprocess.call(args, env=env)
    if rc:
        sys.exit(rc)
'''


@pytest.fixture
def fake_slurm(tmp_path):
    """Stand-ins for SLURM's `scontrol show hostnames` and `srun` (one task per node, run here one after the
    other), put first on PATH: SLURM's daemons cannot run on this machine. The SLURM_* variables are the test's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(0o755)

    def slurm_env(**extra):
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "mi300x-[007-008,010]", "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3",
               "SLURM_SUBMIT_DIR": ROOT}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    return slurm_env


def test_slurm_node_rank_master_address_and_gpus_from_slurm_variables(fake_slurm, tmp_path):
    env = fake_slurm(SLURM_NODEID=2, SLURM_PROCID=2, SLURMD_NODENAME="mi300x-010", SLURM_GPUS_ON_NODE=8)
    proc = bash("slurm_node.sh", "--dry-run", *TRICKY, **env)
    assert "# node 2 (mi300x-010)" in proc.stdout
    (cmd,) = commands(proc.stdout)
    assert cmd[0] == "deepspeed" and "--no_ssh" in cmd
    assert option(cmd, "--node_rank") == "2" and option(cmd, "--master_addr") == "mi300x-007"
    assert option(cmd, "--num_nodes") == "3" and option(cmd, "--num_gpus") == "8"
    assert option(cmd, "--master_port") == str(20000 + 4242)
    assert user_args(cmd) == TRICKY
    hostfile = option(cmd, "--hostfile")
    assert hostfile == str(tmp_path / "vim_ds_hostfile.4242.2")
    with open(hostfile) as f:
        assert f.read() == "mi300x-007 slots=8\nmi300x-008 slots=8\nmi300x-010 slots=8\n"

    # one task per node: SLURM_PROCID stands in for SLURM_NODEID; GPUS_PER_NODE and MASTER_* override
    proc = bash("slurm_node.sh", "--dry-run", **fake_slurm(SLURM_PROCID=1, GPUS_PER_NODE=4, MASTER_ADDR="10.1.1.7",
                                                           MASTER_PORT=29400))
    (cmd,) = commands(proc.stdout)
    assert option(cmd, "--node_rank") == "1" and option(cmd, "--num_gpus") == "4"
    assert option(cmd, "--master_addr") == "10.1.1.7" and option(cmd, "--master_port") == "29400"

    # a node whose rank does not match its place in the node list would wait forever for the rendezvous
    proc = bash("slurm_node.sh", "--dry-run", check=False,
                **fake_slurm(SLURM_NODEID=0, SLURMD_NODENAME="mi300x-008", SLURM_GPUS_ON_NODE=8))
    assert proc.returncode == 2 and "node rank 0 is mi300x-007" in proc.stderr


def test_slurm_node_with_torchrun(fake_slurm):
    env = fake_slurm(SLURM_NODEID=1, SLURM_GPUS_ON_NODE=8, LAUNCHER="torchrun")
    (cmd,) = commands(bash("slurm_node.sh", "--dry-run", *TRICKY, **env).stdout)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert option(cmd, "--nnodes") == "3" and option(cmd, "--nproc_per_node") == "8"
    assert option(cmd, "--node_rank") == "1" and option(cmd, "--master_addr") == "mi300x-007"
    assert option(cmd, "--master_port") == "24242"
    assert cmd[cmd.index("-m", 3):] == ["-m", "vim_ds.train", *TRICKY]
    (cmd,) = commands(bash("slurm_node.sh", "--dry-run", **env, TORCHRUN_RDZV=1).stdout)
    assert option(cmd, "--rdzv_backend") == "c10d" and option(cmd, "--rdzv_endpoint") == "mi300x-007:24242"
    assert option(cmd, "--rdzv_id") == "4242" and "--node_rank" not in cmd


@pytest.mark.parametrize("batch, launcher", [("slurm_mi300x.sbatch", "deepspeed"),
                                             ("slurm_mi250.sbatch", "deepspeed"),
                                             ("slurm_torchrun.sbatch", "torchrun")])
def test_sbatch_scripts_start_one_launcher_per_node(fake_slurm, batch, launcher):
    """The batch script as SLURM would run it (from a spool copy, in SLURM_SUBMIT_DIR), with DRY_RUN=1: every node
    prints its command, ranks 0..2, all pointing at the allocation's first host, 8 ranks per node."""
    with open(script(batch)) as f:
        text = f.read()
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=TERM@120", "#SBATCH --requeue",
                 "#SBATCH --gpus-per-node=8"):
        assert line in text.splitlines(), line
    proc = subprocess.run(["bash", script(batch), *TRICKY], cwd="/", capture_output=True, text=True, timeout=120,
                          env=clean_env(**fake_slurm(DRY_RUN=1)))
    assert proc.returncode == 0, proc.stderr
    banner = {"slurm_mi300x.sbatch": "x 8 MI300X", "slurm_mi250.sbatch": "x 8 MI250 GCDs",
              "slurm_torchrun.sbatch": "x 8 GPUs, torchrun"}[batch]
    assert banner in proc.stdout.splitlines()[0], proc.stdout[:500]  # (tests/test_slurm.py runs two under SLURM)
    cmds = commands(proc.stdout.split("\n", 1)[1])  # the first line is the job banner
    assert len(cmds) == 3
    for rank, cmd in enumerate(cmds):
        if launcher == "deepspeed":
            assert option(cmd, "--node_rank") == str(rank) and option(cmd, "--master_addr") == "mi300x-007"
            assert option(cmd, "--num_gpus") == "8" and option(cmd, "--num_nodes") == "3"
            assert user_args(cmd) == TRICKY
        else:
            assert option(cmd, "--node_rank") == str(rank) and option(cmd, "--master_addr") == "mi300x-007"
            assert option(cmd, "--nproc_per_node") == "8" and option(cmd, "--nnodes") == "3"
            assert cmd[cmd.index("-m", 3):] == ["-m", "vim_ds.train", *TRICKY]


# -- environment files and docker ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["env_rocm.sh", "env_nvidia.sh"])
def test_env_files_set_only_what_is_unset_and_leave_shell_options_alone(name):
    probe = (f'source {shlex.quote(script(name))}; set -o | grep -E "^(errexit|nounset) "; '
             'env | grep -E "^(NCCL_|HSA_|MIOPEN_|OMP_NUM_THREADS|TORCH_NCCL)" | sort')
    out = subprocess.run(["bash", "-c", probe], env=clean_env(NCCL_SOCKET_IFNAME="ens 1", GPUS_PER_NODE=1),
                         capture_output=True, text=True, check=True).stdout
    assert "errexit        \toff" in out and "nounset        \toff" in out
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert values["NCCL_SOCKET_IFNAME"] == "ens 1"  # the user's value wins
    assert values["NCCL_DEBUG"] == "WARN" and values["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert values["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))  # the node's cores / 1 rank
    if name == "env_rocm.sh":
        assert values["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
        import socket
        host = socket.gethostname().split(".")[0]
        assert host in values["MIOPEN_USER_DB_PATH"] and host in values["MIOPEN_CUSTOM_CACHE_DIR"]
    debug = subprocess.run(["bash", script(name)], env=clean_env(VIM_DS_NCCL_DEBUG=1), capture_output=True,
                           text=True, check=True).stdout
    assert "export NCCL_DEBUG=INFO" in debug.splitlines()


def test_docker_rocm_dry_run(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out $x"
    data.mkdir()
    proc = bash("docker_rocm.sh", "--dry-run", "bash", "-c", "echo $HOME && ls", DATA=data, OUT=out,
                IMAGE="rocm/pytorch:rocm6.4_ubuntu24.04_py3.12_pytorch_release_2.6.0", NCCL_DEBUG="INFO")
    (cmd,) = commands(proc.stdout)
    assert cmd[:3] == ["docker", "run", "--rm"]
    for flag in ("--device=/dev/kfd", "--device=/dev/dri", "--ipc=host", "--network=host"):
        assert flag in cmd
    assert option(cmd, "--group-add") == "video" and option(cmd, "--security-opt") == "seccomp=unconfined"
    assert option(cmd, "--shm-size") == "64g"
    volumes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-v"]
    assert f"{ROOT}:{ROOT}" in volumes and f"{data}:{data}:ro" in volumes and f"{out}:{out}" in volumes
    assert option(cmd, "-w") == ROOT and "NCCL_DEBUG" in cmd
    assert cmd[-4:] == ["rocm/pytorch:rocm6.4_ubuntu24.04_py3.12_pytorch_release_2.6.0", "bash", "-c",
                        "echo $HOME && ls"]
    assert not out.exists()  # a dry run creates nothing


# -- lint ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_shell_scripts_are_clean(path):
    with open(path) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash\n"), "shebang"
    if "/launch/" in path:
        assert "set -euo pipefail" in text
    syntax = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if shutil.which("shellcheck") is None:
        # CI claims to lint every script: there a missing shellcheck is a failure, not a silent skip
        message = "shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {message}: the launch scripts would go unlinted")
        pytest.skip(message)
    lint = subprocess.run(["shellcheck", path], capture_output=True, text=True, cwd=os.path.dirname(path))
    assert lint.returncode == 0, lint.stdout
