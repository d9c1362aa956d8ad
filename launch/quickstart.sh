#!/usr/bin/env bash
# End to end on the embedded digits data, on a fresh machine: install into .venv, train the digits
# teacher (flow matching), sample it at 50 / 4 / 1 Euler steps and print the quality metric.
# Re-running resumes from the last checkpoint. Env: RUN_DIR (default runs/quickstart),
# NPROC (torchrun ranks, default 1), TEACHER_ITERS, GUIDANCE.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export TORCH_COMPILE_DISABLE=1

RUN_DIR="${RUN_DIR:-runs/quickstart}"
NPROC="${NPROC:-1}"
TEACHER_ITERS="${TEACHER_ITERS:-2000}"
GUIDANCE="${GUIDANCE:-1.25}"
mkdir -p "$RUN_DIR"
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC")
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    LAUNCH=(python)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi

echo "== 1/3 teacher: flow-matching DiT (--model-size digits) on the digits data"
"${LAUNCH[@]}" launch/pretrain_flow.py --model-size digits --data digits \
    --micro-batch-size $((128 / NPROC)) --global-batch-size 128 --train-iters "$TEACHER_ITERS" \
    --lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 100 --clip-grad 1.0 --cond-dropout 0.1 \
    --save "$RUN_DIR/teacher" --load "$RUN_DIR/teacher" --save-interval 500 --log-interval 100 \
    --tensorboard-dir "$RUN_DIR/tensorboard"

echo "== 2/3 samples of the teacher (guidance $GUIDANCE)"
for steps in 50 4 1; do
    "${LAUNCH[@]}" launch/sample.py --load "$RUN_DIR/teacher" --num-samples 500 --steps "$steps" \
        --guidance "$GUIDANCE" --out "$RUN_DIR/teacher_samples_${steps}step"
done

echo "== 3/3 quality metric (Frechet distance of classifier features vs held-out digits; accuracy)"
for steps in 50 4 1; do
    echo "-- teacher, $steps Euler steps:"
    python -m dmd2_mega.eval.digits "$RUN_DIR/teacher_samples_${steps}step/samples.npz" | tee "$RUN_DIR/metric_teacher_${steps}step.json"
done
echo "grids: $RUN_DIR/teacher_samples_*step/grid.png"
