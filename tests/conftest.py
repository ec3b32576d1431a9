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


@pytest.fixture
def seed():
    """Fresh random inputs each run (the seed is printed on failure by pytest's captured output)."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {s}")
    torch.manual_seed(s)
    return s


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits written once as an ImageFolder (train/, val/); tests that change it copy it first."""
    from vim_ds.data.digits import write_digits

    root = tmp_path_factory.mktemp("digits")
    write_digits(root)
    return str(root)
