"""The layout loop the multi-process scripts share: `--out DIR LAYOUT [LAYOUT ...]`, LAYOUT = name:TP:CP:SP[:more]
(TP x CP divides the world), each run (and each of its variants) in megatron-core groups of its own, built with
seed 11, on the same processes."""
import argparse
from typing import Callable, Iterable

from megatron.core import parallel_state as mpu

from dmd2_mega.config import ParallelConfig
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed


def run_layouts(run: Callable, variants: Iterable = (None,)) -> int:
    """run(ps, name, cp, sp, more (the layout's further fields), variant, out_dir) per layout of argv and variant;
    returns the exit status."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("layouts", nargs="+")
    a = p.parse_args()
    try:
        for layout in a.layouts:
            name, tp, cp, sp, *more = layout.split(":")
            for variant in variants:
                ps = init_distributed(ParallelConfig(int(tp), int(cp), sp == "1"), seed=11)
                run(ps, name, int(cp), sp == "1", more, variant, a.out)
                mpu.destroy_model_parallel()  # the next run builds its own groups on the same processes
    finally:
        destroy_distributed()
    return 0
