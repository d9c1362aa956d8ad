#!/usr/bin/env python
"""Initialise a causal (streaming) student from its teacher's ODE trajectories (issue 29; docs/causal.md).

    python launch/prepare_trajectories.py --teacher-load runs/teacher --data moving-digits:12 --out runs/paths
    torchrun --nproc-per-node 2 launch/pretrain_causal_init.py --model-size wan-digits --causal \\
        --causal-chunk-frames 3 --teacher-load runs/teacher --data runs/paths --micro-batch-size 16 \\
        --global-batch-size 32 --lr 1e-4 --train-iters 2000 --save runs/causal_init

The student is the teacher's model made causal (--causal, --causal-chunk-frames, --causal-local-attn-chunks,
--causal-sink-chunks) with the teacher's weights; each chunk of each path is put at its own level of the student
grid and the student regresses the teacher's x0 (`methods/causal_init/method.py`). The run's student grid
(--dmd2-denoising-steps / --dmd2-student-sigmas, --timestep-shift) must be the one the trajectories were stored at
(a ConfigError names both otherwise). Runs
at any TP x CP x DP with the shared student trainer: its checkpoints (--save, --load resumes exactly), log,
EMA and eval; the checkpoint is a student that `launch/sample.py --stream` streams and later methods load.
A bad flag or file exits 1 with one line `<ErrorType>: <message>`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.arguments import parse_dmd2_args  # noqa: E402
from dmd2_mega.methods.causal_init.method import CausalInitMethod  # noqa: E402
from dmd2_mega.methods.trainer import StudentTrainer  # noqa: E402
from dmd2_mega.train.resilience import run_training  # noqa: E402


def main(argv=None) -> int:
    """0 on success and on a preemption exit; 1 with a one-line message for a bad flag, file or value."""
    return run_training(lambda: parse_dmd2_args(argv, CausalInitMethod.unread, "launch/pretrain_causal_init.py"),
                        lambda cfg: StudentTrainer(cfg, CausalInitMethod))


if __name__ == "__main__":
    sys.exit(main())
