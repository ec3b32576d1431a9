"""Python processes for the suite, forked from a server that has already imported the heavy libraries.

Why: the suite is bound by the number of Python processes it starts. Each `python -m vim_ds.train` (or `.convert`,
`.eval`, ...) spends about 5 CPU-seconds importing torch, torchvision, timm and DeepSpeed (with torch._dynamo and
torch._inductor behind them) before it does anything, and a tiny training run is mostly that. This module starts
one server per test process that imports those libraries once and then forks a child for each command: the child
runs the very code `python -m MODULE ARGS` runs (`runpy`'s `-m` entry point, in a fresh `__main__`, with the
command's argv, environment, working directory and standard streams), so what a test checks is the product's own
behaviour; only the import work is shared.

What keeps it honest:
- Fork safety. The server imports and does nothing else: no tensor op, no process group, no thread (numpy's
  OpenBLAS pool, which OpenBLAS itself shuts down around a fork, is the one exception, and the server refuses to
  fork if any other thread exists). vim_ds itself is not preloaded: its modules read the environment at import
  (fault injection, the scan backend), so each child imports them under its own environment.
- What a fresh interpreter sets from the environment at start-up is set again in the child: stdout/stderr buffering
  (`PYTHONUNBUFFERED`), `sys.path` (`PYTHONPATH`, and a `sitecustomize` it brings: the negative controls of
  tests/test_resume_exact.py put a bug back that way), OpenMP's thread count (`OMP_NUM_THREADS`, which libgomp reads
  when torch loads it), numpy's global seed (a fresh process draws its own), the temporary folder (`TMPDIR`, which
  tempfile caches at its first use, which the server's imports make; tests/faults/test_process_exit.py fails without).
- Several ranks (`torchrun --standalone --nproc_per_node N -m MODULE`) are forked side by side with the variables
  torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*, OMP_NUM_THREADS=1),
  and, as torchrun does, the others are stopped when one fails and the job's exit code is then 1.
- A vim_ds command that starts vim_ds commands itself (`vim-ds zero-compare`'s torchrun jobs through
  `launched_runs`, a resumed run's universal conversion through `checkpointing`), started with `nested_env`, has
  them forked from the same server (tests/nested_launches), and their CPU is counted for the test that started it.
- The suite's own helper scripts in tests/ (`python tests/SCRIPT.py ARGS`, or under the torchrun form above) are
  forked the same way.
- Only the command shapes above go through the server. Everything else (`-c`, other scripts, the deepspeed launcher,
  torchrun with other options, the launch scripts, SLURM) is started as a real process, and every launcher keeps
  end-to-end tests of its own. `VIM_DS_TEST_FORK_SERVER=0` starts every command as a real process, for comparison.
"""
from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

# The libraries every vim_ds command imports. Third-party only: see the module docstring. DeepSpeed's Muon module,
# which `deepspeed.initialize` imports for ZeRO 1-3, wraps functions in `torch.compile` at import, and that pulls in
# most of torch._inductor, torch._functorch and networkx (about 730 modules: 1.5 of a forked rank's 2.2 CPU-seconds
# for a 7-step run, measured under cProfile); torch.utils.cpp_extension (setuptools), DeepSpeed's op builders and
# expert-parallel layers, timm's losses and schedulers and PIL's PNG reader are the rest of what a run imports.
PRELOAD = ["numpy", "torch", "torchvision", "timm", "timm.layers", "timm.data", "timm.loss", "timm.scheduler",
           "deepspeed", "torch._dynamo", "torch._inductor", "torch.distributed.elastic.multiprocessing",
           "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.ops.op_builder.all_ops",
           "deepspeed.module_inject.auto_ep_layer", "deepspeed.comm.mori", "torch.utils.cpp_extension",
           "PIL.Image", "PIL.PngImagePlugin", "safetensors.torch", "yaml", "psutil"]
ENABLED = os.environ.get("VIM_DS_TEST_FORK_SERVER", "1") != "0"
_TESTS = os.path.dirname(os.path.abspath(__file__))
_HEADER = struct.Struct("!I")


# -- the server ------------------------------------------------------------------------------------------------------

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(path: str, ready_fd: int) -> None:
    """Import PRELOAD, say so on `ready_fd`, then fork a child per request until standard input (a pipe from the test
    process) closes."""
    import importlib
    import warnings

    importlib.import_module("numpy")
    allowed = _threads()  # the main thread and OpenBLAS's pool (reset by OpenBLAS's own fork handlers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # an optional part this install lacks: the child imports what it needs itself
    if _threads() > allowed:
        raise SystemExit(f"preloaded: importing the libraries started {_threads() - allowed} thread(s): forking "
                         f"from here would not be safe")
    base_path = list(sys.path[1:])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    children = set()
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [], 1.0)
        for pid in list(children):  # reap the request handlers that are done
            if os.waitpid(pid, os.WNOHANG)[0]:
                children.discard(pid)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test process is gone
        if server not in ready:
            continue
        conn, _ = server.accept()
        request, fds = _receive(conn)
        if _threads() > allowed:
            conn.sendall(_frame({"error": "the fork server has threads: refusing to fork"}))
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            try:
                _handle(conn, request, fds, base_path)
            finally:
                os._exit(0)
        children.add(pid)
        conn.close()
        for fd in fds:
            os.close(fd)


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return _HEADER.pack(len(data)) + data


def _read_frame(conn: socket.socket, fds_wanted: int = 0):
    """One length-prefixed JSON message (and up to `fds_wanted` passed file descriptors); None at end of stream."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, fds_wanted)
    if not header:
        return None, fds
    while len(header) < _HEADER.size:
        header += conn.recv(_HEADER.size - len(header))
    (size,) = _HEADER.unpack(header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("preloaded: the message was cut short")
        data += chunk
    return json.loads(data), fds


def _receive(conn: socket.socket):
    request, fds = _read_frame(conn, 3)
    if request is None or len(fds) != 3:
        raise ConnectionError("preloaded: a request needs its stdin, stdout and stderr")
    return request, fds


def _handle(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    """In a forked handler: start the command's process(es), report their pids, wait, report their exit codes."""
    nproc = request["nproc"]
    port = free_port() if nproc > 1 else None
    # the ranks import vim_ds under their own sys.path and environment (a worktree's PYTHONPATH, VIM_DS_* read at
    # import), as a single process does: none of it may be left from an earlier request
    for name in [name for name in sys.modules if name == "vim_ds" or name.startswith("vim_ds.")]:
        del sys.modules[name]
    pids = []
    for rank in range(nproc):
        env = dict(request["env"])
        if nproc > 1:  # what torchrun --standalone gives each worker
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                       ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                       TORCHELASTIC_RUN_ID="none", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
            env.setdefault("OMP_NUM_THREADS", "1")
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become(request, fds, env, base_path)  # never returns
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    conn.sendall(_frame({"pids": pids}))
    codes, cpu = _wait_all(pids, stop_on_failure=nproc > 1)
    conn.sendall(_frame({"codes": codes, "cpu": cpu}))
    conn.close()


def _wait_all(pids: list[int], stop_on_failure: bool) -> tuple[dict, float]:
    """Wait for every pid; with `stop_on_failure`, as torchrun's agent: when one fails, SIGTERM the others, and
    SIGKILL those still there 30 s later. Returns the exit codes and the CPU seconds the processes used (with the
    processes they waited for: data-loader workers and their fork server)."""
    codes, deadline, cpu = {}, None, 0.0
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in pids:
                    if other not in codes:
                        _signal(other, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        cpu += usage.ru_utime + usage.ru_stime
        codes[pid] = os.waitstatus_to_exitcode(status)
        if stop_on_failure and codes[pid] != 0 and deadline is None:
            for other in pids:
                if other not in codes:
                    _signal(other, signal.SIGTERM)
            deadline = time.monotonic() + 30
    return {str(pid): code for pid, code in codes.items()}, cpu


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _become(request: dict, fds: list[int], env: dict, base_path: list[str]) -> None:
    """Turn this forked child into `python -m MODULE ARGS` (or `python SCRIPT ARGS`) and run it to its end."""
    import atexit
    import io
    import runpy
    import threading
    import types

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        # What a fresh interpreter would take from its environment at start-up.
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered
                                      else io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      write_through=unbuffered, line_buffering=os.isatty(1))
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False) if unbuffered
                                      else io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      errors="backslashreplace", write_through=unbuffered, line_buffering=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        script = request["module"] if request["module"].endswith(".py") else None
        sys.path[:] = [os.path.dirname(os.path.abspath(script)) if script else os.getcwd(), *extra, *base_path]
        for name in ("sitecustomize", "usercustomize"):  # what `site` imports at start-up, before the module runs
            if any(os.path.exists(os.path.join(p, name + ".py")) or os.path.isdir(os.path.join(p, name))
                   for p in extra):
                sys.modules.pop(name, None)
                __import__(name)
        if env.get("OMP_NUM_THREADS", "").isdigit():
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import numpy

        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
        # the temporary folder ($TMPDIR): the server's imports may have asked for it, and tempfile
        # keeps the first answer; multiprocessing keeps its pymp-* folder the same way
        import multiprocessing.process
        import tempfile

        tempfile.tempdir = None
        multiprocessing.process.current_process()._config.pop("tempdir", None)
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        sys.argv = [script or "-m", *request["args"]]
        try:
            if script:  # `python SCRIPT ARGS`
                runpy.run_path(script, run_name="__main__")
            else:
                runpy._run_module_as_main(request["module"], alter_argv=True)
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT and the like), below the ephemeral range (see
    vim_ds/runtime/ports.py: a port from that range can be taken by an outgoing connection before the master binds).
    ports.py is loaded by path from the tree these tests belong to, as launch/single_node.sh runs it: the server's
    sys.path holds no PYTHONPATH (see `_server_path`), so `import vim_ds` there would find the installed package, which
    can be another tree (the editable install of another checkout, with another layout)."""
    path = os.path.join(os.path.dirname(_TESTS), "vim_ds", "runtime", "ports.py")
    spec = importlib.util.spec_from_file_location("_vim_ds_ports", path)
    ports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ports)
    return ports.free_port()


# -- the client (the test process) ----------------------------------------------------------------------------------

_SERVER = {}  # pid of this test process -> (Popen of the server, socket path)
# What a command started with `nested_env` inherits: the test's server, and the file its forked commands' CPU goes to
_NESTED_SOCKET, _NESTED_CPU = "VIM_DS_TEST_PRELOADED_SOCKET", "VIM_DS_TEST_PRELOADED_CPU_FILE"
_NESTED_SITE = os.path.join(_TESTS, "nested_launches")
_FORKED_CPU = [0.0]  # CPU seconds of the commands this test process ran in the server, as the server reported them


def cpu_seconds() -> float:
    """The CPU this test process's commands used in the server, and the server itself (its imports): what a real
    child process's CPU would have added to RUSAGE_CHILDREN (for `--cpu-durations`)."""
    entry = _SERVER.get(os.getpid())
    server = 0.0
    if entry and entry[0].poll() is None:
        try:
            with open(f"/proc/{entry[0].pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return _FORKED_CPU[0] + server


def _server_path() -> str | None:
    """The server's socket, started on first use by this test process (None when it cannot run here); in a command
    started with `nested_env`, the socket of the test's server."""
    if os.environ.get(_NESTED_SOCKET):
        return os.environ[_NESTED_SOCKET]
    if os.getpid() in _SERVER:
        return _SERVER[os.getpid()][1]
    folder = tempfile.mkdtemp(prefix="vim_ds_preloaded.")
    path = os.path.join(folder, "socket")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIM_DS_", "PYTHONPATH"))}
    # torch 2.4's inductor starts its compile workers' pool at import, with a thread that reads their answers (the
    # server then refuses to fork); the server only imports, and a forked command that compiles starts its pool
    # then, as it would without the warm pool. Newer torch starts the pool only when it compiles.
    env["TORCH_WARM_POOL"] = "0"
    ready_read, ready_write = os.pipe()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path, str(ready_write)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env=env, cwd=folder, pass_fds=[ready_write])
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        line = ready.readline().decode().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"preloaded: the fork server did not start (said {line!r}, exit {proc.wait()})")
    _SERVER[os.getpid()] = (proc, path)
    import atexit

    atexit.register(stop_server)
    return path


def stop_server() -> None:
    entry = _SERVER.pop(os.getpid(), None)
    if entry:
        proc, path = entry
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        import shutil

        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def parse_command(cmd) -> tuple[str, list[str], int] | None:
    """(module, args, nproc) for `python -m MODULE ARGS` and `python -m torch.distributed.run --standalone
    --nproc_per_node=N -m MODULE ARGS` with this interpreter and a vim_ds module, or that torchrun form with one of
    the suite's scripts in tests/ instead of `-m MODULE` (MODULE is then the script's path), and `python SCRIPT ARGS`
    for one of those scripts; None for any other command."""
    cmd = [str(c) for c in cmd]
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py") \
            and os.path.dirname(os.path.abspath(cmd[1])) == _TESTS:
        return cmd[1], cmd[2:], 1
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return None
    module, args, nproc = cmd[2], cmd[3:], 1
    if module == "torch.distributed.run":
        if not (len(args) >= 3 and args[0] == "--standalone" and args[1].startswith("--nproc_per_node=")):
            return None
        nproc = int(args[1].split("=", 1)[1])
        if args[2] == "-m" and len(args) >= 4:
            module, args = args[3], args[4:]
        elif os.path.dirname(os.path.abspath(args[2])) == _TESTS:  # one of the suite's own scripts
            module, args = args[2], args[3:]
        else:
            return None
    return (module, args, nproc) if module.split(".")[0] == "vim_ds" or module.endswith(".py") else None


class Process:
    """A command running in the fork server: the part of subprocess.Popen the tests use (pid of its one process or
    first rank, pids, poll, wait, communicate, send_signal, terminate, kill, returncode)."""

    def __init__(self, module: str, args: list[str], nproc: int, env=None, cwd=None, new_session=False):
        self.args = [module, *args]
        self._nested_cpu = (env or {}).get(_NESTED_CPU) if not os.environ.get(_NESTED_CPU) else None
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_path())
        request = {"module": module, "args": [str(a) for a in args], "nproc": nproc,
                   "env": dict(os.environ if env is None else env), "cwd": os.path.abspath(cwd or os.getcwd()),
                   "new_session": new_session}
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(self._conn, [_frame(request)], [stdin, self._out.fileno(), self._err.fileno()])
        finally:
            os.close(stdin)
        reply, _ = _read_frame(self._conn)
        if reply is None or "error" in reply:
            raise RuntimeError(f"preloaded: {reply and reply['error'] or 'the server closed the connection'}")
        self.pids = reply["pids"]
        self.pid = self.pids[0]
        self.returncode = None
        self.codes = None

    def poll(self):
        # readable means the report has begun to arrive (or the handler died): read it whole, blocking, rather than
        # non-blocking reads that could stop part-way through a message and lose its first bytes
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def _collect(self):
        reply, _ = _read_frame(self._conn)
        if reply is None:
            raise ConnectionError("preloaded: the server's handler died before reporting exit codes")
        self.codes = {int(p): c for p, c in reply["codes"].items()}
        _FORKED_CPU[0] += reply["cpu"]
        if os.environ.get(_NESTED_CPU):  # a command of a command: its CPU, for the test that started the outer one
            with open(os.environ[_NESTED_CPU], "a") as f:
                f.write(f"{reply['cpu']}\n")
        if self._nested_cpu:
            with open(self._nested_cpu) as f:
                _FORKED_CPU[0] += sum(float(line) for line in f if line.strip())
            os.remove(self._nested_cpu)
        codes = [self.codes[p] for p in self.pids]
        if len(codes) == 1:
            self.returncode = codes[0]
        else:
            self.returncode = 0 if all(c == 0 for c in codes) else 1
            if self.returncode:
                failed = ", ".join(f"rank {r} (pid {p}) exit {c}" for r, (p, c) in
                                   enumerate(zip(self.pids, codes)) if c != 0)
                self._err.write(f"preloaded: torchrun-like launch failed: {failed}\n".encode())
        self._conn.close()

    def wait(self, timeout=None):
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._collect()
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                if self._conn.fileno() >= 0:
                    self._conn.settimeout(None)
        return self.returncode

    def output(self, text: bool = True):
        streams = []
        for f in (self._out, self._err):
            f.seek(0)
            data = f.read()
            f.seek(0, os.SEEK_END)
            streams.append(data.decode(errors="backslashreplace") if text else data)
        return tuple(streams)

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.output()

    def send_signal(self, signum):
        for pid in self.pids if self.returncode is None else ():
            _signal(pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run(cmd, *, timeout=None, env=None, cwd=None, text=False, capture_output=False, check=False,
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, ...) with the command forked from the preloaded server when it has
    one of the shapes of `parse_command`, and started as a real process otherwise."""
    parsed = parse_command(cmd) if ENABLED and capture_output and not kwargs else None
    if parsed is None:
        return subprocess.run(cmd, timeout=timeout, env=env, cwd=cwd, text=text, capture_output=capture_output,
                              check=check, **kwargs)
    proc = Process(*parsed, env=env, cwd=cwd)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        out, err = proc.output(text)
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    out, err = proc.output(text)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def nested_env(env: dict) -> dict:
    """`env` for a vim_ds command that itself starts vim_ds commands (`vim-ds zero-compare`'s torchrun jobs, a
    resumed run's universal conversion): those are forked from this test process's server too
    (tests/nested_launches/sitecustomize.py), and their CPU is counted for this test."""
    if not ENABLED:
        return env
    fd, cpu_file = tempfile.mkstemp(prefix="vim_ds_nested_cpu.")
    os.close(fd)
    path = os.pathsep.join([_NESTED_SITE, _TESTS, *[p for p in [env.get("PYTHONPATH", "")] if p]])
    return {**env, _NESTED_SOCKET: _server_path(), _NESTED_CPU: cpu_file, "PYTHONPATH": path}


def outer_env(env: dict) -> dict:
    """`env` without what `nested_env` added (for the runs a nested command starts: they start nothing)."""
    added = {_NESTED_SITE, _TESTS}
    path = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in added)
    env = {k: v for k, v in env.items() if k not in (_NESTED_SOCKET, _NESTED_CPU, "PYTHONPATH")}
    return {**env, "PYTHONPATH": path} if path else env


def popen(cmd, *, env=None, cwd=None, start_new_session=False):
    """subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, ...) for a command that runs in the background,
    forked from the preloaded server when it has one of the shapes of `parse_command` (its output is read with
    communicate() as from a real process)."""
    parsed = parse_command(cmd) if ENABLED else None
    if parsed is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                                start_new_session=start_new_session)
    return Process(*parsed, env=env, cwd=cwd, new_session=start_new_session)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
