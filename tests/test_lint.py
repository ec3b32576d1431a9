"""The repository lints clean under its own settings (ruff.toml: pyflakes' and pycodestyle's rules, 120 columns).
ruff comes with the test extras (`pip install -e ".[test]"`)."""
from __future__ import annotations

import subprocess
import sys

from train_utils import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
