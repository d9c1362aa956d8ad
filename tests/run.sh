#!/usr/bin/env bash
# THE test command: creates or reuses .venv, installs torch==2.13.0 first where torch is missing
# (the CPU build on local disk; an unpinned torch would pull GBs of CUDA), then the package with
# its test extras, then runs the suite (docs/testing.md).
#   bash tests/run.sh [pytest args]          the whole suite (what .ci/run runs)
#   bash tests/run.sh --fast [pytest args]   the fast tier: no test that launches a process (-m "not integration")
#   bash tests/run.sh tests/test_x.py[::name]  those tests only: a path argument replaces the default `tests`
# Test files are spread over DMD2_TEST_WORKERS pytest-xdist workers (default: the CPU count, at least 2, at most 4),
# a file to one worker, so a module's fixtures run once.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export TORCH_COMPILE_DISABLE=1 OMP_NUM_THREADS=1
# The Triton interpreter only where there is no GPU: on CUDA the kernel tests run the compiled kernels.
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
tier=()
args=()
paths=(tests)
prev=""
for a in "$@"; do
    if [ "$a" = "--fast" ]; then
        export DMD2_TEST_TIER=fast
        tier=(-m "not integration")
    else
        # a path (before any ::) that is not the value of -k / -m / -p / -n
        case "$prev" in -k|-m|-p|-n) ;; *) if [ "${a#-}" = "$a" ] && [ -e "${a%%::*}" ]; then paths=(); fi ;; esac
        args+=("$a")
    fi
    prev="$a"
done
workers="${DMD2_TEST_WORKERS:-$(nproc)}"
if [ -z "${DMD2_TEST_WORKERS:-}" ]; then
    workers=$(( workers < 2 ? 2 : (workers > 4 ? 4 : workers) ))
fi
exec python -m pytest -q -p no:cacheprovider --timeout 900 -n "$workers" --dist loadfile ${tier[@]+"${tier[@]}"} \
    ${paths[@]+"${paths[@]}"} ${args[@]+"${args[@]}"}
