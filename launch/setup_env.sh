# Sourced by tests/run.sh and launch/quickstart.sh: create or reuse .venv and install the project.
# torch==2.13.0 goes in first, where torch is missing, so no multi-GB CUDA build is downloaded on a
# CPU machine; then `pip install -e ".[test]"` (skipped when setup.py has not changed since). --no-compile: pip would
# byte-compile every installed module (torch's thousands: 28 of torch's 39 s here); Python writes the .pyc of what is
# imported on first import instead.
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
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning}"
