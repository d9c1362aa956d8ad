#!/usr/bin/env bash
# One check for a lent GPU, in under 8 minutes (BUDGET_S, default 450 s of steps):
#   env, nvidia_smi  torch / CUDA / device / optional packages
#   kernel_tests TRITON_INTERPRET=0 pytest tests/test_kernels*.py   (the Triton kernels on the GPU)
#   bench_kernels  benchmarks/bench_kernels.py (fused vs eager, GB/s, % of copy bandwidth)
#   cycle_bf16   benchmarks/bench_dmd2_cycle.py at a realistic size (600m, 4x32x32 latents, B=16, bf16):
#                phase times, MFU, memory per phase with offload on / off, host syncs per cycle
#   cycle_recompute  the same with --recompute-granularity full (if budget is left)
#   flow_sdpa / flow_flash / flow_te   20 teacher steps (digits, bf16) with sdpa, flash-attn and
#                transformer-engine; the last two only where the package imports
# Every step runs under `timeout` (cut to the budget left), logs to <out>/<step>.log and records its exit
# code in <out>/summary.tsv; a failing step never stops the others. Output: $OUT/gpu_check when OUT is
# set, else runs/gpu_check. Exit status: 0 if every step that ran passed, else 1.
# Packages the lent machine lacks (megatron-core) travel as wheels in .whl/ (benchmarks/gpu_wheels.sh, run
# on a machine with pip access): when `import megatron.core` fails and .whl/*.whl exist, they are installed
# into a temporary site directory first. Without CUDA (a dry run on a CPU machine) only `env` runs; every
# step that needs CUDA is listed as skipped ("needs CUDA") and the script exits 0.
#   bash benchmarks/gpu_check.sh        # env: PYTHON, OUT, BUDGET_S, CYCLE_MODEL, CYCLE_B, PEAK_TFLOPS
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUTDIR=${OUT:+$OUT/gpu_check}
OUTDIR=${OUTDIR:-runs/gpu_check}
mkdir -p "$OUTDIR" || exit 2
if [[ -z "${PYTHON:-}" ]]; then  # the first interpreter whose torch sees a GPU (a CPU-only .venv is passed over)
    for cand in .venv/bin/python python3 python; do
        command -v "$cand" >/dev/null 2>&1 || continue
        PYTHON=${PYTHON:-$cand}
        if "$cand" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
            PYTHON=$cand
            break
        fi
    done
fi
echo "python: ${PYTHON:=python3}"
if ! "$PYTHON" -c "import megatron.core" >/dev/null 2>&1 && compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/dmd2_site.XXXXXX")
    echo "megatron.core does not import: installing .whl/*.whl into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
CUDA=0
"$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1 && CUDA=1
echo "cuda: $CUDA"
BUDGET_S=${BUDGET_S:-450}
CYCLE_MODEL=${CYCLE_MODEL:-600m}
CYCLE_B=${CYCLE_B:-16}
PEAK_ARGS=()
[[ -n "${PEAK_TFLOPS:-}" ]] && PEAK_ARGS=(--peak-tflops "$PEAK_TFLOPS")  # else the benchmark measures a matmul
export PYTHONWARNINGS=ignore TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-0}
SUMMARY=$OUTDIR/summary.tsv
printf 'step\trc\tseconds\tnote\n' > "$SUMMARY"
FAILED=0

# step NAME LIMIT_S CMD...: run CMD under a timeout (at most the budget left), log it, record its rc.
step() {
    local name=$1 limit=$2 left=$((BUDGET_S - SECONDS)) start=$SECONDS rc note=""
    shift 2
    if ((left < 20)); then
        printf '%s\tskip\t0\tbudget of %s s spent\n' "$name" "$BUDGET_S" >> "$SUMMARY"
        echo "=== $name: skipped (budget spent)"
        return 0
    fi
    if ((limit > left)); then limit=$left; note="timeout cut to ${left} s"; fi
    echo "=== $name (timeout ${limit} s): $*" | tee "$OUTDIR/$name.log"
    timeout --kill-after=15 "$limit" "$@" >> "$OUTDIR/$name.log" 2>&1
    rc=$?
    ((rc == 124 || rc == 137)) && note="timed out after ${limit} s${note:+; $note}"
    ((rc != 0)) && FAILED=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$note" >> "$SUMMARY"
    echo "=== $name: rc=$rc in $((SECONDS - start)) s ${note}"
    tail -n 60 "$OUTDIR/$name.log"
}

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

skip() {  # skip NAME WHY
    printf '%s\tskip\t0\t%s\n' "$1" "$2" >> "$SUMMARY"
    echo "=== $1: skipped ($2)"
}

ENV_PY='
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for m in ("triton", "flash_attn", "transformer_engine", "apex", "megatron.core"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as exc:
        print(m, "does not import:", type(exc).__name__, exc)
'
step env 60 "$PYTHON" -c "$ENV_PY"
if ((CUDA == 0)); then  # a dry run on a machine without a GPU: say what would run, run nothing else
    for name in nvidia_smi kernel_tests bench_kernels cycle_bf16 cycle_recompute flow_sdpa flow_flash flow_te; do
        skip "$name" "needs CUDA"
    done
    echo "=== summary ($OUTDIR/summary.tsv, $SECONDS s): no CUDA device, only env ran"
    column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
    exit "$FAILED"
fi
step nvidia_smi 20 nvidia-smi

step kernel_tests 180 env TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels_adaln.py \
    tests/test_kernels_dmd.py tests/test_kernels_flow_matching.py tests/test_kernels_utils.py tests/test_kernels_x0.py \
    tests/test_kernels_qk_norm_rope.py

step bench_kernels 100 "$PYTHON" benchmarks/bench_kernels.py --no-compile --warmup 10 --rep 40 \
    --csv "$OUTDIR/bench_kernels.csv"

CYCLE=("$PYTHON" benchmarks/bench_dmd2_cycle.py --model-size "$CYCLE_MODEL" --data synthetic --image-size 32
       --in-channels 4 --num-classes 1000 --micro-batch-size "$CYCLE_B" --dmd2-denoising-steps 4
       --dmd2-critic-steps-per-rollout 5 --bf16 "${PEAK_ARGS[@]}")
step cycle_bf16 150 "${CYCLE[@]}" --warmup 2 --repeats 5 --csv "$OUTDIR/cycle_bf16.csv"
step cycle_recompute 90 "${CYCLE[@]}" --recompute-granularity full --warmup 1 --repeats 3 \
    --csv "$OUTDIR/cycle_recompute.csv"

FLOW=("$PYTHON" launch/pretrain_flow.py --model-size digits --data digits --micro-batch-size 64 --train-iters 20
      --log-interval 5 --bf16)
step flow_sdpa 60 "${FLOW[@]}" --attention-backend sdpa --transformer-impl local
if has flash_attn; then
    step flow_flash 60 "${FLOW[@]}" --attention-backend flash
else
    skip flow_flash "flash_attn does not import"
fi
if has transformer_engine; then
    step flow_te 60 "${FLOW[@]}" --transformer-impl transformer_engine
else
    skip flow_te "transformer_engine does not import"
fi

echo "=== summary ($OUTDIR/summary.tsv, $SECONDS s)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
exit "$FAILED"
