# Sourced by tests/run.sh and launch/quickstart.sh: create or reuse .venv and install the project.
# torch==2.13.0 goes in first, where torch is missing, so no multi-GB CUDA build is downloaded on a
# CPU machine; then `pip install -e ".[test]"` (skipped when setup.py has not changed since). --no-compile: pip would
# byte-compile every installed module (torch's thousands: 28 of torch's 39 s here); Python writes the .pyc of what is
# imported on first import instead.
# Without a .venv, an interpreter that already imports what the project and its tests need ($PYTHON, else python3,
# else python) is used as it is and nothing is installed: the lent GPU machine, which has no package registry, once
# benchmarks/gpu_check.sh has put the carried wheels on PYTHONPATH. The repository root and kernels/ (where the
# dmd2_kernels package lives) then go on PYTHONPATH (the project is not pip-installed there) and `python` on PATH runs that interpreter.
_dmd2_needs="torch, triton, megatron.core, diffusers, pytest, xdist, pytest_timeout"
_dmd2_py=""
if [ ! -x .venv/bin/python ]; then
    for _dmd2_c in ${PYTHON:-} python3 python; do
        if command -v "$_dmd2_c" >/dev/null 2>&1; then
            _dmd2_py=$("$_dmd2_c" -c "import sys, $_dmd2_needs; print(sys.executable)" 2>/dev/null) || _dmd2_py=""
            [ -n "$_dmd2_py" ] && break
        fi
    done
fi
if [ -n "$_dmd2_py" ]; then
    _dmd2_dir=$(dirname "$_dmd2_py")
    if [ ! "$_dmd2_dir/python" -ef "$_dmd2_py" ]; then  # no `python` beside it that is the same program: a shim
        _dmd2_dir=$(mktemp -d "${TMPDIR:-/tmp}/dmd2_python.XXXXXX")
        printf '#!/bin/sh\nexec "%s" "$@"\n' "$_dmd2_py" > "$_dmd2_dir/python"
        chmod +x "$_dmd2_dir/python"
    fi
    export PATH="$_dmd2_dir:$(dirname "$_dmd2_py"):$PATH"
    export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
    echo "> no .venv: using $_dmd2_py as it is (it imports $_dmd2_needs); nothing installed" >&2
else
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    # shellcheck disable=SC1091
    source .venv/bin/activate
    if ! python -c "import torch" 2>/dev/null; then
        echo "> installing torch==2.13.0" >&2
        pip install -q --no-compile torch==2.13.0
    fi
    stamp=".venv/.dmd2_mega_installed"
    if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || ! python -c "import dmd2_mega, megatron.core" 2>/dev/null; then
        echo "> installing dmd2-mega and its test extras into .venv" >&2
        pip install -q --no-compile -e ".[test]"
        touch "$stamp"
    fi
fi
unset _dmd2_needs _dmd2_py _dmd2_c _dmd2_dir
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning}"
