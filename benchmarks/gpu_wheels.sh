#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, torch + Triton and most of this project's needs already
# installed, no package registry): downloads, here (a machine with pip access), the cp312 manylinux wheels
# of what that machine lacks into .whl/ (git-ignored), and prints their sizes: a device call carries at
# most 64 MiB. benchmarks/gpu_check.sh installs them there into a temporary site directory.
# What it lacks (the device tool's package list, checked against the imports of dmd2_mega/, kernels/,
# launch/, benchmarks/ and the kernel tests): megatron-core, whose own needs (torch, numpy, packaging)
# are there. Usage: bash benchmarks/gpu_wheels.sh   (env: PYTHON, default .venv/bin/python or python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=("megatron-core==0.16.1")
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
ls -l .whl/*.whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total $((total / 1024)) KiB of wheels in .whl/ (limit 65536 KiB per device call)"
((total <= 64 * 1024 * 1024)) || { echo "over the 64 MiB a call carries: split the wheels across calls" >&2; exit 1; }
