#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, torch 2.11 + Triton 3.6 and most of this project's needs already
# installed, no package registry): downloads, here (a machine with pip access), the cp312 manylinux / pure-Python
# wheels of what that machine lacks into .whl/ (git-ignored, so a device call names it: carry=[".whl"]), keeps one
# version of each (any other wheel in .whl/ is removed), prints each wheel's size and the total, and refuses (exit 1)
# more than a device call carries: 64 MiB for the wheels and the working tree together.
# benchmarks/gpu_check.sh installs them there (pip --no-index --no-deps --target) into a temporary site directory.
#
# What travels: setup.py's install_requires and its "test" extra, and their own Requires-Dist, less the device's
# package list (/work/.library/device/KINDS.md, "Python packages already there": torch, triton, numpy, psutil,
# scikit-learn, safetensors 0.8.0, pillow, tqdm, tensorboard, matplotlib, imageio, transformers 5.17, accelerate,
# huggingface-hub 1.33, peft, pytest, pytest-timeout, pytest-xdist, packaging, filelock, regex, requests, zipp,
# click, rich are there):
#   megatron-core 0.16.1     (needs torch, numpy, packaging: there)
#   diffusers 0.42.1         (.venv's; needs importlib_metadata, filelock, huggingface-hub>=1.32,<3, numpy, regex,
#                             requests, safetensors>=0.8.0, Pillow: all there but importlib_metadata)
#   importlib_metadata 10.2.0 + lazy-importer 0.1.0 (its need; Python 3.12's diffusers reads importlib.metadata, so
#                             these only meet diffusers' metadata)
#   ftfy 6.3.1 + wcwidth 0.9.4  (diffusers' Wan pipelines clean prompts with it)
#   import-linter 2.17 + grimp 3.20  (tests/test_import_layers.py runs `lint-imports`; click>=8.2, rich>=14.2 there)
#   imageio-ffmpeg 0.6.0     (the MP4 writer / video reader's ffmpeg 7.0.2; .venv has 0.8.1, whose wheel is 65 MiB
#                             alone: 0.6.0's is 28 MiB and has the same API; the media tests pass with it here)
# Versions are .venv's (but imageio-ffmpeg's); the script says where .venv differs.
# Usage: bash benchmarks/gpu_wheels.sh   (env: PYTHON, default .venv/bin/python or python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=(megatron-core==0.16.1 diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 ftfy==6.3.1
        wcwidth==0.9.4 import-linter==2.17 grimp==3.20 imageio-ffmpeg==0.6.0)
LIMIT=$((64 * 1024 * 1024))  # what one device call carries: the working tree and the carried paths together
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
# one version of each: a wheel whose name-version is not one of WHEELS (an older download) is removed
norm() { tr 'A-Z' 'a-z' <<< "$1" | sed -E 's/[-_.]+/_/g'; }
keep=" "
for w in "${WHEELS[@]}"; do keep+="$(norm "${w%%==*}")-${w##*==} "; done
for f in .whl/*.whl; do
    base=$(basename "$f")
    name=$(norm "${base%%-*}") rest=${base#*-}
    if [[ "$keep" != *" $name-${rest%%-*} "* ]]; then
        echo "removing $f (not one of the pinned wheels)"
        rm -f "$f"
    fi
done
# where .venv has another version than the one that travels, say so
"$PYTHON" - "${WHEELS[@]}" <<'EOF' || true
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        here = md.version(name)
    except md.PackageNotFoundError:
        continue
    if here != version:
        print(f"note: {name} {version} travels; this interpreter has {here}")
EOF
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
for f in .whl/*.whl; do
    printf '%9d KiB  %s\n' "$(($(stat -c %s "$f") / 1024))" "$(basename "$f")"
done
echo "total $((wheels / 1024)) KiB of wheels in .whl/ ($(ls .whl/*.whl | wc -l) files); with the working tree" \
     "($((tree / 1024)) KiB) $(((wheels + tree) / 1024)) KiB of the $((LIMIT / 1024)) KiB a device call carries"
if ((wheels + tree > LIMIT)); then
    echo "refused: the wheels and the working tree are over the 64 MiB a device call carries: leave a wheel out" \
         "(WHEELS in $0) or split the wheels across calls" >&2
    exit 1
fi
