import os
import shutil
from pathlib import Path

import pytest

# OpenMP threads waiting for work sleep instead of spinning. The suite's processes (two xdist workers, the lane
# beside them, the ranks and commands they start) always share the two cores, and an OpenMP team that spins while it
# waits (libgomp's default) takes the cores from the others: on the 2-core Xeon (2026-11-28) test_scan_state.py
# took 9.6 s alone, 50.8 s beside test_selective_scan.py, 11.0 s beside it with passive waiting. How threads wait,
# not how many there are: every result stays bit for bit the same. Set before torch loads libgomp, which reads it
# once (where something loaded torch before this file, only the processes the suite starts see it); every process
# the suite starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from vim_ds.runtime.build_tools import extensions_dir_per_install  # noqa: E402

# DeepSpeed's JIT ops (cpu_adam) go where a vim_ds run puts them (its cache folder per torch and DeepSpeed
# installation), also for the suite's scripts that start DeepSpeed without vim_ds (tests/test_ds_config.py's engine
# script): each op is built once per run of the suite. tests/faults/test_shared_memory.py checks that vim_ds chooses
# that folder itself.
extensions_dir_per_install(os.environ)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or long-running tests (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped without one)")


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that used the most CPU time (the test process and every process it "
                          "started and waited for: launchers, ranks), and the whole run's CPU time against its wall "
                          "time. Unlike --durations, barely moved by other work on a shared machine.")


def _cpu_seconds() -> float:
    """This process's CPU, its waited-for children's, and that of the commands it ran in the preloaded fork server
    (tests/preloaded.py), which are the server's children, not this process's."""
    import resource

    import preloaded

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + preloaded.cpu_seconds()


_CPU = {}          # test id -> CPU seconds (under pytest-xdist: in the controller, from the workers' reports)
_WALL = {}         # test id -> wall seconds of setup + call + teardown
_WORKERS_CPU = {}  # pytest-xdist worker -> CPU seconds of its whole session, sent with its last report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The count starts before the setup (a module's fixtures are made in its first test's setup: shared runs)."""
    item._cpu_start = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The CPU seconds of setup + call + teardown ride on the teardown report, so that pytest-xdist carries them
    from a worker to the controller, which prints the list."""
    outcome = yield
    if call.when == "teardown":
        report = outcome.get_result()
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item._cpu_start))
        if os.environ.get("PYTEST_XDIST_WORKER"):
            report.user_properties.append(("worker_cpu_seconds", _cpu_seconds() - item.config._cpu_start[0]))


def pytest_runtest_logreport(report):
    _WALL[report.nodeid] = _WALL.get(report.nodeid, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "cpu_seconds":
            _CPU[report.nodeid] = value
        elif key == "worker_cpu_seconds" and hasattr(report, "node"):  # in the controller, from a worker
            _WORKERS_CPU[report.node.gateway.id] = value  # the latest: the worker's session so far


def pytest_sessionstart(session):
    import time

    session.config._cpu_start = (_cpu_seconds(), time.monotonic())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import time

    count = config.getoption("--cpu-durations")
    if not count or not _CPU:
        return
    cpu0, wall0 = config._cpu_start
    cpu, wall = _cpu_seconds() - cpu0, time.monotonic() - wall0
    if _WORKERS_CPU:  # pytest-xdist's controller: its workers' own accounts (reaped workers are in its children too)
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF)
        cpu = own.ru_utime + own.ru_stime - cpu0 + sum(_WORKERS_CPU.values())
    terminalreporter.section(f"most CPU time, {count} tests")
    for nodeid, seconds in sorted(_CPU.items(), key=lambda kv: -kv[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.1f} s CPU  {nodeid}")
    terminalreporter.section("time and CPU per file")
    files = {}
    for nodeid in set(_CPU) | set(_WALL):
        entry = files.setdefault(nodeid.split("::")[0], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += _WALL.get(nodeid, 0.0)
        entry[2] += _CPU.get(nodeid, 0.0)
    terminalreporter.write_line(f"{'wall s':>8} {'CPU s':>8} {'tests':>6}  file")
    for path, (tests, wall_s, cpu_s) in sorted(files.items(), key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(f"{wall_s:8.0f} {cpu_s:8.0f} {tests:6d}  {path}")
    terminalreporter.write_line(f"the run: {cpu:.0f} s CPU in {wall:.0f} s wall on {os.cpu_count()} cores "
                                f"({100 * cpu / max(wall * (os.cpu_count() or 1), 1e-9):.0f} % of them busy) of "
                                f"{_cpu_model()}")


def _cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's `model name`): the suite's times are compared per machine kind."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "a CPU")
    except OSError:
        return "a CPU"


# The files that take longest (minutes each, most of it in one file's module fixtures or waiting on timeouts and
# SLURM), started first under pytest-xdist (`bash tools/test.sh`: -n 2 --dist loadfile --no-loadscope-reorder) so
# that the run does not end with one worker still in one of them while the other idles; longest first, as measured on
# one worker on 2026-11-27 (2 cores). In a pytest-xdist run of everything the first two go to the two workers
# together: the real-SLURM jobs, which mostly sleep until SLURM's signal, beside the CPU-bound launch tests;
# `bash tools/test.sh` runs the files that mostly wait (test_slurm.py, test_launch.py, the dead and signalled ranks,
# the stalled loaders, the exact resumes) in two lanes of their own beside the two workers instead.
LONG_FILES = ["test_slurm.py", "test_launch.py", "faults/test_dead_ranks.py", "test_resume_exact.py", "test_train.py",
              "test_convert.py", "faults/test_signals.py", "test_loader.py", "test_configs.py", "test_zero_compare.py",
              "test_compile_check.py", "test_kernel_races.py", "faults/test_data_faults.py", "test_state_bytes.py",
              "test_compile.py", "test_autocast.py", "test_imports.py"]


def _long_first(item) -> int:
    path = item.nodeid.split("::")[0]
    return next((i for i, name in enumerate(LONG_FILES) if path.endswith("tests/" + name)), len(LONG_FILES))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_long_first)  # stable: each file's own order, and the files after these, are kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Tests choose their backend explicitly; a developer's VIM_DS_SCAN or VIM_DS_NORM (or VIM_DS_CPU_ISA, for the
    subprocesses tests start) must not leak in."""
    monkeypatch.delenv("VIM_DS_SCAN", raising=False)
    monkeypatch.delenv("VIM_DS_NORM", raising=False)
    monkeypatch.delenv("VIM_DS_CPU_ISA", raising=False)
    yield


# The CPU kernel is compiled once per x86-64 instruction set (16-, 32- and 64-byte vectors: different lane sums,
# partial-sum folds and loop shapes); each variant this CPU can run is checked. AVX-512 needs a CPU that has it
# (the CI machine type is sometimes an AVX2-only EPYC): there it is skipped, as the GPU tests are without a GPU.
X86_ISAS = ["sse2", "avx2", "avx512"]


@pytest.fixture(params=X86_ISAS)
def cpu_isa(request):
    """Runs the test with the CPU kernel's `request.param` variant forced, restoring the automatic choice after."""
    from vim_ds.ops.backends import load

    loaded = load("cpu")
    assert loaded.backend is not None, f"the cpu kernel must be available here: {loaded.reason}"
    module = loaded.backend.module
    available = module.available_isas()
    if "sse2" not in available:  # not x86-64: one variant (NEON on aarch64), checked once
        if request.param != "sse2":
            pytest.skip(f"not an x86-64 CPU: its one variant ({available[0]}) runs under the sse2 parameter")
        yield available[0]
        return
    if request.param not in available:
        pytest.skip(f"this CPU cannot run the {request.param} variant (it has {', '.join(available)})")
    module.set_isa(request.param)
    try:
        yield request.param
    finally:
        module.set_isa("auto")


SEED_VARIABLE = "VIM_DS_TEST_SEED"


@pytest.fixture
def seed(request):
    """Fresh random inputs each run; VIM_DS_TEST_SEED=<n> replays a failure's inputs without editing code (the
    seed and that command are printed on failure by pytest's captured output)."""
    fixed = os.environ.get(SEED_VARIABLE)
    s = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {s} (reproduce: {SEED_VARIABLE}={s} python -m pytest '{request.node.nodeid}')")
    torch.manual_seed(s)
    return s


def _run_root(tmp_path_factory) -> Path:
    """The folder of this whole test run: the session's temporary folder, or under pytest-xdist the parent that every
    worker's temporary folder is made in (so workers can find what another one made)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_folder(tmp_path_factory, key: str, make) -> str:
    """A folder filled once per test run by `make(folder)` and shared by every test and every pytest-xdist worker
    that asks for the same `key`: the first to ask makes it (holding a file lock, so another worker asking meanwhile
    waits for it instead of training the same run again), the others reuse it. A `make` that fails is recorded, so
    every later ask fails at once with its message instead of training the failing run again."""
    from filelock import FileLock

    root = _run_root(tmp_path_factory) / "shared"
    root.mkdir(exist_ok=True)
    folder, done, failed = root / key, root / f"{key}.done", root / f"{key}.failed"
    with FileLock(str(root / f"{key}.lock")):
        if failed.exists():
            pytest.fail(f"the shared run {key!r} failed earlier in this test run:\n{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(str(folder))
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-6000:])
                raise
            done.touch()
    return str(folder)


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """shared(key, make) -> folder: see `shared_folder`."""
    return lambda key, make: shared_folder(tmp_path_factory, key, make)


@pytest.fixture(scope="session")
def kernel_emu_build(shared):
    """The folder where tools/kernel_emu/build.sh wrote the GPU kernels compiled for the CPU emulator
    (libscan_emu.so, libscan_emu64.so): built once per test run for test_compile_check.py's run of
    tools/kernel_emu/run.sh and test_kernel_emu_lengths.py (each build compiles the device code twice)."""
    import subprocess
    import sys

    def make(out: str):
        build = Path(__file__).resolve().parent.parent / "tools" / "kernel_emu" / "build.sh"
        subprocess.run(["bash", str(build), out], check=True,
                       capture_output=True, env={**os.environ, "PYTHON": sys.executable})

    return shared("kernel_emu", make)


@pytest.fixture(scope="session")
def digits(shared):
    """scikit-learn's digits written once as an ImageFolder (train/, val/); tests that change it copy it first."""
    from vim_ds.data.digits import write_digits

    return shared("digits", write_digits)


@pytest.fixture(scope="session")
def config_run(digits, shared):
    """config_run(name) -> the output directory of the run of ds_configs/NAME.json (train_utils.config_run_args),
    trained on first use and shared by every test that needs it. "control" is the same recipe in which the
    optimizer does not move the weights (lr 1e-12; one rank x accumulation 2, the same global batch of 16): what a
    stage whose optimizer never stepped would give, the negative control of the loss comparisons; its steps 2-3 are
    profiled (--profile-steps, read by tests/test_step_profile.py)."""
    from train_utils import CPU_CONFIGS, config_run_args, run_train

    def make(name: str, out: str):
        if name == "control":
            # also profiled (tests/test_step_profile.py reads its profile): profiling changes no number
            run_train(config_run_args(digits, out, "zero0", "--batch-size", 8, "--accum-steps", 2, "--lr", "1e-12",
                                      "--profile-steps", "2:3"), nproc=1)
        else:
            run_train(config_run_args(digits, out, name), nproc=2)

    def get(name: str) -> str:
        assert name in CPU_CONFIGS or name == "control", name
        return shared(f"config_{name}", lambda out: make(name, out))

    return get
