import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or long-running tests (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped without one)")


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that used the most CPU time (the test process and every process it "
                          "started and waited for: launchers, ranks), and the whole run's CPU time against its wall "
                          "time. Unlike --durations, barely moved by other work on a shared machine.")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_seconds()
    yield
    _CPU[item.nodeid] = _cpu_seconds() - start


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
    terminalreporter.section(f"most CPU time, {count} tests")
    for nodeid, seconds in sorted(_CPU.items(), key=lambda kv: -kv[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.1f} s CPU  {nodeid}")
    terminalreporter.write_line(f"the run: {cpu:.0f} s CPU in {wall:.0f} s wall on {os.cpu_count()} cores "
                                f"({100 * cpu / max(wall * (os.cpu_count() or 1), 1e-9):.0f} % of them busy)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Tests choose their backend explicitly; a developer's VIM_DS_SCAN (or VIM_DS_CPU_ISA, for the subprocesses
    tests start) must not leak in."""
    monkeypatch.delenv("VIM_DS_SCAN", raising=False)
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


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits written once as an ImageFolder (train/, val/); tests that change it copy it first."""
    from vim_ds.data.digits import write_digits

    root = tmp_path_factory.mktemp("digits")
    write_digits(root)
    return str(root)


@pytest.fixture(scope="session")
def config_run(digits, tmp_path_factory):
    """config_run(name) -> the output directory of the run of ds_configs/NAME.json (train_utils.config_run_args),
    trained on first use and shared by every test that needs it. "control" is the same recipe in which the
    optimizer does not move the weights (lr 1e-12; one rank x accumulation 2, the same global batch of 16): what a
    stage whose optimizer never stepped would give, the negative control of the loss comparisons."""
    from train_utils import CPU_CONFIGS, config_run_args, run_train

    done = {}

    def get(name: str) -> str:
        assert name in CPU_CONFIGS or name == "control", name
        if name not in done:
            out = str(tmp_path_factory.mktemp(f"config_{name}"))
            if name == "control":
                run_train(config_run_args(digits, out, "zero0", "--batch-size", 8, "--accum-steps", 2,
                                          "--lr", "1e-12"), nproc=1)
            else:
                run_train(config_run_args(digits, out, name), nproc=2)
            done[name] = out
        return done[name]

    return get
