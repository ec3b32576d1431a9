#!/usr/bin/env bash
# Install vim_ds with its test dependencies, then run the test suite on two pytest-xdist workers, each taking whole
# files, the longest first (tests/conftest.py's LONG_FILES): the suite's processes leave the cores idle about half of
# the time (SLURM jobs sleeping until their signal, timeouts that fault tests wait out, one-process phases), which a
# second worker fills; the files that mostly wait run in two lanes beside the workers (below). VIM_DS_TEST_WORKERS=N sets the number of workers (0: one process, no xdist). Extra arguments
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

# The whole suite: the files that mostly wait hold little CPU for minutes of wall time, so they run in two lanes of
# their own beside the two workers instead of holding one of them. Lane 1: the real-SLURM jobs, which sleep until
# SLURM's signal (about 480 s of wall for 16 CPU-s), and the stalled-loader tests, which wait out timeouts they set.
# Lane 2: the killed, stuck and signalled ranks (faults/), which wait out their dist timeouts and the launchers'
# grace periods, the launch scripts' multi-host tests, which wait on ssh, pdsh and links taken down (on the 2-core
# EPYC, 2026-11-30: 850 s of wall for 250 CPU-s; in the workers they left the cores a third idle), and the exact
# resumes (330 s of wall for 130 CPU-s: lane 2 ended 400 s before the workers without them). Each lane
# is started with SIGINT at its default: a command backgrounded by a non-interactive shell would otherwise inherit
# it ignored (see docs/tests.md). The lanes' reports follow the workers' report, and the run fails if any fails.
lanes=("tests/test_slurm.py tests/faults/test_data_faults.py tests/test_loader.py"
       "tests/faults/test_dead_ranks.py tests/faults/test_signals.py tests/test_launch.py tests/test_resume_exact.py")
main_log=$(mktemp "${TMPDIR:-/tmp}/vim_ds_workers.XXXXXX")
lane_logs=() lane_pids=() ignores=()
trap 'rm -f "$main_log" "${lane_logs[@]}"' EXIT
for lane in "${lanes[@]}"; do
    read -r -a files <<<"$lane"
    log=$(mktemp "${TMPDIR:-/tmp}/vim_ds_lane.XXXXXX")
    lane_logs+=("$log")
    python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
        python3 -m pytest -q --durations=10 --cpu-durations=10 "${files[@]}" > "$log" 2>&1 &
    lane_pids+=($!)
    ignores+=("${files[@]/#/--ignore=}")
done
status=0
python3 -u -m pytest -q --durations=25 --cpu-durations=40 "${parallel[@]}" "${ignores[@]}" tests 2>&1 \
    | tee "$main_log" || status=$?
lane_status=0
for i in "${!lanes[@]}"; do
    this=0
    wait "${lane_pids[$i]}" || this=$?
    echo "=================== lane $((i + 1)) beside the workers: ${lanes[$i]} ==================="
    cat "${lane_logs[$i]}"
    if [ "$this" != 0 ]; then
        echo "tools/test.sh: lane $((i + 1)) (${lanes[$i]}) failed (exit $this)" >&2
        [ "$lane_status" != 0 ] || lane_status=$this
    fi
done
# One closing line for all: pytest's counts of the runs added up.
python3 - "$main_log" "${lane_logs[@]}" <<'PY'
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
