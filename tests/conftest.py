import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or long-running tests (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Tests choose their backend explicitly; a developer's VIM_DS_SCAN must not leak in."""
    monkeypatch.delenv("VIM_DS_SCAN", raising=False)
    yield


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
