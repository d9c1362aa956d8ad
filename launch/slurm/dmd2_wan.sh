#!/bin/bash
# The body of the Wan 2.1 DMD2 recipes (launch/slurm/dmd2_wan2.1_14b.sbatch, dmd2_wan2.1_1.3b.sbatch), which set
# RECIPE (their path), RUN_NAME (default save / TensorBoard name), PLAN_MODEL (the planner's --model-size),
# DRY_NODES / DRY_NODELIST (the fake allocation of a dry run) and REPO, then source this file.
#
# Knobs (environment): TEACHER and DATA_PATH (required), SAVE (also --load: resubmitting resumes; the critic
# is saved in ${SAVE}_critic), VAE (the diffusers Wan VAE folder: the eval writes MP4s, needs ffmpeg) and
# EVAL_PROMPTS (prepare_data.py --prompts-only); either turns the eval on every EVAL_INTERVAL (500) cycles,
# EVAL_NUM_SAMPLES (16) videos without prompts. ATTENTION_BACKEND: sdpa, or flash where flash-attn is installed.
# The planner: PLAN_MODEL (the recipe's size), LATENT_SHAPE ("16 21 60 104": 81 frames at 480p; "16 21 90 160"
# for 720p) and TEXT_LEN (512) must describe DATA_PATH; GPU_MEMORY_GB (80; GPU_MEMORY_GIB, its old name, is still
# read). Also REPO (default: the submit dir), PYTHON (runs the planner), TORCHRUN, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, MICRO_BATCH_SIZE,
# GLOBAL_BATCH_SIZE (unset: micro x DP), TRAIN_ITERS, LR, CRITIC_LR, EMA_DECAY, TIMESTEP_SHIFT (3, Wan's shift
# at 480p; 5 at 720p), DENOISING_STEPS, CRITIC_STEPS, GUIDANCE (5, Wan 2.1's CFG scale), SAVE_INTERVAL,
# TENSORBOARD_DIR, EXTRA_ARGS (appended, split on spaces; e.g. "--exit-signal-handler" on preemptible nodes).
# A recipe for another method or a causal student also sets (all split on spaces): METHOD_ARGS (the trainer's, e.g.
# "--distill-method self-forcing"), CAUSAL_ARGS (the model's, e.g. "--causal --causal-chunk-frames 3": given to the
# planner too, which then plans the KV cache), STUDENT_SIGMAS (--dmd2-student-sigmas instead of
# --dmd2-denoising-steps) and STUDENT_LOAD (--student-load, e.g. the causal init).
DRY_RUN=${DRY_RUN:-0}
if [[ "$DRY_RUN" == 1 ]]; then  # a fake allocation, so the dry run works without SLURM
    : "${SLURM_JOB_ID:=0}" "${SLURM_NNODES:=$DRY_NODES}" "${SLURM_NODEID:=0}" "${SLURM_JOB_NODELIST:=$DRY_NODELIST}"
elif [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: not inside a SLURM allocation (no SLURM_JOB_ID): submit with sbatch, or set DRY_RUN=1" >&2
    exit 2
fi
for var in TEACHER DATA_PATH; do
    if [[ -z "${!var:-}" ]]; then
        echo "error: set $var (the header of $RECIPE shows how to make it)" >&2
        exit 2
    fi
done

first_host() {  # the first hostname of a SLURM node list, e.g. gpu[07-08,12] -> gpu07
    if command -v scontrol >/dev/null 2>&1; then  # `scontrol show hostnames | head -n1`, without the
        local hosts                                # SIGPIPE that pipefail would turn into an exit
        hosts=$(scontrol show hostnames "$1") || return
        echo "${hosts%%$'\n'*}"
        return
    fi
    local head=${1%%,*}                  # without scontrol (dry run): expand the first entry by hand
    if [[ "$head" == *"["* ]]; then
        local rest=${1#*[}
        head="${1%%[*}${rest%%[-,\]]*}"
    fi
    echo "$head"
}

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_ADDR=${MASTER_ADDR:-$(first_host "$SLURM_JOB_NODELIST")}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
TORCHRUN=${TORCHRUN:-torchrun}
PYTHON=${PYTHON:-python}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
DENOISING_STEPS=${DENOISING_STEPS:-4} CRITIC_STEPS=${CRITIC_STEPS:-5} GUIDANCE=${GUIDANCE:-5}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} CUDA_DEVICE_MAX_CONNECTIONS=1

# The layout: launch/plan_memory.py searches TP x CP x DP (and SP, distributed optimizer, recompute, offload)
# for the allocation's GPUs; its table goes to the log, and --emit-flags prints the chosen trainer flags.
read -r -a LATENT <<< "${LATENT_SHAPE:-16 21 60 104}"
# shellcheck disable=SC2206  # split on purpose (the header's knobs)
CAUSAL=(${CAUSAL_ARGS:-}) METHOD=(${METHOD_ARGS:-}) SIGMAS=(${STUDENT_SIGMAS:-})
if [[ ${#SIGMAS[@]} -gt 0 ]]; then
    GRID=(--dmd2-student-sigmas "${SIGMAS[@]}")
else
    GRID=(--dmd2-denoising-steps "$DENOISING_STEPS")
fi
PLAN=("$PYTHON" "$REPO/launch/plan_memory.py" --model-size "$PLAN_MODEL" --latent-shape "${LATENT[@]}"
      --text-len "${TEXT_LEN:-512}" --micro-batch-size "$MICRO_BATCH_SIZE" --bf16
      --dmd2-critic-steps-per-rollout "$CRITIC_STEPS" "${GRID[@]}"
      --dmd2-teacher-guidance-scale "$GUIDANCE" --gpu-memory-gb "${GPU_MEMORY_GB:-${GPU_MEMORY_GIB:-80}}"
      --world-size "$((SLURM_NNODES * GPUS_PER_NODE))" --gpus-per-node "$GPUS_PER_NODE" --search "${CAUSAL[@]}")
plan_failed() {
    echo "error: the memory planner launch/plan_memory.py failed (exit $1), so there is no layout to launch:" >&2
    { printf '  '; printf '%q ' "${PLAN[@]}" "${@:2}"; echo; } >&2
    exit 3
}
echo "# memory plan (launch/plan_memory.py --search):"
PLAN_TABLE=$("${PLAN[@]}") || plan_failed $?
echo "$PLAN_TABLE"
PLAN_LINE=$("${PLAN[@]}" --emit-flags) || plan_failed $? --emit-flags
if [[ -z "${PLAN_LINE//[[:space:]]/}" || "$PLAN_LINE" == *$'\n'* ]]; then
    echo "error: launch/plan_memory.py --emit-flags should print one line of trainer flags, it printed:" >&2
    echo "$PLAN_LINE" >&2
    exit 3
fi
read -r -a PLAN_FLAGS <<< "$PLAN_LINE"
echo "# layout: ${PLAN_FLAGS[*]}"

DISTRIBUTED_ARGS=(
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(  # a converted checkpoint folder is a --model-size: its config.json is the spec
    --model-size "$TEACHER" --attention-backend "${ATTENTION_BACKEND:-sdpa}" --transformer-impl local "${CAUSAL[@]}"
)
MODEL_PARALLEL_ARGS=("${PLAN_FLAGS[@]}")
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" ${GLOBAL_BATCH_SIZE:+--global-batch-size "$GLOBAL_BATCH_SIZE"}
    --train-iters "${TRAIN_ITERS:-3000}" --lr "${LR:-2e-6}" --lr-decay-style constant
    --weight-decay 0.0 --clip-grad 1.0 --bf16 --timestep-shift "${TIMESTEP_SHIFT:-3}"
)
# the student and the critic start from the teacher unless STUDENT_LOAD is set; which roles sleep
# between phases (--offload-roles ROLE[,ROLE], --offload-inactive or --no-offload-inactive) is part of the
# planner's layout
DMD2_ARGS=(
    "${METHOD[@]}" --teacher-load "$TEACHER" ${STUDENT_LOAD:+--student-load "$STUDENT_LOAD"}
    ${CRITIC_LR:+--critic-lr "$CRITIC_LR"} "${GRID[@]}" --dmd2-critic-steps-per-rollout "$CRITIC_STEPS"
    --dmd2-teacher-guidance-scale "$GUIDANCE" --dmd2-critic-scoring shared
    --ema-decay "${EMA_DECAY:-0.99}"
)
DATA_ARGS=(
    --data "$DATA_PATH"
)
CHECKPOINT_ARGS=(
    --save "${SAVE:-ckpt/$RUN_NAME}" --load "${SAVE:-ckpt/$RUN_NAME}" --save-interval "${SAVE_INTERVAL:-200}"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 10 --tensorboard-dir "${TENSORBOARD_DIR:-tb/$RUN_NAME}"
)
if [[ -n "${VAE:-}" || -n "${EVAL_PROMPTS:-}" ]]; then  # the eval: the EMA student's samples, decoded to media
    EVAL_AND_LOGGING_ARGS+=(--eval-interval "${EVAL_INTERVAL:-500}" --eval-num-samples "${EVAL_NUM_SAMPLES:-16}")
    if [[ -n "${VAE:-}" ]]; then EVAL_AND_LOGGING_ARGS+=(--vae "$VAE"); fi
    if [[ -n "${EVAL_PROMPTS:-}" ]]; then EVAL_AND_LOGGING_ARGS+=(--eval-prompts "$EVAL_PROMPTS"); fi
fi
# shellcheck disable=SC2206  # EXTRA_ARGS (and GLOBAL_BATCH_SIZE, CRITIC_LR above) are split on purpose
EXTRA=(${EXTRA_ARGS:-})
SCRIPT_ARGS=("${MODEL_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DMD2_ARGS[@]}" "${DATA_ARGS[@]}"
             "${CHECKPOINT_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${EXTRA[@]}")
# Each node's task reads its own SLURM_NODEID, hence the single-quoted bash -c.
NODE_CMD='exec "$0" --node-rank "$SLURM_NODEID" "$@"'
# SLURM >= 22.05 no longer passes the allocation's --cpus-per-task on to srun: pass it explicitly.
SRUN=(srun --nodes "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1
      --cpus-per-task "${SLURM_CPUS_PER_TASK:-$(nproc)}" --chdir "$REPO"
      bash -c "$NODE_CMD" "$TORCHRUN" "${DISTRIBUTED_ARGS[@]}" launch/pretrain_dmd2.py "${SCRIPT_ARGS[@]}")

if [[ "$DRY_RUN" == 1 ]]; then
    echo "# MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT nodes=$SLURM_NNODES gpus/node=$GPUS_PER_NODE"
    echo "# srun:"
    printf '%q ' "${SRUN[@]}"; echo
    for ((node = 0; node < SLURM_NNODES; node++)); do
        echo "# node $node runs:"
        printf '%q ' "$TORCHRUN" --node-rank "$node" "${DISTRIBUTED_ARGS[@]}" launch/pretrain_dmd2.py "${SCRIPT_ARGS[@]}"
        echo
    done
    exit 0
fi
exec "${SRUN[@]}"
