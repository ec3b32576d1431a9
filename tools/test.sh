#!/usr/bin/env bash
# Install vim_ds with its test dependencies, then run the test suite. Extra arguments go to pytest,
# e.g. `bash tools/test.sh -m "not slow"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.14.1 torchvision==0.29.1
python3 -m pip install -q --no-build-isolation --use-pep517 -e ".[test]"
python3 -m pytest -q --durations=25 --cpu-durations=40 tests "$@"
