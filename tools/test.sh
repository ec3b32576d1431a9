#!/usr/bin/env bash
# Install vim_ds with its test dependencies, then run the test suite on two pytest-xdist workers, each taking whole
# files, the longest first (tests/conftest.py's LONG_FILES): the suite's processes leave the cores idle about half of
# the time (SLURM jobs sleeping until their signal, timeouts that fault tests wait out, one-process phases), which a
# second worker fills. VIM_DS_TEST_WORKERS=N sets the number of workers (0: one process, no xdist). Extra arguments
# go to pytest, e.g. `bash tools/test.sh -m "not slow"` for the fast subset. It prints the 25 slowest tests, the 40
# that cost the most CPU, the time and CPU per file, and the whole run's wall and CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.14.1 torchvision==0.29.1
python3 -m pip install -q --no-build-isolation --use-pep517 -e ".[test]"
workers=${VIM_DS_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
python3 -m pytest -q --durations=25 --cpu-durations=40 "${parallel[@]}" tests "$@"
