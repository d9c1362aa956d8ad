#!/usr/bin/env python
"""DMD2 distillation of a trained flow-matching teacher into an N-step student.

    torchrun --nproc-per-node 8 launch/pretrain_dmd2.py --model-size 600m --data /data/latents \
        --teacher-load ckpt/teacher --tensor-model-parallel-size 2 --micro-batch-size 8 \
        --dmd2-denoising-steps 4 --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 1.75 \
        --lr 2e-6 --train-iters 20000 --save ckpt/student --load ckpt/student --save-interval 500
    # CPU, digits (what launch/quickstart.sh runs):
    python launch/pretrain_dmd2.py --model-size digits --teacher-load runs/quickstart/teacher ...
The critic is saved beside the student, in <save>_critic.
--distill-method self-forcing trains a causal student (--causal ...; --student-load its causal init) on its own
autoregressive rollouts with the same critic, teacher and DMD loss (`methods/self_forcing/`, docs/causal.md).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.arguments import parse_dmd2_args  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Method  # noqa: E402
from dmd2_mega.methods.self_forcing.method import SelfForcingMethod  # noqa: E402
from dmd2_mega.methods.trainer import StudentTrainer  # noqa: E402
from dmd2_mega.train.resilience import run_training  # noqa: E402

METHODS = {"dmd2": DMD2Method, "self-forcing": SelfForcingMethod}
"""--distill-method -> the method the shared student trainer runs."""


def main(argv=None) -> int:
    """0 on success and on a preemption exit; 1 with a one-line message for a bad flag, file or value;
    130 on Ctrl-C (without --exit-signal-handler) with a line naming the last complete checkpoint."""
    return run_training(lambda: parse_dmd2_args(argv),
                        lambda cfg: StudentTrainer(cfg, METHODS[cfg.dmd2.distill_method]))


if __name__ == "__main__":
    sys.exit(main())
