#!/usr/bin/env bash
# One run on a lent GPU, everything back (issue 49). A single run of at most BUDGET_S seconds (default 540 = 9
# minutes: the whole script's wall clock, the wheels' install and the packing included; PACK_S = 20 of them are kept
# for the packing), its steps in order of importance, each under a timeout cut to the budget left. The device call:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# The steps are STEP_TABLE below, one line each (a later issue adds its step with one line there):
#   env              the interpreter, torch / CUDA / the device, and the version of every package the suite uses
#   nvidia_smi       nvidia-smi
#   suite            bash tests/run.sh on DMD2_TEST_WORKERS=8 pytest-xdist workers: on CUDA the compiled Triton
#                    kernels (no TRITON_INTERPRET) and every test that runs on one GPU; a torchrun of more ranks
#                    than the one GPU is skipped, saying so (docs/testing.md, "On a GPU machine"; the CPU suite runs
#                    them). -rfEs lists the failures and skips with their reasons in its log; its last line is its
#                    figure. The CPU suite is ~900 CPU-seconds (~450 s on 2 cores): ~2-3 minutes on 8 workers of
#                    the 16 cores is an estimate, not yet a measurement; the first GPU run took 29 s for the kernel
#                    files alone
#   bench_kernels    benchmarks/bench_kernels.py: each fused kernel against eager, GB/s, % of copy bandwidth
#   cycle_bf16       benchmarks/bench_dmd2_cycle.py at 600m, 4x32x32 latents, B=16, bf16 (CYCLE_MODEL, CYCLE_B):
#                    phase times, MFU against a matmul measured in the run (or PEAK_TFLOPS), memory per phase with
#                    offload on / off, host syncs per cycle
#   wan13b_cycle     Wan 2.1 1.3B-shaped DMD2 at TP=1, bf16: random latents [16, 5, 30, 52] (1,950 tokens) with text
#                    [512, 4096] (data.write_shards), a random teacher saved by one step of launch/pretrain_flow.py (no
#                    weights are available), then 6 cycles of launch/pretrain_dmd2.py (K = 5, N = 4, CFG 5, shift 3,
#                    EMA); the first GPU run took ~3.2 s per cycle plus start-up and the 18 GiB teacher's save
#   sit_xl2_cycle    SiT-XL/2-shaped DMD2 from an imported teacher: a random official-layout SiT-XL/2 state dict
#                    (depth 28, hidden 1152, 16 heads) converted by launch/convert_checkpoint.py --from-official
#                    --parameterization sit, random 4x32x32 latents of 1000 classes, 6 cycles of B = 8 (K = 5, N = 4,
#                    CFG 1.5, GAN head, EMA)
#   cycle_recompute  cycle_bf16 with --recompute-granularity full
#   The cycles run with a GPU user's defaults: compiled blocks (--compile, issue 51), whose compilation falls in the
#   warm-up (bench_dmd2_cycle.py) or the first log interval (the Wan and SiT runs' first 2 cycles), not in the figures
#   (a guess of its cost: tens of seconds per model; the budgets below allow for it, unmeasured yet)
#   flow_sdpa / flow_flash / flow_te   20 teacher steps (digits, bf16) with sdpa, flash-attn, Transformer Engine;
#                    the last two only where the package imports
# A step runs under `timeout -s INT` (pytest and Python print where they were), KILL 15 s later; its timeout is cut
# to the budget left, and a step with less than a third of its timeout left is skipped ("budget"). A failing step
# never stops the others.
#
# Output: $OUT when set (the device call's folder), else runs/gpu_check: three files, no folders:
#   summary.tsv   step, rc, seconds, note (a timeout, a skip's reason, the step's headline figure)
#   figures.csv   step,name,value: each step's rc and seconds, the env report, the suite's last line and counts,
#                 bench_kernels' and the cycle benchmarks' CSV rows, the Wan / SiT runs' last log line (per-phase
#                 ms, model TFLOP/s) and their measured peak resident memory
#   logs.tar.gz   gpu_check/<step>.log, every step's full log, and the benchmarks' own CSVs
# On stdout: each step's command, then its rc and the last 15 lines of its log; the summary table LAST (the device
# returns the last 12,000 characters of the output). Exit status: 0 if every step that ran passed, else 1.
#
# Packages the lent machine lacks travel as wheels in .whl/ (benchmarks/gpu_wheels.sh, run where pip works): when
# `import megatron.core` fails and .whl/*.whl exist, they are installed into a temporary site directory first, put
# on PYTHONPATH (its bin/ on PATH); tests/run.sh then uses that interpreter as it is (launch/setup_env.sh).
# Without CUDA (a CPU machine) it is a dry run: `env` runs, every other step is printed with its timeout and command
# and recorded as skipped ("needs CUDA"), the three files are written, exit 0.
# Env: PYTHON (default: the first of .venv/bin/python, python3, python whose torch sees a GPU), OUT, BUDGET_S,
# STEPS (names, space-separated: only those run, the others "not in STEPS"), CYCLE_MODEL, CYCLE_B, PEAK_TFLOPS,
# DRY_RUN (1 without CUDA; DRY_RUN=0 runs the CUDA steps on a CPU, to try the script out with the small sizes:
# WAN_MODEL=wan-debug WAN_LATENT="4 3 4 6" WAN_TEXT="5 16", SIT_DEPTH=2 SIT_HIDDEN=64 SIT_HEADS=4).
#   bash benchmarks/gpu_check.sh
#   STEPS="env wan13b_cycle sit_xl2_cycle" bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export REPO=$PWD

# Timeouts: the steps through sit_xl2_cycle are expected to take ~430 s together, within the 520 s the steps get
# (probe + wheels + env ~20, suite ~150 (estimated), bench_kernels ~45, cycle_bf16 ~70, wan13b_cycle ~100: 6 cycles
# at ~3.2 s after saving and loading an 18 GiB teacher, sit_xl2_cycle ~50); each timeout is ~1.5x that, so a step that
# hangs takes at most that much from the steps after it. Only the first GPU run's figures stand behind these numbers.
# After them, never run yet and estimated only: wan13b_480p (issue 52's real shape, latents [16, 21, 60, 104] = 32,760
# tokens, 3 teacher steps then 3 cycles at the planner's default offload; ~280 TFLOP per forward, so ~30 s per cycle
# at 40% MFU), sit_xl2_b64 (SiT-XL/2 at B = 64), cycle_graphs (the 600M cycle eager and with --cuda-graphs). When
# the budget runs short they are skipped in that order; run them alone with STEPS="env wan13b_480p sit_xl2_b64".
# needs: cuda (skipped in a dry run), a module that must import, or -.
# name            timeout_s  needs  command (bash -c from the repo root; the variables and functions below exported)
STEP_TABLE='
env                 45  -      "$PYTHON" -c "$ENV_PY"
nvidia_smi          15  cuda   nvidia-smi
suite              240  cuda   DMD2_TEST_WORKERS=8 bash tests/run.sh -rfEs --durations=25
bench_kernels       90  cuda   "$PYTHON" benchmarks/bench_kernels.py --no-compile --warmup 10 --rep 40 --csv "$LOGS/bench_kernels.csv"
cycle_bf16         150  cuda   "$PYTHON" benchmarks/bench_dmd2_cycle.py $CYCLE_ARGS --warmup 2 --repeats 5 --csv "$LOGS/cycle_bf16.csv"
wan13b_cycle       210  cuda   run_wan_cycle
sit_xl2_cycle      100  cuda   run_sit_cycle
wan13b_480p        240  cuda   run_wan_cycle "16 21 60 104" 3 3
sit_xl2_b64        120  cuda   run_sit_cycle 64
cycle_graphs        90  cuda   "$PYTHON" benchmarks/bench_cuda_graphs.py $CYCLE_ARGS --warmup 3 --repeats 5 --csv "$LOGS/cycle_graphs.csv"
cycle_recompute     75  cuda   "$PYTHON" benchmarks/bench_dmd2_cycle.py $CYCLE_ARGS --recompute-granularity full --warmup 1 --repeats 3 --csv "$LOGS/cycle_recompute.csv"
flow_sdpa           45  cuda   "$PYTHON" launch/pretrain_flow.py $FLOW_ARGS --attention-backend sdpa --transformer-impl local
flow_flash          45  cuda,flash_attn  "$PYTHON" launch/pretrain_flow.py $FLOW_ARGS --attention-backend flash
flow_te             45  cuda,transformer_engine  "$PYTHON" launch/pretrain_flow.py $FLOW_ARGS --transformer-impl transformer_engine
'
BUDGET_S=${BUDGET_S:-540}
PACK_S=20
TAIL_LINES=15

OUTDIR=${OUT:-runs/gpu_check}
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
export LOGS=$SCRATCH/gpu_check WORK=$SCRATCH/work
mkdir -p "$LOGS" "$WORK"
SITE=""
trap 'rm -rf "$SCRATCH" ${SITE:+"$SITE"}' EXIT
SUMMARY=$OUTDIR/summary.tsv FIGURES=$OUTDIR/figures.csv
rm -f "$OUTDIR/logs.tar.gz"
printf 'step\trc\tseconds\tnote\n' > "$SUMMARY"
echo "step,name,value" > "$FIGURES"
FAILED=0

record() {  # record NAME RC SECONDS NOTE: a row of summary.tsv and the rc / seconds rows of figures.csv
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$SUMMARY"
    printf '%s,rc,%s\n%s,seconds,%s\n' "$1" "$2" "$1" "$3" >> "$FIGURES"
}

probe() {  # probe PY: prints "<CUDA 0/1> <megatron.core imports 0/1>", or fails where torch does not import
    "$1" -c "
import sys, torch
try:
    import megatron.core
    ok = 1
except Exception:
    ok = 0
print('probe:', int(torch.cuda.is_available()), ok)" 2>/dev/null | sed -n 's/^probe: //p' | grep .
}
PROBE=""
if [[ -z "${PYTHON:-}" ]]; then  # the first interpreter whose torch sees a GPU (a CPU-only .venv is passed over)
    for cand in .venv/bin/python python3 python; do
        command -v "$cand" >/dev/null 2>&1 || continue
        got=$(probe "$cand") || continue
        [[ -z "$PROBE" || $got == 1* ]] && PYTHON=$cand PROBE=$got
        [[ $got == 1* ]] && break
    done
else
    PROBE=$(probe "$PYTHON")
fi
export PYTHON=${PYTHON:-python3}
read -r CUDA MEGATRON <<< "${PROBE:-0 0}"
echo "python: $PYTHON"
if ((MEGATRON == 0)) && compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/dmd2_site.XXXXXX")
    echo "=== wheels: megatron.core does not import: installing .whl/*.whl into $SITE" | tee "$LOGS/wheels.log"
    start=$SECONDS
    "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl >> "$LOGS/wheels.log" 2>&1
    rc=$?
    ((rc != 0)) && FAILED=1
    record wheels "$rc" "$((SECONDS - start))" "$(ls .whl/*.whl | wc -l) wheels into a temporary site directory"
    tail -n "$TAIL_LINES" "$LOGS/wheels.log" | cut -c1-240
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
# the project is not pip-installed on the lent machine: the root (dmd2_mega) and kernels/ (dmd2_kernels)
export PYTHONPATH="$REPO:$REPO/kernels${PYTHONPATH:+:$PYTHONPATH}"
DRY=${DRY_RUN:-$((1 - CUDA))}

PEAK=""
[[ -n "${PEAK_TFLOPS:-}" ]] && PEAK="--peak-tflops $PEAK_TFLOPS"  # else the benchmark measures a bf16 matmul
export CYCLE_ARGS="--model-size ${CYCLE_MODEL:-600m} --data synthetic --image-size 32 --in-channels 4
    --num-classes 1000 --micro-batch-size ${CYCLE_B:-16} --dmd2-denoising-steps 4 --dmd2-critic-steps-per-rollout 5
    --bf16 $PEAK"
export FLOW_ARGS="--model-size digits --data digits --micro-batch-size 64 --train-iters 20 --log-interval 5 --bf16"
export PYTHONWARNINGS=ignore TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-0} PYTHONUNBUFFERED=1
echo "cuda: $CUDA  dry run: $DRY  budget: $BUDGET_S s ($PACK_S s of them for packing), $SECONDS s spent"
((DRY)) && printf 'the commands below see PYTHON=%s\n  CYCLE_ARGS=%s\n  FLOW_ARGS=%s\n' "$PYTHON" \
    "$(tr -s ' \n' ' ' <<< "$CYCLE_ARGS")" "$FLOW_ARGS"

export ENV_PY='
import importlib, importlib.metadata as md, os, platform, sys
print("python:", sys.executable, platform.python_version())
print("cpus:", os.cpu_count())
print("PYTHONPATH:", os.environ.get("PYTHONPATH", ""))
import torch
print("torch:", torch.__version__)
print("torch cuda:", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name)
    print("capability:", f"{p.major}.{p.minor}")
    print("device memory GiB:", round(p.total_memory / 2**30, 1))
DIST = {"megatron.core": "megatron-core", "importlinter": "import-linter", "xdist": "pytest-xdist",
        "pytest_timeout": "pytest-timeout", "imageio_ffmpeg": "imageio-ffmpeg", "huggingface_hub": "huggingface-hub",
        "flash_attn": "flash-attn", "transformer_engine": "transformer-engine", "sklearn": "scikit-learn",
        "PIL": "pillow"}
for m in ("triton", "megatron.core", "diffusers", "transformers", "huggingface_hub", "accelerate", "peft",
          "safetensors", "imageio", "imageio_ffmpeg", "ftfy", "importlinter", "grimp", "rich", "click", "pytest",
          "xdist", "pytest_timeout", "numpy", "sklearn", "PIL", "flash_attn", "transformer_engine", "apex"):
    try:
        mod = importlib.import_module(m)
    except Exception as exc:
        print(f"{m}: does not import ({type(exc).__name__}: {str(exc)[:120]})")
        continue
    try:
        version = md.version(DIST.get(m, m))
    except Exception:
        version = getattr(mod, "__version__", "?")
    print(f"{m}: {version}")
'

# wan13b_cycle's body, in a child bash under the step's timeout; its scratch (the 18 GiB teacher checkpoint: bf16
# weights, fp32 masters, Adam moments) removed at its end. WAN_MODEL / WAN_LATENT / WAN_TEXT make it small.
export WAN_DATA_PY='
import sys, torch
from dmd2_mega.data import write_shards
out, n, latent, text = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
g = torch.Generator().manual_seed(0)
x = torch.randn(n, *map(int, latent), generator=g).bfloat16()
cond = torch.randn(n, *map(int, text), generator=g).bfloat16()
write_shards(out, x, cond=cond, negative=torch.randn(*map(int, text), generator=g).bfloat16())
print(f"wrote {n} random samples: latents {list(x.shape[1:])}, text {list(cond.shape[1:])} -> {out}")
'
export WAN_MODEL=${WAN_MODEL:-wan2.1-1.3b} WAN_LATENT=${WAN_LATENT:-16 5 30 52} WAN_TEXT=${WAN_TEXT:-512 4096}
run_wan_cycle() {  # [LATENT ITERS TEACHER_ITERS]: default WAN_LATENT, 6 cycles, 1 teacher step
    set -ex
    local latent=${1:-$WAN_LATENT} iters=${2:-6} teacher_iters=${3:-1}
    WAN_TMP=$(mktemp -d "$WORK/wan.XXXXXX")
    trap 'rm -rf "$WAN_TMP"' EXIT
    "$PYTHON" -c "$WAN_DATA_PY" "$WAN_TMP/data" 16 "$latent" "$WAN_TEXT"
    local common=(--model-size "$WAN_MODEL" --data "$WAN_TMP/data" --micro-batch-size 1 --bf16 --num-workers 0
                  --timestep-shift 3)
    # the teacher is random weights: one step is not worth compiling its blocks; more steps are the plain training
    # step beside the cycle (the real-shape row), compiled as a GPU user's are
    "$PYTHON" launch/pretrain_flow.py "${common[@]}" --train-iters "$teacher_iters" --log-interval 1 \
        $( ((teacher_iters == 1)) && echo --no-compile ) --save "$WAN_TMP/teacher"
    "$PYTHON" launch/pretrain_dmd2.py "${common[@]}" --teacher-load "$WAN_TMP/teacher" --train-iters "$iters" \
        --log-interval $(( iters >= 6 ? 2 : 1 )) --lr 2e-6 --lr-decay-style constant --dmd2-denoising-steps 4 \
        --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 5 --ema-decay 0.99
}

# sit_xl2_cycle's body, likewise (its scratch: a 2.7 GB .pt, the converted teacher, the run). SIT_DEPTH /
# SIT_HIDDEN / SIT_HEADS make it small.
export SIT_PY='
import sys, torch
from dmd2_mega.data import write_shards
from dmd2_mega.models.embeddings import dit_sincos_2d
out, depth, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c, p, k, side = 4, 2, 1000, 32
shapes = {"x_embedder.proj.weight": (d, c, p, p), "x_embedder.proj.bias": (d,), "t_embedder.mlp.0.weight": (d, 256),
          "t_embedder.mlp.0.bias": (d,), "t_embedder.mlp.2.weight": (d, d), "t_embedder.mlp.2.bias": (d,),
          "y_embedder.embedding_table.weight": (k + 1, d), "final_layer.linear.weight": (p * p * 2 * c, d),
          "final_layer.linear.bias": (p * p * 2 * c,), "final_layer.adaLN_modulation.1.weight": (2 * d, d),
          "final_layer.adaLN_modulation.1.bias": (2 * d,)}
for i in range(depth):
    for name, shape in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.fc1", (4 * d, d)),
                        ("mlp.fc2", (d, 4 * d)), ("adaLN_modulation.1", (6 * d, d))):
        shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = shape, shape[:1]
g = torch.Generator().manual_seed(0)
state = {n: 0.02 * torch.randn(s, generator=g) for n, s in shapes.items()}
state["pos_embed"] = dit_sincos_2d(side // p, d)[None]
torch.save(state, out + "/sit.pt")
write_shards(out + "/data", torch.randn(64, c, side, side, generator=g).bfloat16(), labels=torch.arange(64) % k,
             num_classes=k)
print(f"wrote a random SiT ({depth} blocks, hidden {d}) and 64 random latents [4, 32, 32] -> {out}")
'
export SIT_DEPTH=${SIT_DEPTH:-28} SIT_HIDDEN=${SIT_HIDDEN:-1152} SIT_HEADS=${SIT_HEADS:-16}
run_sit_cycle() {  # [B]: the micro-batch, default 8
    set -ex
    SIT_TMP=$(mktemp -d "$WORK/sit.XXXXXX")
    trap 'rm -rf "$SIT_TMP"' EXIT
    "$PYTHON" -c "$SIT_PY" "$SIT_TMP" "$SIT_DEPTH" "$SIT_HIDDEN"
    "$PYTHON" launch/convert_checkpoint.py --from-official "$SIT_TMP/sit.pt" --parameterization sit \
        --num-heads "$SIT_HEADS" --save "$SIT_TMP/teacher"
    "$PYTHON" launch/pretrain_dmd2.py --model-size "$SIT_TMP/teacher" --teacher-load "$SIT_TMP/teacher" \
        --data "$SIT_TMP/data" --micro-batch-size "${1:-8}" --bf16 --num-workers 0 --train-iters 6 --log-interval 2 \
        --lr 2e-6 --lr-decay-style constant --dmd2-denoising-steps 4 --dmd2-critic-steps-per-rollout 5 \
        --dmd2-teacher-guidance-scale 1.5 --dmd2-gan --ema-decay 0.99
}
export -f run_wan_cycle run_sit_cycle

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }
wanted() { [[ -z "${STEPS:-}" || " $STEPS " == *" $1 "* ]]; }

# step NAME TIMEOUT NEEDS COMMAND: run COMMAND under its timeout cut to the budget left, log it, record it.
step() {
    local name=$1 limit=$2 needs=$3 cmd=$4 left start rc note="" m
    if ! wanted "$name"; then
        record "$name" skip 0 "not in STEPS"
        return
    fi
    for m in ${needs//,/ }; do
        if [[ $m == cuda ]] && ((DRY)); then
            echo "=== $name (timeout $limit s) would run: $cmd"
            record "$name" skip 0 "needs CUDA"
            return
        elif [[ $m != cuda && $m != - ]] && ! has "$m"; then
            record "$name" skip 0 "$m does not import"
            echo "=== $name: skipped ($m does not import)"
            return
        fi
    done
    left=$((BUDGET_S - PACK_S - SECONDS))
    if ((left < 15 || left < limit / 3)); then
        record "$name" skip 0 "budget: ${left} s left of ${BUDGET_S}, it may take ${limit}"
        echo "=== $name: skipped (budget: $left s left)"
        return
    fi
    if ((limit > left)); then
        note="timeout cut from ${limit} s to ${left} s"
        limit=$left
    fi
    echo "=== $name (timeout $limit s): $cmd" | tee "$LOGS/$name.log"
    start=$SECONDS
    timeout -s INT -k 15 "$limit" bash -c "$cmd" >> "$LOGS/$name.log" 2>&1 < /dev/null
    rc=$?
    ((rc == 124 || rc == 137)) && note="timed out after ${limit} s${note:+ ($note)}"
    ((rc != 0)) && FAILED=1
    record "$name" "$rc" "$((SECONDS - start))" "$note"
    echo "=== $name: rc=$rc in $((SECONDS - start)) s${note:+; $note}; the last $TAIL_LINES lines of its log:"
    tail -n "$TAIL_LINES" "$LOGS/$name.log" | cut -c1-240
}

while read -r name limit needs cmd <&3; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    step "$name" "$limit" "$needs" "$cmd"
done 3<<< "$STEP_TABLE"

# figures.csv: what the logs and the benchmarks' CSVs say; summary.tsv's notes get each step's headline figure
"$PYTHON" - "$LOGS" "$SUMMARY" "$FIGURES" <<'EOF' || echo "figures: parsing the logs failed (rc $?)"
import csv, os, re, sys
logs, summary_path, figures_path = sys.argv[1:4]
rows, heads = [], {}

def log(step):
    path = os.path.join(logs, step + ".log")
    return open(path, errors="replace").read().splitlines() if os.path.exists(path) else []

def num(v):
    try:
        return float(v)
    except ValueError:
        return None

for line in log("env")[1:]:
    m = re.match(r"^([\w. ]+): (.*)$", line)
    if m:
        rows.append(["env", m[1], m[2].strip()])
env = {r[1]: r[2] for r in rows}
heads["env"] = (f"torch {env.get('torch', '?')}, " + (env.get("device", "no CUDA device"))) if env else ""

lines = [l.strip(" =") for l in log("suite")[1:] if l.strip(" =")]
if lines:
    rows.append(["suite", "last line", lines[-1]])
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
        rows.append(["suite", what, n])
    heads["suite"] = lines[-1]

for step in ("bench_kernels",):
    path = os.path.join(logs, step + ".csv")
    if not os.path.exists(path):
        continue
    krows = list(csv.DictReader(open(path)))
    for r in krows:
        key = f"{r['op']} {r['mode']} {r['size']} {r['shape']} {r['dtype']}"
        for col in ("fused_p50_ms", "eager_ms", "x_eager", "GB_s", "pct_copy"):
            rows.append([step, f"{key} {col}", r[col]])
    x = [num(r["x_eager"]) for r in krows if num(r["x_eager"]) is not None]
    pct = [num(r["pct_copy"]) for r in krows if int(r["elements"]) >= 2 ** 26 and num(r["pct_copy"]) is not None]
    heads[step] = (f"{len(krows)} rows; fused / eager {min(x):.2f}-{max(x):.2f}x" if x else f"{len(krows)} rows") + (
        f"; >= 2^26 elements {min(pct):.0f}-{max(pct):.0f}% of copy" if pct else "")

for step in ("cycle_bf16", "cycle_recompute"):
    path = os.path.join(logs, step + ".csv")
    if not os.path.exists(path):
        continue
    vals = {}
    for r in csv.DictReader(open(path)):
        rows.append([step, f"{r['section']}: {r['name']}", r["value"]])
        vals[r["name"]] = num(r["value"])
    parts = []
    if vals.get("cycle shared, offload off") is not None:
        parts.append(f"cycle {vals['cycle shared, offload off']:.0f} ms")
    for key, fmt in (("MFU %", "MFU {:.1f}%"), ("analytic TFLOP/s (model FLOPs)", "{:.3g} TFLOP/s"),
                     ("overhead ratio (cycle / sum of phases)", "overhead {:.3f}"),
                     ("offload on / off (cycle time)", "offload {:.2f}x"),
                     ("host syncs per cycle (CUDA sync debug)", "{:.0f} host syncs")):
        if vals.get(key) is not None:
            parts.append(fmt.format(vals[key]))
    heads[step] = ", ".join(parts)

path = os.path.join(logs, "cycle_graphs.csv")
if os.path.exists(path):
    vals = {r["name"]: num(r["value"]) for r in csv.DictReader(open(path))}
    rows += [["cycle_graphs", k, v] for k, v in vals.items()]
    if vals.get("cycle graphed ms") is not None and vals.get("cycle eager ms") is not None:
        heads["cycle_graphs"] = (f"cycle {vals['cycle eager ms']:.0f} ms eager, {vals['cycle graphed ms']:.0f} ms "
                                 f"graphed ({vals['graphed / eager']:.2f}x); "
                                 f"{vals['graphed cycle in plain steps']:.1f} plain steps")

for step in ("wan13b_cycle", "sit_xl2_cycle", "wan13b_480p", "sit_xl2_b64"):
    lines = log(step)
    starts = [i for i, l in enumerate(lines) if "pretrain_dmd2.py" in l and l.startswith("+")]
    lines = lines[starts[-1]:] if starts else []
    its = [l for l in lines if l.startswith(" iteration")]
    vals = {}
    if its:
        for part in its[-1].split(" | "):
            k, _, v = part.strip(" |").rpartition(": ")
            if k and num(v) is not None:
                vals[k] = num(v)
                rows.append([step, k, v.strip()])
    for l in lines:
        m = re.search(r"peak resident ([\d.]+) MiB in the (\w+) phase.*process peak RSS ([\d.]+) MiB", l)
        if m:
            vals["peak resident MiB"] = float(m[1])
            rows += [[step, "peak resident MiB", m[1]], [step, "peak resident phase", m[2]],
                     [step, "process peak RSS MiB", m[3]]]
    parts = []
    if "elapsed time per iteration (ms)" in vals:
        parts.append(f"{vals['elapsed time per iteration (ms)'] / 1e3:.2f} s per cycle")
    ph = [f"{p} {vals[p + '-ms']:.0f}" for p in ("rollout", "critic", "actor") if p + "-ms" in vals]
    if ph:
        parts.append("ms: " + " ".join(ph))
    if "model TFLOP/s per GPU" in vals:
        parts.append(f"{vals['model TFLOP/s per GPU']:.3g} TFLOP/s")
    if "peak resident MiB" in vals:
        parts.append(f"resident {vals['peak resident MiB'] / 1024:.3g} GiB")
    heads[step] = ", ".join(parts)

with open(figures_path, "a", newline="") as f:
    csv.writer(f).writerows(rows)
table = [l.rstrip("\n").split("\t") for l in open(summary_path)]
for r in table[1:]:
    h = heads.get(r[0], "").replace("\t", " ")
    if h and r[1] != "skip":
        r[3] = f"{r[3]}; {h}" if r[3] else h
with open(summary_path, "w") as f:
    f.writelines("\t".join(r) + "\n" for r in table)
EOF
cp "$SUMMARY" "$FIGURES" "$LOGS/"
tar -czf "$OUTDIR/logs.tar.gz" -C "$SCRATCH" gpu_check || FAILED=1

echo "=== files in $OUTDIR:"
(cd "$OUTDIR" && ls -l summary.tsv figures.csv logs.tar.gz | awk '{print "  " $5 " bytes  " $9}')
if ((DRY)); then
    echo "=== dry run (no CUDA: DRY_RUN=$DRY): the steps above were listed, not run; exit 0"
    FAILED=0
fi
echo "=== summary ($OUTDIR/summary.tsv; $SECONDS s of the $BUDGET_S s budget; exit $FAILED)"
awk -F'\t' '{printf "%-16s %-5s %7s  %s\n", $1, $2, $3, $4}' "$SUMMARY"
exit "$FAILED"
