#!/usr/bin/env bash
# A streaming (causal) student end to end on the long moving digits (--data moving-digits:8: 8-frame clips on a
# torus), on a fresh machine: install into .venv, then
#   1. teacher      flow-matching Wan (--model-size wan-digits), bidirectional over the whole clip
#   2. trajectories the teacher's ODE paths (launch/prepare_trajectories.py)
#   3. causal init  the causal student regressed onto those paths (launch/pretrain_causal_init.py)
#   4. DMD2         a bidirectional 4-step student, for comparison
#   5. Self-Forcing DMD on the causal student's own chunk-by-chunk rollouts (--distill-method self-forcing), rolled
#      out to SF_FRAMES = 2T frames with one T-frame window scored per micro-batch (--self-forcing-rollout-frames,
#      Self-Forcing++), so the student has trained on its own frames past T before it streams them
#   6. samples at the training length T = 8 and at 2T = 16 (the causal students stream past T chunk by chunk
#      with their KV cache; the bidirectional models denoise all 16 frames at once), and two tables
#      (python -m dmd2_mega.eval.report_video): per-frame FD, digit and direction accuracy, speed, frame
#      consistency, time to the first chunk and total sampling time; a GIF grid per length.
# Chunks of 2 frames (4 chunks per clip), 4 steps per chunk. Re-running resumes from the checkpoints.
# Env: RUN_DIR (default runs/quickstart_causal), NPROC (torchrun ranks for the training steps, default 1),
# TEACHER_ITERS, PATHS (trajectories), INIT_ITERS, DMD2_ITERS, SF_ITERS, SF_FRAMES, GUIDANCE (teacher CFG for
# sampling, the trajectories and the DMD real score), NUM_SAMPLES (per table row, default 200 = 5 per (digit,
# direction) prompt).
# Wall time on 2 CPU cores and the table it printed: README.md ("Streaming students"), benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export TORCH_COMPILE_DISABLE=1

RUN_DIR="${RUN_DIR:-runs/quickstart_causal}"
NPROC="${NPROC:-1}"
TEACHER_ITERS="${TEACHER_ITERS:-1600}"
PATHS="${PATHS:-768}"
INIT_ITERS="${INIT_ITERS:-300}"
DMD2_ITERS="${DMD2_ITERS:-60}"
SF_ITERS="${SF_ITERS:-160}"
GUIDANCE="${GUIDANCE:-2}"
NUM_SAMPLES="${NUM_SAMPLES:-200}"
T=8
SF_FRAMES="${SF_FRAMES:-$((2 * T))}"
DATA="moving-digits:$T"
SHIFT=3    # timestep shift: more training at high noise, where the direction is decided (docs/data_format.md)
CAUSAL=(--causal --causal-chunk-frames 2)
mkdir -p "$RUN_DIR"
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC")
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    LAUNCH=(python)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
echo "> set-up (.venv, install) took ${SECONDS}s"
SECONDS=0
step() { echo "== $1"; STEP_START=$SECONDS; }
done_in() { echo "   $1 in $((SECONDS - STEP_START))s (${SECONDS}s so far)"; }

step "1/6 teacher: flow-matching Wan (--model-size wan-digits) on $T-frame moving digits"
"${LAUNCH[@]}" launch/pretrain_flow.py --model-size wan-digits --data "$DATA" \
    --micro-batch-size $((64 / NPROC)) --global-batch-size 64 --train-iters "$TEACHER_ITERS" \
    --lr 3e-3 --min-lr 1e-5 --lr-warmup-iters 50 --clip-grad 1.0 --cond-dropout 0.1 --timestep-shift "$SHIFT" \
    --save "$RUN_DIR/teacher" --load "$RUN_DIR/teacher" --save-interval 200 --log-interval 100
done_in "teacher ready"

step "2/6 trajectories: $PATHS teacher ODE paths (16 Euler steps, CFG $GUIDANCE)"
python launch/prepare_trajectories.py --teacher-load "$RUN_DIR/teacher" --data "$DATA" --num-samples "$PATHS" \
    --teacher-steps 16 --guidance "$GUIDANCE" --batch-size 64 --shard-size 256 --out "$RUN_DIR/paths"
done_in "trajectories ready"

step "3/6 causal init: the causal student (chunks of 2 frames) regressed onto the teacher's paths"
"${LAUNCH[@]}" launch/pretrain_causal_init.py --model-size wan-digits "${CAUSAL[@]}" \
    --teacher-load "$RUN_DIR/teacher" --data "$RUN_DIR/paths" --timestep-shift "$SHIFT" \
    --micro-batch-size $((32 / NPROC)) --global-batch-size 32 --train-iters "$INIT_ITERS" \
    --lr 3e-4 --min-lr 1e-5 --lr-warmup-iters 20 --clip-grad 1.0 --num-workers 0 --log-interval 100 \
    --save "$RUN_DIR/causal_init" --load "$RUN_DIR/causal_init" --save-interval 100
done_in "causal init trained"

step "4/6 DMD2: a bidirectional 4-step student from the teacher (K=5 critic steps per rollout)"
"${LAUNCH[@]}" launch/pretrain_dmd2.py --model-size wan-digits --data "$DATA" \
    --teacher-load "$RUN_DIR/teacher" --dmd2-denoising-steps 4 --timestep-shift "$SHIFT" \
    --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale "$GUIDANCE" \
    --micro-batch-size $((16 / NPROC)) --global-batch-size 16 --train-iters "$DMD2_ITERS" \
    --lr 5e-4 --min-lr 1e-5 --clip-grad 1.0 --log-interval 20 \
    --save "$RUN_DIR/dmd2_4step" --load "$RUN_DIR/dmd2_4step" --save-interval 30
done_in "DMD2 student distilled"

step "5/6 Self-Forcing DMD: the causal init trained on its own $SF_FRAMES-frame rollouts (4 steps per chunk)"
"${LAUNCH[@]}" launch/pretrain_dmd2.py --model-size wan-digits --data "$DATA" --distill-method self-forcing \
    "${CAUSAL[@]}" --self-forcing-rollout-frames "$SF_FRAMES" \
    --teacher-load "$RUN_DIR/teacher" --student-load "$RUN_DIR/causal_init" \
    --dmd2-denoising-steps 4 --timestep-shift "$SHIFT" \
    --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale "$GUIDANCE" \
    --micro-batch-size $((16 / NPROC)) --global-batch-size 16 --train-iters "$SF_ITERS" \
    --lr 1e-4 --min-lr 1e-5 --clip-grad 1.0 --log-interval 20 \
    --save "$RUN_DIR/self_forcing" --load "$RUN_DIR/self_forcing" --save-interval 40
done_in "Self-Forcing student trained"

step "6/6 samples ($NUM_SAMPLES each, every (digit, direction) prompt in turn) at T = $T and 2T = $((2 * T))"
S="$RUN_DIR/samples"
draw() { python launch/sample.py --num-samples "$NUM_SAMPLES" --data "$DATA" --num-media 0 "$@"; }
for frames in $T $((2 * T)); do
    [ "$frames" = "$T" ] && draw --load "$RUN_DIR/teacher" --steps 50 --guidance "$GUIDANCE" --out "$S/teacher_50step_$frames"
    draw --load "$RUN_DIR/teacher" --steps 4 --guidance "$GUIDANCE" --num-frames "$frames" --out "$S/teacher_4step_$frames"
    draw --load "$RUN_DIR/dmd2_4step" --num-frames "$frames" --out "$S/dmd2_4step_$frames"
    draw --load "$RUN_DIR/causal_init" --stream --num-frames "$frames" --out "$S/causal_init_$frames"
    draw --load "$RUN_DIR/self_forcing" --stream --num-frames "$frames" --out "$S/self_forcing_$frames"
done
done_in "sampled"

echo "== quality: per-frame Frechet distance vs held-out clips, digit / direction accuracy, consistency, timing"
for frames in $T $((2 * T)); do
    rows=()
    [ "$frames" = "$T" ] && rows+=("teacher, 50 Euler steps, CFG $GUIDANCE=$S/teacher_50step_$frames/samples.npz")
    rows+=("teacher, 4 Euler steps, CFG $GUIDANCE=$S/teacher_4step_$frames/samples.npz"
           "DMD2 student (bidirectional), 4 steps=$S/dmd2_4step_$frames/samples.npz"
           "causal init, 4 steps per chunk, streamed=$S/causal_init_$frames/samples.npz"
           "Self-Forcing student, 4 steps per chunk, streamed=$S/self_forcing_$frames/samples.npz")
    python -m dmd2_mega.eval.report_video --json "$RUN_DIR/metrics_$frames.json" --gif "$RUN_DIR/grid_$frames.gif" \
        "${rows[@]}" | tee "$RUN_DIR/metrics_$frames.md"
done
echo "GIF grids: $RUN_DIR/grid_$T.gif, $RUN_DIR/grid_$((2 * T)).gif; metrics: $RUN_DIR/metrics_*.json; total ${SECONDS}s"
