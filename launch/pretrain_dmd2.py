#!/usr/bin/env python
"""DMD2 distillation of a trained flow-matching teacher into an N-step student.

    torchrun --nproc-per-node 8 launch/pretrain_dmd2.py --model-size 600m --data /data/latents \
        --teacher-load ckpt/teacher --tensor-model-parallel-size 2 --micro-batch-size 8 \
        --dmd2-denoising-steps 4 --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 1.75 \
        --lr 2e-6 --train-iters 20000 --save ckpt/student --load ckpt/student --save-interval 500
    # CPU, digits (what launch/quickstart.sh runs):
    python launch/pretrain_dmd2.py --model-size digits --teacher-load runs/quickstart/teacher ...
The critic is saved beside the student, in <save>_critic.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.arguments import parse_dmd2_args  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Trainer  # noqa: E402
from dmd2_mega.train.resilience import run_training  # noqa: E402


def main(argv=None) -> int:
    """0 on success and on a preemption exit; 1 with a one-line message for a bad flag, file or value;
    130 on Ctrl-C (without --exit-signal-handler) with a line naming the last complete checkpoint."""
    return run_training(lambda: parse_dmd2_args(argv), DMD2Trainer)


if __name__ == "__main__":
    sys.exit(main())
