#!/usr/bin/env bash
# End to end on the embedded moving digits (--data moving-digits: an 8x8 digit crossing a 16x16 canvas over
# 4 frames, conditioned on the prompt embedding of "digit <k> moves <direction>"), on a fresh machine:
# install into .venv, train the wan-digits teacher (a small Wan transformer; reused if already trained),
# distill a 4-step and a 1-step student with DMD2, sample the teacher at 50 / 4 / 1 Euler steps and both
# students, print one quality table (python -m dmd2_mega.eval.report_video) and write a GIF grid
# ($RUN_DIR/grid.gif: one row per model, one column per digit, frame t of every clip at time t) and a figure of the
# students' training curves ($RUN_DIR/curves.png).
# Re-running resumes from the checkpoints.
# Env: RUN_DIR (default runs/quickstart_video), NPROC (torchrun ranks, default 1), TEACHER_ITERS, DMD2_ITERS_4STEP,
# DMD2_ITERS_1STEP, GUIDANCE (teacher CFG for sampling and for DMD2's real score; the 50-step teacher's FD is
# 7.34 / 5.51 / 6.18 and its digit accuracy 74.6 / 80.1 / 83.0% at CFG 2 / 2.5 / 3, but the 4-step student at 80
# cycles scored 8.47 / 10.48 / 14.94: a higher CFG is a target it reaches slowly; benchmarks/RESULTS.md),
# NUM_SAMPLES (per table row, default 400 = 10 per (digit, direction) prompt), LORA_RANK (the LoRA 4-step student:
# student and critic as rank-r adapters over the teacher's one frozen copy, same cycles as the full student; 0 skips
# it), LORA_LR (its lr),
# I2V (1: also the image-to-video rows, 0 skips them), I2V_TEACHER_ITERS, I2V_DMD2_ITERS, JOBS (runs at once,
# launch/jobs.sh: the students, the image-to-video part and the samplers side by side on a share of the cores each;
# default the cores, at most 4).
# Image-to-video (last): the same clips with each clip's first frame in the condition (--data moving-digits-i2v), a
# wan-digits-i2v teacher trained from scratch, a 4-step DMD2 student on it, and a second table with the first-frame
# error (mean |generated frame 0 - given frame 0|); `I2V=0 bash launch/quickstart_video.sh` skips it.
# Measured 2026-12-04 from a fresh clone on 2 CPU cores (an AMD EPYC with AVX-512, no GPU), its own install included:
# 14m53s (set-up 43 s, teacher 252 s for 1,500 steps on both cores; then two runs at a time on one core each: the
# image-to-video part 488 s beside the LoRA 4-step student 169 s, the 4-step 188 s, the 1-step 124 s (80 cycles each,
# with their samples) and the teacher's samplers 121 s; the tables and curves 26 s). The
# tables are in docs/usage.md ("Video quickstart"); the settings' reasons in benchmarks/RESULTS.md ("Video
# quickstart", "LoRA students in the quickstarts") and docs/usage.md ("Image-to-video rows").
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/quickstart_report.sh
source launch/jobs.sh
export TORCH_COMPILE_DISABLE=1

RUN_DIR="${RUN_DIR:-runs/quickstart_video}"
NPROC="${NPROC:-1}"
TEACHER_ITERS="${TEACHER_ITERS:-1500}"
DMD2_ITERS_4STEP="${DMD2_ITERS_4STEP:-80}"
DMD2_ITERS_1STEP="${DMD2_ITERS_1STEP:-80}"
GUIDANCE="${GUIDANCE:-2}"
NUM_SAMPLES="${NUM_SAMPLES:-400}"
LORA_RANK="${LORA_RANK:-4}"
LORA_LR="${LORA_LR:-2e-2}"
I2V="${I2V:-1}"
I2V_TEACHER_ITERS="${I2V_TEACHER_ITERS:-1000}"
I2V_DMD2_ITERS="${I2V_DMD2_ITERS:-60}"
SHIFT=3  # timestep shift: more training at high noise, where the direction is decided (docs/data_format.md)
# the students' training curves (<save>/curves.jsonl, $RUN_DIR/curves.png): an eval of 80 clips (2 per prompt) every
# 20 cycles (0.75 cycles' time each, the first 1.1) costs 4% of a 4-step student's time on 2 CPU cores
EVAL_FLAGS=(--eval-interval 20 --eval-num-samples 80)
mkdir -p "$RUN_DIR"
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC")
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    LAUNCH=(python)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
echo "> set-up (.venv, install) took ${SECONDS}s"
jobs_init
SECONDS=0

echo "== 1/4 teacher: flow-matching Wan (--model-size wan-digits) on the moving digits"
"${LAUNCH[@]}" launch/pretrain_flow.py --model-size wan-digits --data moving-digits \
    --micro-batch-size $((64 / NPROC)) --global-batch-size 64 --train-iters "$TEACHER_ITERS" \
    --lr 3e-3 --min-lr 1e-5 --lr-warmup-iters 50 --clip-grad 1.0 --cond-dropout 0.1 --timestep-shift "$SHIFT" \
    --save "$RUN_DIR/teacher" --load "$RUN_DIR/teacher" --save-interval 500 --log-interval 100 \
    --tensorboard-dir "$RUN_DIR/tensorboard/teacher"
echo "   teacher ready after ${SECONDS}s"

# distill NAME STEPS ITERS LR [flags...]: a DMD2 student of the teacher in $RUN_DIR/NAME, then its samples
distill() {
    local name=$1 steps=$2 iters=$3 lr=$4
    shift 4
    "${LAUNCH[@]}" launch/pretrain_dmd2.py --model-size wan-digits --data moving-digits \
        --teacher-load "$RUN_DIR/teacher" --dmd2-denoising-steps "$steps" --timestep-shift "$SHIFT" \
        --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale "$GUIDANCE" \
        --micro-batch-size $((32 / NPROC)) --global-batch-size 32 --train-iters "$iters" \
        --lr "$lr" --min-lr 1e-5 --clip-grad 1.0 \
        --save "$RUN_DIR/$name" --load "$RUN_DIR/$name" --save-interval 40 \
        --log-interval 25 --tensorboard-dir "$RUN_DIR/tensorboard/$name" "${EVAL_FLAGS[@]}" "$@"
    "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/$name" --num-samples "$NUM_SAMPLES" --out "$RUN_DIR/samples/$name"
}

# image_to_video: the same clips with each clip's first frame in the condition: its own teacher, a 4-step student,
# their samples (the table comes after the text-to-video one)
image_to_video() {
    "${LAUNCH[@]}" launch/pretrain_flow.py --model-size wan-digits-i2v --data moving-digits-i2v \
        --micro-batch-size $((64 / NPROC)) --global-batch-size 64 --train-iters "$I2V_TEACHER_ITERS" \
        --lr 3e-3 --min-lr 1e-5 --lr-warmup-iters 50 --clip-grad 1.0 --cond-dropout 0.1 --timestep-shift "$SHIFT" \
        --save "$RUN_DIR/i2v_teacher" --load "$RUN_DIR/i2v_teacher" --save-interval 500 --log-interval 100 \
        --tensorboard-dir "$RUN_DIR/tensorboard/i2v_teacher"
    echo "   I2V teacher ready; DMD2: 4-step I2V student (K=5, CFG keeps the image)"
    "${LAUNCH[@]}" launch/pretrain_dmd2.py --model-size wan-digits-i2v --data moving-digits-i2v \
        --teacher-load "$RUN_DIR/i2v_teacher" --dmd2-denoising-steps 4 --timestep-shift "$SHIFT" \
        --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale "$GUIDANCE" \
        --micro-batch-size $((32 / NPROC)) --global-batch-size 32 --train-iters "$I2V_DMD2_ITERS" \
        --lr 5e-4 --min-lr 1e-5 --clip-grad 1.0 \
        --save "$RUN_DIR/i2v_student_4step" --load "$RUN_DIR/i2v_student_4step" --save-interval 40 \
        --log-interval 20 --tensorboard-dir "$RUN_DIR/tensorboard/i2v_student_4step"
    echo "   samples ($NUM_SAMPLES each: every prompt with the first frame of a held-out clip of its pair)"
    for steps in 50 4; do
        "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/i2v_teacher" --num-samples "$NUM_SAMPLES" --steps "$steps" \
            --guidance "$GUIDANCE" --out "$RUN_DIR/samples/i2v_teacher_${steps}step"
    done
    "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/i2v_student_4step" --num-samples "$NUM_SAMPLES" \
        --out "$RUN_DIR/samples/i2v_student_4step"
}

# the longest runs first, so that side by side (JOBS, launch/jobs.sh) the last to start ends soonest
if [ "$I2V" != 0 ]; then
    echo "== image-to-video: each clip conditioned on its prompt and its first frame (--data moving-digits-i2v)"
    job i2v image_to_video
fi
echo "== 2/4 DMD2 students from the teacher (K=5 critic steps per rollout), each then sampled"
if [ "$LORA_RANK" -gt 0 ]; then
    echo "   4-step LoRA student, rank $LORA_RANK (student and critic over the teacher's weights)"
    job student_4step_lora distill student_4step_lora 4 "$DMD2_ITERS_4STEP" "$LORA_LR" \
        --student-lora-rank "$LORA_RANK" --critic-lora-rank "$LORA_RANK"
fi
for steps in 4 1; do
    iters_var="DMD2_ITERS_${steps}STEP"
    echo "   ${steps}-step student"
    job "student_${steps}step" distill "student_${steps}step" "$steps" "${!iters_var}" 5e-4
done
echo "== 3/4 the teacher's samples ($NUM_SAMPLES each, every (digit, direction) prompt in turn)"
for steps in 50 4 1; do
    job "teacher_${steps}step" "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/teacher" --steps "$steps" \
        --num-samples "$NUM_SAMPLES" --guidance "$GUIDANCE" --out "$RUN_DIR/samples/teacher_${steps}step"
done
jobs_wait
echo "   students and samples done after ${SECONDS}s"

echo "== 4/4 quality: per-frame Frechet distance vs held-out clips, digit / direction accuracy, consistency"
[ "$JOBS" -gt 1 ] && echo "   (the sampling-time columns were measured beside other runs; JOBS=1 times each alone)"
S="$RUN_DIR/samples"
ROWS=("teacher, 50 Euler steps, CFG $GUIDANCE=$S/teacher_50step/samples.npz"
      "teacher, 4 Euler steps, CFG $GUIDANCE=$S/teacher_4step/samples.npz"
      "teacher, 1 Euler step, CFG $GUIDANCE=$S/teacher_1step/samples.npz"
      "DMD2 student, 4 steps=$S/student_4step/samples.npz"
      "DMD2 student, 1 step=$S/student_1step/samples.npz")
[ "$LORA_RANK" -gt 0 ] && ROWS+=("DMD2 LoRA student rank $LORA_RANK, 4 steps=$S/student_4step_lora/samples.npz")
python -m dmd2_mega.eval.report_video --json "$RUN_DIR/metrics.json" --gif "$RUN_DIR/grid.gif" "${ROWS[@]}" \
    | tee "$RUN_DIR/metrics.md"
report_memory_and_curves
echo "GIF grid: $RUN_DIR/grid.gif; clips: $S/*/media/; metrics: $RUN_DIR/metrics.json; curves: $RUN_DIR/curves.png"

if [ "$I2V" != 0 ]; then
    echo "== image-to-video quality (its log: $RUN_DIR/logs/i2v.log)"
    python -m dmd2_mega.eval.report_video --json "$RUN_DIR/metrics_i2v.json" --gif "$RUN_DIR/grid_i2v.gif" \
        "I2V teacher, 50 Euler steps, CFG $GUIDANCE=$S/i2v_teacher_50step/samples.npz" \
        "I2V teacher, 4 Euler steps, CFG $GUIDANCE=$S/i2v_teacher_4step/samples.npz" \
        "I2V DMD2 student, 4 steps=$S/i2v_student_4step/samples.npz" | tee "$RUN_DIR/metrics_i2v.md"
    echo "   GIF grid: $RUN_DIR/grid_i2v.gif"
fi
echo "total ${SECONDS}s"
