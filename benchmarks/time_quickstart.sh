#!/usr/bin/env bash
# The README's two Quickstart commands as a new user runs them, each phase timed: a fresh virtual environment,
# no pip cache, a clean copy of the committed tree. Prints the phases' seconds and the load average around them
# (timings on a shared machine are only as good as its load).
#
#   bash benchmarks/time_quickstart.sh [WORK_DIR]      # default WORK_DIR: /tmp/dllm_fast_quickstart (replaced)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/dllm_fast_quickstart}
rm -rf "$WORK" && mkdir -p "$WORK/src"
git -C "$REPO" archive HEAD | tar -x -C "$WORK/src"
unset PYTHONPATH
export PIP_NO_CACHE_DIR=1
python -m venv "$WORK/venv"
source "$WORK/venv/bin/activate"
cd "$WORK/src"

now() { date +%s.%N; }
phase() {  # phase NAME COMMAND...: run it, print its wall time and the load average after it
    local start end
    start=$(now)
    "${@:2}" > "$WORK/$1.log" 2>&1
    end=$(now)
    printf '%-34s %7.1f s   load %s\n' "$1" "$(echo "$end - $start" | bc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
}
echo "commit $(git -C "$REPO" rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
first=$(now)
phase "1. pip install torch ..." pip install torch==2.13.0 setuptools wheel pybind11 ninja
phase "1. pip install -e . (build)" pip install --no-build-isolation -e .
phase "1. python -m dllm_fast train" python -m dllm_fast train
printf '%-34s %7.1f s\n' "first command in all" "$(echo "$(now) - $first" | bc)"
tail -2 "$WORK/1. python -m dllm_fast train.log"
phase "2. pip install torch ... (again)" pip install torch==2.13.0 setuptools wheel pybind11 ninja
phase "2. pip install -e .[test]" pip install -v --no-build-isolation -e ".[test]"
grep -c '^\s*\[[0-9]*/[0-9]*\] c++' "$WORK/2. pip install -e .[test].log" | sed 's/^/   C++ files compiled again: /' || true
phase "2. python -m pytest python_tests" python -m pytest python_tests -q -n auto --maxprocesses 8 -m "not slow"
tail -1 "$WORK/2. python -m pytest python_tests.log"
phase "3. python -m dllm_fast demo" python -m dllm_fast demo
