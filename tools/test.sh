#!/usr/bin/env bash
# Install vim_ds with its test dependencies, then run the test suite. Extra arguments go to pytest,
# e.g. `bash tools/test.sh -m "not slow"` for the fast subset, `-n 0` to run it in this one process.
# Two pytest-xdist workers, each taking whole files (a file's module fixtures are made once), the longest files first
# (tests/conftest.py's LONG_FILES): on 2 cores one process leaves the cores idle for much of the run (time limits,
# timeouts waited out, SLURM jobs sleeping until their signal, one-process phases), and the second worker fills them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.14.1 torchvision==0.29.1
python3 -m pip install -q --no-build-isolation --use-pep517 -e ".[test]"
python3 -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 --cpu-durations=40 tests "$@"
