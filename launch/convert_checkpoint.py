#!/usr/bin/env python
"""Convert between public checkpoints (diffusers folders, official SiT / DiT .pt files) and dmd2-mega (Megatron-layout)
checkpoints.

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
experts, switched at the boundary, `dmd2_mega/models/wan/experts.py`) and exports back to transformer/ and
transformer_2/.

    # class-conditional image teachers (the DiT family), any TP
    python launch/convert_checkpoint.py --from-official SiT-XL-2-256x256.pt --parameterization sit \
        --save ckpt/sit_xl2 --tensor-model-parallel-size 2
    python launch/convert_checkpoint.py --from-official DiT-XL-2-256x256.pt --parameterization vp-eps --save ckpt/dit
    python launch/convert_checkpoint.py --from-diffusers /models/DiT-XL-2-256 --save ckpt/dit_xl2   # vp-eps
    python launch/convert_checkpoint.py --load runs/student --to-official export/student.pt   # back to its layout

    # a LoRA student (--student-lora-rank: adapters over the teacher's weights) -> full weights at TP=1
    python launch/convert_checkpoint.py --load runs/lora_student --merge-lora --save runs/student_merged
    # ... or its adapters alone, for WanPipeline.load_lora_weights on the base pipeline (--to-diffusers alone: merged)
    python launch/convert_checkpoint.py --load runs/lora_student --to-diffusers export/student_lora --lora-only

A --save that already holds checkpoints (another conversion, a training run) is refused unless --overwrite-save,
which replaces it (logged; the old folder is removed only once the new checkpoint is in place). A causal student
(--causal, e.g. Self-Forcing) is not exported: diffusers has no causal mode, and WanPipeline would run it with full
attention. Sample it with launch/sample.py --stream, or give --allow-bidirectional-export to write it anyway, its
chunking in transformer/config.json (`_dmd2_causal`) and a README that says how WanPipeline runs it.
The model (and the latent shape and classes it was trained on) comes from the tensors' shapes or config.json, the
parameterisation from --parameterization (official files: sit = SiT's interpolant, vp-eps = DiT's DDPM epsilon on
its linear betas; a diffusers DiT pipeline's scheduler_config.json fixes its schedule). Every role built from the
checkpoint wraps the network in that parameterisation's adapter (dmd2_mega/models/dit/parameterization.py).
A DiT exports to the layout it came from (--to-official / --to-diffusers); the other cannot hold its timestep
embedding. Nothing is downloaded; a bad folder or flag exits 1 with one line naming the file or flag, and nothing
is written.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.errors import ConfigError  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.pretrained import (  # noqa: E402
    export_diffusers, export_diffusers_lora, export_official, import_diffusers, import_dit, merge_lora_checkpoint)
from dmd2_mega.train.resilience import run_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("diffusers -> ours")
    src.add_argument("--from-diffusers", metavar="DIR", help="a diffusers model folder or pipeline folder")
    src.add_argument("--subfolder", default=None,
                     help="the model folder inside a pipeline folder (default transformer/, or both experts of a Wan "
                          "2.2 A14B pipeline; transformer_2 picks the low-noise expert alone)")
    src.add_argument("--from-official", metavar="FILE",
                     help="an official SiT / DiT state dict (.pt; a training checkpoint's EMA weights are read)")
    src.add_argument("--parameterization", choices=["sit", "vp-eps"], default=None,
                     help="what an official file's network predicts: sit (SiT: x_t = t x0 + (1 - t) eps, predicts "
                          "x0 - eps) or vp-eps (DiT: DDPM epsilon, linear betas 1e-4..0.02 over 1000 steps); required "
                          "with --from-official, optional with a diffusers DiT (default vp-eps)")
    src.add_argument("--num-heads", type=int, default=None,
                     help="--from-official: attention heads (default: from the published sizes S / B / L / XL)")
    src.add_argument("--save", metavar="DIR", help="the checkpoint directory to write")
    src.add_argument("--overwrite-save", action="store_true",
                     help="replace the checkpoints --save already holds (default: refused; logged when used)")
    src.add_argument("--tensor-model-parallel-size", type=int, default=1)
    dst = p.add_argument_group("ours -> diffusers")
    dst.add_argument("--load", metavar="DIR", help="one of our checkpoints (teacher or DMD2 student)")
    dst.add_argument("--to-diffusers", metavar="DIR", help="the folder to write")
    dst.add_argument("--to-official", metavar="FILE", help="a DiT imported from an official .pt: the .pt to write")
    dst.add_argument("--no-ema", action="store_true", help="export the student's raw weights, not its EMA")
    dst.add_argument("--lora-only", action="store_true",
                     help="--to-diffusers of a LoRA student: the adapters as a diffusers LoRA file "
                          "(WanPipeline.load_lora_weights), not the merged transformer")
    dst.add_argument("--merge-lora", action="store_true",
                     help="a LoRA student (--student-lora-rank) -> a full-weight checkpoint in --save (TP=1)")
    dst.add_argument("--allow-bidirectional-export", action="store_true",
                     help="export a causal student anyway: diffusers runs it with full attention, not as trained "
                          "(its chunking recorded in transformer/config.json and the README; default: refused)")
    return p.parse_args(argv)


def main(a: argparse.Namespace) -> None:
    sources = [f for f in (a.from_diffusers, a.from_official, a.load) if f]
    if len(sources) != 1:
        raise ConfigError("give one of --from-diffusers DIR / --from-official FILE (with --save DIR), or --load DIR "
                          "(with --to-diffusers DIR or --to-official FILE)")
    check_outputs_apart([("--save", a.save), ("--to-diffusers", a.to_diffusers), ("--to-official", a.to_official)],
                        [("--from-diffusers", a.from_diffusers), ("--from-official", a.from_official), ("--load", a.load)])
    if a.num_heads is not None and a.num_heads < 1:
        raise ConfigError(f"--num-heads must be >= 1, got {a.num_heads}")
    if a.overwrite_save and not a.save:
        raise ConfigError("--overwrite-save replaces what --save holds; it goes with --save DIR (an export, "
                          "--to-diffusers / --to-official, is never written over)")
    if a.allow_bidirectional_export and not (a.load and (a.to_diffusers or a.to_official)):
        raise ConfigError("--allow-bidirectional-export goes with --load DIR --to-diffusers DIR (the export of a "
                          "causal student)")
    if a.from_diffusers or a.from_official:
        if not a.save:
            raise ConfigError(f"{'--from-diffusers' if a.from_diffusers else '--from-official'} needs --save DIR "
                              f"(the checkpoint to write)")
        if a.tensor_model_parallel_size < 1:
            raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {a.tensor_model_parallel_size}")
        if a.from_official:
            if a.parameterization is None:
                raise ConfigError("--from-official needs --parameterization sit (a SiT checkpoint) or vp-eps (DiT)")
            import_dit(a.from_official, a.save, a.tensor_model_parallel_size, a.parameterization, a.num_heads,
                       overwrite=a.overwrite_save)
        elif a.parameterization is not None:
            import_dit(a.from_diffusers, a.save, a.tensor_model_parallel_size, a.parameterization,
                       overwrite=a.overwrite_save)
        else:
            import_diffusers(a.from_diffusers, a.save, a.tensor_model_parallel_size, a.subfolder,
                             overwrite=a.overwrite_save)
    elif a.merge_lora:
        if not a.save or a.to_diffusers or a.to_official:
            raise ConfigError("--merge-lora writes a checkpoint: give --load DIR --merge-lora --save DIR")
        merge_lora_checkpoint(a.load, a.save, overwrite=a.overwrite_save)
    else:
        if bool(a.to_diffusers) == bool(a.to_official):
            raise ConfigError("--load needs one of --to-diffusers DIR / --to-official FILE (what to write)")
        if a.save:
            raise ConfigError(f"--save {a.save} is what a conversion or --merge-lora writes; an export writes "
                              f"{'--to-diffusers' if a.to_diffusers else '--to-official'} only: drop --save")
        if a.lora_only and not a.to_diffusers:
            raise ConfigError("--lora-only goes with --to-diffusers DIR (a diffusers LoRA file)")
        allow = a.allow_bidirectional_export
        if a.to_official:
            export_official(a.load, a.to_official, ema=not a.no_ema, allow_bidirectional=allow)
        elif a.lora_only:
            export_diffusers_lora(a.load, a.to_diffusers, ema=not a.no_ema, allow_bidirectional=allow)
        else:
            export_diffusers(a.load, a.to_diffusers, ema=not a.no_ema, allow_bidirectional=allow)


if __name__ == "__main__":
    args = parse_args()
    sys.exit(run_main(lambda: main(args)))
