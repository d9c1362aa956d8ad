#!/usr/bin/env python
"""Convert between diffusers folders and dmd2-mega (Megatron-layout) checkpoints.

    # a diffusers WanTransformer3DModel folder (or a pipeline folder with transformer/) -> a teacher at TP=2
    python launch/convert_checkpoint.py --from-diffusers /models/Wan2.1-T2V-1.3B-Diffusers \
        --save ckpt/wan13b_tp2 --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 launch/pretrain_dmd2.py --model-size ckpt/wan13b_tp2 \
        --teacher-load ckpt/wan13b_tp2 --tensor-model-parallel-size 2 ...

    # any of our Wan checkpoints (any TP; a student's EMA unless --no-ema) -> diffusers
    python launch/convert_checkpoint.py --load runs/student --to-diffusers export/student

The export writes export/student/transformer/ (WanTransformer3DModel.from_pretrained(..., subfolder=
"transformer")), export/student/scheduler/scheduler_config.json (the student's few-step sigmas) and
export/student/README.md (running it in WanPipeline). A Wan 2.2 A14B pipeline folder (model_index.json with
boundary_ratio, transformer/ and transformer_2/) converts to ONE two-expert checkpoint (the high- and low-noise
experts, switched at the boundary, `dmd2_mega/models/wan_experts.py`) and exports back to transformer/ and
transformer_2/. Nothing is downloaded; a bad folder or flag exits 1 with one line naming the file or flag,
and nothing is written.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.errors import ConfigError  # noqa: E402
from dmd2_mega.pretrained import export_diffusers, import_diffusers  # noqa: E402
from dmd2_mega.resilience import run_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("diffusers -> ours")
    src.add_argument("--from-diffusers", metavar="DIR", help="a diffusers model folder or pipeline folder")
    src.add_argument("--subfolder", default=None,
                     help="the model folder inside a pipeline folder (default transformer/, or both experts of a Wan "
                          "2.2 A14B pipeline; transformer_2 picks the low-noise expert alone)")
    src.add_argument("--save", metavar="DIR", help="the checkpoint directory to write")
    src.add_argument("--tensor-model-parallel-size", type=int, default=1)
    dst = p.add_argument_group("ours -> diffusers")
    dst.add_argument("--load", metavar="DIR", help="one of our checkpoints (teacher or DMD2 student)")
    dst.add_argument("--to-diffusers", metavar="DIR", help="the folder to write")
    dst.add_argument("--no-ema", action="store_true", help="export the student's raw weights, not its EMA")
    return p.parse_args(argv)


def main(a: argparse.Namespace) -> None:
    if bool(a.from_diffusers) == bool(a.load):
        raise ConfigError("give either --from-diffusers DIR --save DIR, or --load DIR --to-diffusers DIR")
    if a.from_diffusers:
        if not a.save:
            raise ConfigError("--from-diffusers needs --save DIR (the checkpoint to write)")
        if a.tensor_model_parallel_size < 1:
            raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {a.tensor_model_parallel_size}")
        import_diffusers(a.from_diffusers, a.save, a.tensor_model_parallel_size, a.subfolder)
    else:
        if not a.to_diffusers:
            raise ConfigError("--load needs --to-diffusers DIR (the folder to write)")
        export_diffusers(a.load, a.to_diffusers, ema=not a.no_ema)


if __name__ == "__main__":
    args = parse_args()
    sys.exit(run_main(lambda: main(args)))
