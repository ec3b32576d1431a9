#!/usr/bin/env bash
# Install vim_ds with its test dependencies, then run the test suite on two pytest-xdist workers, each taking whole
# files, the longest first (tests/conftest.py's LONG_FILES): the suite's processes leave the cores idle about half of
# the time (SLURM jobs sleeping until their signal, timeouts that fault tests wait out, one-process phases), which a
# second worker fills. VIM_DS_TEST_WORKERS=N sets the number of workers (0: one process, no xdist). Extra arguments
# go to pytest, e.g. `bash tools/test.sh -m "not slow"` for the fast subset (then everything runs on the workers). It
# prints the 25 slowest tests, the 40 that cost the most CPU, the time and CPU per file, and the whole run's wall and
# CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.14.1 torchvision==0.29.1 "setuptools>=64" wheel
python3 -m pip install -q --no-build-isolation --use-pep517 -e ".[test]"
workers=${VIM_DS_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
if [ "$workers" = 0 ] || [ $# -gt 0 ]; then
    exec python3 -m pytest -q --durations=25 --cpu-durations=40 "${parallel[@]}" tests "$@"
fi

# The whole suite: the files that mostly wait hold little CPU for minutes of wall time (the real-SLURM jobs sleep
# until SLURM's signal, 370 s of wall for about 10 CPU-s; the stalled-loader and killed-rank tests wait out timeouts
# they set), so they run in a lane of their own beside the two workers instead of holding one of them. The lane is
# started with SIGINT at its default: a command backgrounded by a non-interactive shell would otherwise inherit it
# ignored (see docs/tests.md). Its report follows the workers' report, and the run fails if either fails.
lane_files=(tests/test_slurm.py tests/faults/test_data_faults.py tests/test_loader.py)
lane_log=$(mktemp "${TMPDIR:-/tmp}/vim_ds_lane.XXXXXX")
main_log=$(mktemp "${TMPDIR:-/tmp}/vim_ds_workers.XXXXXX")
trap 'rm -f "$lane_log" "$main_log"' EXIT
python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
    python3 -m pytest -q --durations=10 --cpu-durations=10 "${lane_files[@]}" > "$lane_log" 2>&1 &
lane=$!
status=0
python3 -u -m pytest -q --durations=25 --cpu-durations=40 "${parallel[@]}" "${lane_files[@]/#/--ignore=}" tests 2>&1 \
    | tee "$main_log" || status=$?
lane_status=0
wait "$lane" || lane_status=$?
echo "=================== the lane beside the workers: ${lane_files[*]} ==================="
cat "$lane_log"
[ "$lane_status" = 0 ] || echo "tools/test.sh: the lane (${lane_files[*]}) failed (exit $lane_status)" >&2
# One closing line for both: pytest's counts of the two runs added up.
python3 - "$main_log" "$lane_log" <<'PY'
import re, sys
counts = {}
for path in sys.argv[1:]:
    lines = [line for line in open(path, errors="replace") if re.search(r"\d+ (passed|failed|error)", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1] if lines else ""):
        word = "error" if word.startswith("error") else word
        counts[word] = counts.get(word, 0) + int(number)
rest = "".join(f", {counts[w]} {w}" for w in ("skipped", "error", "xfailed", "xpassed") if counts.get(w))
print(f"suite: {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed{rest}")
PY
[ "$status" != 0 ] && exit "$status"
exit "$lane_status"
