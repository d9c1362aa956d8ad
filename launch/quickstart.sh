#!/usr/bin/env bash
# End to end on the embedded digits data, on a fresh machine: install into .venv, train the digits
# teacher (flow matching; reused if already trained), distill a 4-step and a 1-step student with
# DMD2, sample everything, print one quality table and draw the students' training curves ($RUN_DIR/curves.png).
# Re-running resumes from the checkpoints.
# Env: RUN_DIR (default runs/quickstart), NPROC (torchrun ranks, default 1), TEACHER_ITERS,
# DMD2_ITERS_4STEP, DMD2_ITERS_1STEP, GUIDANCE (teacher CFG for sampling), DMD2_GUIDANCE_4STEP,
# DMD2_GUIDANCE_1STEP (teacher CFG of DMD2's real score, default GUIDANCE's for both: a student distils the teacher
# at that CFG, and the 50-step teacher's FD moves with it, 1.23 / 1.11 / 1.34 / 1.80 at CFG 1 / 1.125 / 1.25 / 1.375;
# at 1.375 the 4-step student matched that target, 1.78 over 3 seeds; benchmarks/RESULTS.md; a CFG other than
# GUIDANCE adds the 50-step teacher at it to the table), DMD2_LR_4STEP, DMD2_LR_1STEP (peak learning rates, 1e-4
# and 6e-4: the 1-step student scored 1.83 / 1.69 / 1.60 over 3 seeds at 1e-4 / 3e-4 / 6e-4, 1.64 at 1e-3 at seed 1;
# the 4-step one was worse at 2e-4 and unstable at 3e-4),
# DMD2_FLAGS_4STEP, DMD2_FLAGS_1STEP (pretrain_dmd2.py flags,
# e.g. the GAN head), NUM_SAMPLES (per table row, default 2000: at 500 the Frechet distance of one
# model moved between 2.24 and 2.65 across sampling seeds), LORA_RANK (the LoRA 4-step student: student and
# critic as rank-r adapters over the teacher's one frozen copy, same cycles as the full student; 0 skips it),
# LORA_LR (its learning rate), SEEDS (the students' --seed, default 1234; several, e.g. SEEDS="1 2 3": each student
# trained once per seed into student_<N>step_seed<S>, one table row per seed and a second table of each student's
# mean and spread over the seeds; the LoRA student at the first seed only), JOBS (runs at once, launch/jobs.sh:
# the students, each then sampled, and the teacher's samplers side by side on a share of the cores each; default the
# cores, at most 4).
# The students' recipe is the best cell of benchmarks/quality_ablation.py (docs/performance.md, "Quality
# ablation"): DMD only, no GAN head and no EMA, 360 cycles (its 240 s budget on 2 CPU cores); the
# GAN head (DMD2_FLAGS_*="--dmd2-gan ...") costs 1.15-1.4x per cycle and did not pay for itself there. It pays in
# longer runs: DMD2_ITERS_1STEP=1300 DMD2_FLAGS_1STEP="--dmd2-gan --dmd2-gan-sigma-range 0.05 0.3
# --dmd2-gan-gen-weight 3e-2 --dmd2-gan-head-lr-mult 3 --dmd2-gan-real-rows 8" gave a 1-step student below the
# 50-step teacher (FD 1.22 against 1.31; DMD only 1.41 at equal time; benchmarks/RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/quickstart_report.sh
source launch/jobs.sh
export TORCH_COMPILE_DISABLE=1

RUN_DIR="${RUN_DIR:-runs/quickstart}"
NPROC="${NPROC:-1}"
TEACHER_ITERS="${TEACHER_ITERS:-2000}"
DMD2_ITERS_4STEP="${DMD2_ITERS_4STEP:-360}"
DMD2_ITERS_1STEP="${DMD2_ITERS_1STEP:-360}"
GUIDANCE="${GUIDANCE:-1.25}"
DMD2_GUIDANCE_4STEP="${DMD2_GUIDANCE_4STEP:-$GUIDANCE}"
DMD2_GUIDANCE_1STEP="${DMD2_GUIDANCE_1STEP:-$GUIDANCE}"
DMD2_LR_4STEP="${DMD2_LR_4STEP:-1e-4}"
DMD2_LR_1STEP="${DMD2_LR_1STEP:-6e-4}"
DMD2_FLAGS_4STEP="${DMD2_FLAGS_4STEP-}"
DMD2_FLAGS_1STEP="${DMD2_FLAGS_1STEP-}"
NUM_SAMPLES="${NUM_SAMPLES:-2000}"
LORA_RANK="${LORA_RANK:-8}"
LORA_LR="${LORA_LR:-3e-3}"
read -ra SEED_LIST <<< "${SEEDS:-1234}"
# one seed: the students' folders as they always were (a re-run resumes them); several: one folder per seed
if [ "${#SEED_LIST[@]}" -gt 1 ]; then SUFFIXES=("${SEED_LIST[@]/#/_seed}"); else SUFFIXES=(""); fi
# the students' training curves (<save>/curves.jsonl, $RUN_DIR/curves.png): an eval of 500 samples every 40 cycles
# (1.3 cycles' time each) costs 3.5% of a 4-step student's time on 2 CPU cores
EVAL_FLAGS=(--eval-interval 40 --eval-num-samples 500)
mkdir -p "$RUN_DIR"
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC")
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    LAUNCH=(python)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
jobs_init
SECONDS=0

echo "== 1/4 teacher: flow-matching DiT (--model-size digits) on the digits data"
"${LAUNCH[@]}" launch/pretrain_flow.py --model-size digits --data digits \
    --micro-batch-size $((128 / NPROC)) --global-batch-size 128 --train-iters "$TEACHER_ITERS" \
    --lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 100 --clip-grad 1.0 --cond-dropout 0.1 \
    --save "$RUN_DIR/teacher" --load "$RUN_DIR/teacher" --save-interval 500 --log-interval 100 \
    --tensorboard-dir "$RUN_DIR/tensorboard/teacher"
echo "   teacher ready after ${SECONDS}s"

# distill NAME STEPS SEED LR GUIDANCE ITERS [flags...]: a DMD2 student of the teacher in $RUN_DIR/NAME, then its
# samples in $RUN_DIR/samples/NAME
distill() {
    local name=$1 steps=$2 seed=$3 lr=$4 guidance=$5 iters=$6
    shift 6
    "${LAUNCH[@]}" launch/pretrain_dmd2.py --model-size digits --data digits \
        --teacher-load "$RUN_DIR/teacher" --dmd2-denoising-steps "$steps" \
        --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale "$guidance" \
        --micro-batch-size $((64 / NPROC)) --global-batch-size 64 --train-iters "$iters" \
        --lr "$lr" --min-lr 1e-5 --clip-grad 1.0 --seed "$seed" \
        --save "$RUN_DIR/$name" --load "$RUN_DIR/$name" --save-interval 120 \
        --log-interval 25 --tensorboard-dir "$RUN_DIR/tensorboard/$name" "${EVAL_FLAGS[@]}" "$@"
    "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/$name" --num-samples "$NUM_SAMPLES" --out "$RUN_DIR/samples/$name"
}

# the longest runs first, so that side by side (JOBS, launch/jobs.sh) the last to start ends soonest
echo "== 2/4 DMD2 students from the teacher (K=5 critic steps per rollout), each then sampled"
if [ "$LORA_RANK" -gt 0 ]; then
    echo "   4-step LoRA student, rank $LORA_RANK (student and critic over the teacher's weights), seed ${SEED_LIST[0]}"
    # shellcheck disable=SC2086  # DMD2_FLAGS_4STEP: several flags
    job student_4step_lora distill student_4step_lora 4 "${SEED_LIST[0]}" "$LORA_LR" "$DMD2_GUIDANCE_4STEP" \
        "$DMD2_ITERS_4STEP" --student-lora-rank "$LORA_RANK" --critic-lora-rank "$LORA_RANK" $DMD2_FLAGS_4STEP
fi
for steps in 4 1; do
  iters_var="DMD2_ITERS_${steps}STEP" guidance_var="DMD2_GUIDANCE_${steps}STEP"
  flags_var="DMD2_FLAGS_${steps}STEP" lr_var="DMD2_LR_${steps}STEP"
  for i in "${!SEED_LIST[@]}"; do
    name="student_${steps}step${SUFFIXES[$i]}"
    echo "   ${steps}-step student, seed ${SEED_LIST[$i]}: $name"
    # shellcheck disable=SC2086
    job "$name" distill "$name" "$steps" "${SEED_LIST[$i]}" "${!lr_var}" "${!guidance_var}" "${!iters_var}" \
        ${!flags_var}
  done
done

echo "== 3/4 the teacher's samples ($NUM_SAMPLES each, class-balanced, as the students')"
for steps in 50 4 1; do
    job "teacher_${steps}step" "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/teacher" --steps "$steps" \
        --num-samples "$NUM_SAMPLES" --guidance "$GUIDANCE" --out "$RUN_DIR/samples/teacher_${steps}step"
done
# the teacher at each student's real-score CFG too: the distribution DMD2 distils (its FD moves a lot with CFG)
STUDENT_CFGS=()
for g in $(printf '%s\n' "$DMD2_GUIDANCE_4STEP" "$DMD2_GUIDANCE_1STEP" | sort -u); do
    [ "$g" = "$GUIDANCE" ] && continue
    STUDENT_CFGS+=("$g")
    job "teacher_50step_cfg$g" "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/teacher" \
        --num-samples "$NUM_SAMPLES" --steps 50 --guidance "$g" --out "$RUN_DIR/samples/teacher_50step_cfg$g"
done
jobs_wait
echo "   students and samples done after ${SECONDS}s"

echo "== 4/4 quality: Frechet distance of classifier features vs held-out digits, accuracy, diversity"
S="$RUN_DIR/samples"
ROWS=("teacher, 50 Euler steps, CFG $GUIDANCE=$S/teacher_50step/samples.npz"
      "teacher, 4 Euler steps, CFG $GUIDANCE=$S/teacher_4step/samples.npz"
      "teacher, 1 Euler step, CFG $GUIDANCE=$S/teacher_1step/samples.npz")
for g in "${STUDENT_CFGS[@]}"; do
    ROWS+=("teacher, 50 Euler steps, CFG $g (a student's real score)=$S/teacher_50step_cfg$g/samples.npz")
done
for i in "${!SEED_LIST[@]}"; do  # "@ seed S" rows: eval.report adds their mean and spread
    suffix="${SUFFIXES[$i]}" at="${SUFFIXES[$i]/_seed/ @ seed }"
    ROWS+=("DMD2 student, 4 steps$at=$S/student_4step$suffix/samples.npz"
           "DMD2 student, 1 step$at=$S/student_1step$suffix/samples.npz")
done
[ "$LORA_RANK" -gt 0 ] && ROWS+=("DMD2 LoRA student rank $LORA_RANK, 4 steps=$S/student_4step_lora/samples.npz")
python -m dmd2_mega.eval.report --json "$RUN_DIR/metrics.json" "${ROWS[@]}" | tee "$RUN_DIR/metrics.md"
report_memory_and_curves "${SUFFIXES[@]}"
echo "grids: $S/*/grid.png; metrics: $RUN_DIR/metrics.json; curves: $RUN_DIR/curves.png; total ${SECONDS}s"
