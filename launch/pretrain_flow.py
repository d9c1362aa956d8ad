#!/usr/bin/env python
"""Pretrain the flow-matching DiT teacher.

    torchrun --nproc-per-node 8 launch/pretrain_flow.py --model-size 600m --data /path/to/shards \
        --tensor-model-parallel-size 2 --micro-batch-size 32 --global-batch-size 1024 \
        --train-iters 100000 --lr 1e-4 --save ckpt/teacher --load ckpt/teacher --save-interval 1000
    # CPU, digits (what launch/quickstart.sh runs):
    python launch/pretrain_flow.py --model-size digits --data digits --train-iters 1500 ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.arguments import parse_flow_args  # noqa: E402
from dmd2_mega.train.resilience import run_training  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402


def main(argv=None) -> int:
    """0 on success and on a preemption exit; 1 with a one-line message for a bad flag, file or value;
    130 on Ctrl-C (without --exit-signal-handler) with a line naming the last complete checkpoint."""
    return run_training(lambda: parse_flow_args(argv), FlowTrainer)


if __name__ == "__main__":
    sys.exit(main())
