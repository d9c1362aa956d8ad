#!/usr/bin/env bash
# THE test command: creates or reuses .venv, installs torch==2.13.0 first where torch is missing
# (the CPU build on local disk; an unpinned torch would pull GBs of CUDA), then the package with
# its test extras, then runs the whole suite. Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export TORCH_COMPILE_DISABLE=1 OMP_NUM_THREADS=1
# The Triton interpreter only where there is no GPU: on CUDA the kernel tests run the compiled kernels.
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
exec python -m pytest -q -p no:cacheprovider --timeout 900 tests "$@"
