#!/usr/bin/env python
"""Size a DMD2 job before submitting it: per-rank bytes of each role and of each phase.

    python launch/plan_memory.py --model-size 8b --tensor-model-parallel-size 8 --data-parallel-size 16 \
        --micro-batch-size 4 --bf16 --dmd2-critic-steps-per-rollout 5 --dmd2-denoising-steps 4 \
        --image-size 32 --in-channels 4 --patch 2 --num-classes 1000 --recompute-granularity full
    # Wan (a registered size, or a diffusers config.json / model folder): video latents [C, T, H, W], text
    python launch/plan_memory.py --model-size wan2.1-14b --latent-shape 16 21 60 104 --text-len 512 \
        --tensor-model-parallel-size 4 --context-parallel-size 2 --sequence-parallel --micro-batch-size 1 --bf16
    # pick the layout: the smallest TP x CP (then no recompute, then the least offload) that fits 80 GB GPUs
    python launch/plan_memory.py --model-size wan2.1-14b --latent-shape 16 21 60 104 --text-len 512 \
        --micro-batch-size 1 --bf16 --world-size 64 --gpus-per-node 8 --search [--emit-flags]

Prints, per rank (one GPU): each role's parameters, gradients, fp32 master gradients (--bf16, alive
during the optimizer step), optimizer state (fp32 masters under --bf16 + AdamW moments + step
counters) and DDP gradient buckets (DP > 1); then each phase (rollout / critic / actor) with
time-slicing (--offload-inactive: roles the phase does not use sleep) and with every role resident,
plus an activation estimate; and the peak against --gpu-memory-gb. The maths is in
dmd2_mega/plan/memory_plan.py. Parameters, gradients and optimizer state are exact (checked against
built models in tests/test_plan_memory.py); activations are an estimate (see that module), divided
by --context-parallel-size and --sequence-parallel where they split the tokens (Wan).
--search tries every layout of --world-size GPUs (TP inside a node, CP, DP, recompute, offload), prints
them best first and the chosen one's phases; --emit-flags prints only the chosen layout's trainer flags
(what the SLURM recipes read).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "TE / Apex not installed": moot here

from dmd2_mega.plan import memory_plan as mp  # noqa: E402
from dmd2_mega.errors import ConfigError  # noqa: E402
from dmd2_mega.models.registry import MODEL_SIZES, get_size  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B" if n else "0"


def fmt_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return str(int(n))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="8b",
                   help=f"one of {', '.join(sorted(MODEL_SIZES))}, or a diffusers config.json / model folder")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=4, help="B per DP rank")
    p.add_argument("--bf16", action="store_true", help="bf16 weights/compute, fp32 masters and Adam state")
    p.add_argument("--recompute-granularity", default=None, choices=["full"])
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="fp32 masters and Adam state sharded over DP x CP (dmd2_mega/train/dist_optim.py)")
    p.add_argument("--context-parallel-size", type=int, default=1, help="CP: ranks splitting each sample's tokens")
    p.add_argument("--sequence-parallel", action="store_true", help="shard the non-matmul regions over TP too")
    p.add_argument("--attention-kernel", default="fused", choices=["fused", "math"],
                   help="fused: flash-attn or SDPA's flash / memory-efficient kernels (log-sum-exp only); math: "
                        "SDPA's fallback, which keeps the S x S probabilities (Wan)")
    p.add_argument("--world-size", type=int, default=None, help="GPUs of the job, for --search")
    p.add_argument("--gpus-per-node", type=int, default=8, help="TP stays inside a node (--search)")
    p.add_argument("--search", action="store_true", help="try every layout of --world-size GPUs; print the best")
    p.add_argument("--emit-flags", action="store_true", help="with --search: print only the chosen trainer flags")
    p.add_argument("--dmd2-critic-steps-per-rollout", type=int, default=5, help="K")
    p.add_argument("--dmd2-denoising-steps", type=int, default=4, help="N")
    p.add_argument("--dmd2-teacher-guidance-scale", type=float, default=1.0, help="> 1 doubles the teacher batch")
    p.add_argument("--latent-shape", type=int, nargs="+", default=None, metavar="N",
                   help="latents C T H W (video, Wan) or C H W; instead of --in-channels / --image-size")
    p.add_argument("--text-len", type=int, default=None, help="Wan: text tokens L of the embeddings (default 512)")
    p.add_argument("--image-size", type=int, default=32, help="latent side H (= W)")
    p.add_argument("--in-channels", type=int, default=4)
    p.add_argument("--patch", type=int, default=None, help="default: the size's patch")
    p.add_argument("--num-classes", type=int, default=1000, help="class-conditional (default)")
    p.add_argument("--cond-shape", type=int, nargs="+", default=None, help="text embeddings [L, D] instead")
    p.add_argument("--gpu-memory-gb", "--gpu-memory-gib", dest="gpu_memory_gb", type=float, default=80.0,
                   help="GiB of memory of one GPU, for the verdict (the trainer's --gpu-memory-gb; --gpu-memory-gib is "
                        "its old name here, still accepted)")
    a = p.parse_args(argv)
    check_args(a)
    return a


def check_args(a: argparse.Namespace) -> None:
    """ConfigError naming the first flag out of range (counts and sizes >= 1, guidance >= 1, memory > 0)."""
    for flag in ("tensor_model_parallel_size", "data_parallel_size", "micro_batch_size",
                 "dmd2_critic_steps_per_rollout", "dmd2_denoising_steps", "image_size", "in_channels",
                 "num_classes", "patch", "text_len", "context_parallel_size", "world_size", "gpus_per_node"):
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if a.latent_shape is not None and (len(a.latent_shape) not in (3, 4) or min(a.latent_shape) < 1):
        raise ConfigError(f"--latent-shape must be C T H W or C H W with sizes >= 1, got "
                          f"{' '.join(map(str, a.latent_shape))}")
    if a.cond_shape is not None and (len(a.cond_shape) not in (1, 2) or min(a.cond_shape) < 1):
        raise ConfigError(f"--cond-shape must be D or L D with sizes >= 1, got {' '.join(map(str, a.cond_shape))}")
    g = a.dmd2_teacher_guidance_scale
    if not (math.isfinite(g) and g >= 1):
        raise ConfigError(f"--dmd2-teacher-guidance-scale must be a finite number >= 1, got {g}")
    if not (math.isfinite(a.gpu_memory_gb) and a.gpu_memory_gb > 0):
        raise ConfigError(f"--gpu-memory-gb must be a finite number > 0, got {a.gpu_memory_gb}")
    if a.search and a.world_size is None:
        raise ConfigError("--search needs --world-size (the job's GPUs)")
    if a.emit_flags and not a.search:
        raise ConfigError("--emit-flags prints the layout --search chose; add --search")
    if a.sequence_parallel and a.tensor_model_parallel_size == 1 and not a.search:
        raise ConfigError("--sequence-parallel shards inside the TP group; it needs --tensor-model-parallel-size > 1")


def main(argv=None) -> int:
    """0 after printing the plan; 1 with a one-line `ConfigError: ...` for a bad flag or, with --search, when no
    layout fits."""
    def go():
        a = parse_args(argv)
        (search if a.search else plan)(a)
    return run_main(go)


def shape_from_args(a: argparse.Namespace) -> mp.ModelShape:
    """The model and data shape the flags describe, as the model's family reads them (`ModelFamily.plan_data`: e.g.
    Wan --latent-shape and --text-len, the DiT --latent-shape or --in-channels / --image-size, and --num-classes or
    --cond-shape)."""
    size = get_size(a.model_size)  # ConfigError for an unknown name or a folder no family recognises
    shape = size.family.plan_data(size.spec, a.model_size, latent_shape=a.latent_shape, in_channels=a.in_channels,
                                  image_size=a.image_size, num_classes=a.num_classes, cond_shape=a.cond_shape,
                                  text_len=a.text_len)
    return mp.model_shape(a.model_size, shape.in_channels, shape.spatial, a.patch, num_classes=shape.num_classes,
                          cond_shape=shape.cond_shape)


def describe_model(name: str, ms: mp.ModelShape) -> str:
    latents = "x".join(map(str, (ms.in_channels, *ms.spatial)))
    return ms.family.describe(name, ms.spec, latents, ms.tokens, ms.text_len)


def search(a: argparse.Namespace) -> None:
    """--search: every layout of --world-size GPUs, best first, then the chosen one's plan (or, with --emit-flags,
    only its trainer flags). ConfigError when none fits."""
    ms = shape_from_args(a)
    budget = mp.PLAN_HEADROOM * a.gpu_memory_gb * 2 ** 30
    found = mp.search_layouts(ms, world=a.world_size, gpus_per_node=a.gpus_per_node, budget=budget,
                              micro=a.micro_batch_size, steps=a.dmd2_critic_steps_per_rollout,
                              denoise=a.dmd2_denoising_steps, bf16=a.bf16, guidance=a.dmd2_teacher_guidance_scale,
                              scores=a.attention_kernel == "math")
    best, plan_, _, fits = found[0]
    if not fits:
        raise ConfigError(f"no layout of {a.world_size} GPUs fits {a.gpu_memory_gb:g} GiB per GPU for "
                          f"--model-size {a.model_size} at --micro-batch-size {a.micro_batch_size}: the smallest "
                          f"peak is {fmt_bytes(min(max(f[2].values()) for f in found))} ({found[0][0].describe()})")
    if a.emit_flags:
        print(" ".join(best.flags()))
        return
    print(describe_model(a.model_size, ms))
    print(f"layouts of {a.world_size} GPUs ({a.gpus_per_node} per node), best first; peak per GPU against "
          f"{mp.PLAN_HEADROOM:g} x {a.gpu_memory_gb:g} GiB:")
    rows = [[f[0].describe(), fmt_bytes(max(f[2].values())), "fits" if f[3] else "no"] for f in found[:12]]
    print(mp.format_table(["layout", "peak", "fits"], rows, left=3))
    if len(found) > 12:
        print(f"... and {len(found) - 12} more")
    print(f"\nchosen: {best.describe()}\n  flags: {' '.join(best.flags())}\n")
    a.tensor_model_parallel_size, a.context_parallel_size, a.data_parallel_size = best.tp, best.cp, best.dp
    a.sequence_parallel, a.use_distributed_optimizer = best.sp, best.dist_opt
    a.recompute_granularity = "full" if best.recompute else None
    plan(a)


def plan(a: argparse.Namespace) -> None:
    ms = shape_from_args(a)
    tp, dp, cp, sp = a.tensor_model_parallel_size, a.data_parallel_size, a.context_parallel_size, a.sequence_parallel
    per_rank = mp.params_per_rank(ms, tp)  # ConfigError unless TP divides the heads
    if cp > 1 and ms.spec.num_heads % (tp * cp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} must divide the "
                          f"{ms.spec.num_heads} heads")
    counts = mp.param_counts(ms)
    total = counts["sharded"] + counts["replicated"]
    k, n, b = a.dmd2_critic_steps_per_rollout, a.dmd2_denoising_steps, a.micro_batch_size
    recompute = a.recompute_granularity == "full"
    plan = mp.plan_cycle(ms, tp=tp, dp=dp, micro=b, steps=k, denoise=n, bf16=a.bf16, recompute=recompute,
                         guidance=a.dmd2_teacher_guidance_scale, dist_opt=a.use_distributed_optimizer, cp=cp, sp=sp,
                         scores=a.attention_kernel == "math")
    print(describe_model(a.model_size, ms))
    layout = (f"CP={cp} " if cp > 1 else "") + f"DP={dp}" + (" SP" if sp else "")
    print(f"parameters {fmt_count(total)} in all, {fmt_count(per_rank)} per rank at TP={tp} "
          f"({fmt_count(counts['replicated'])} replicated); {layout} ({tp * cp * dp} GPUs); B={b} per DP rank, "
          f"K={k}, N={n}; {'bf16 + fp32 masters' if a.bf16 else 'fp32'}"
          f"{'; optimizer state sharded over DP x CP' if a.use_distributed_optimizer else ''}; "
          f"recompute {a.recompute_granularity or 'none'}; teacher guidance {a.dmd2_teacher_guidance_scale}")
    print(f"forward {mp.forward_flops(ms, 1, tp) / cp / 1e12:.4g} TFLOP per sample per rank (matmuls, attention "
          f"included)")
    print("\nper-rank bytes of each role (AdamW):")
    kinds = ["weights", "grads", "optimizer"]
    head = ["role", "parameters", "fp32 gradients", "optimizer state", "total"]
    print(mp.format_table(head,
                [[r] + [fmt_bytes(v[k_]) for k_ in kinds] + [fmt_bytes(sum(v.values()))]
                 for r, v in plan.roles.items()]))
    print("\nper-rank bytes resident in each phase (a time-sliced role sleeps whole, grad buffer included):")
    rows = []
    for phase in mp.PHASES:
        for sliced in (True, False):
            row = plan.phases[(phase, sliced)]
            rows.append([phase, "time-sliced" if sliced else "all resident"]
                        + [fmt_bytes(row[c]) for c in ("student", "critic", "teacher", "activations", "total")])
    head = ["phase", "mode", "student", "critic", "teacher", "activations (est.)", "total"]
    print(mp.format_table(head, rows, left=2))
    budget = a.gpu_memory_gb * 2 ** 30
    print()
    for sliced in (True, False):
        phase, peak = mp.peak(plan, sliced)
        verdict = "fits" if peak <= 0.9 * budget else ("tight (> 90%)" if peak <= budget else "does NOT fit")
        print(f"peak {'time-sliced ' if sliced else 'all resident'}: {fmt_bytes(peak)} ({phase} phase) -> "
              f"{verdict} in {a.gpu_memory_gb:g} GiB")
    roles, totals, fits = mp.choose_offload(plan, mp.PLAN_HEADROOM * budget)
    print(f"default offload of pretrain_dmd2.py on CUDA with --gpu-memory-gb {a.gpu_memory_gb:g}: "
          f"{'+'.join(sorted(roles)) or 'none'} -> peak {fmt_bytes(max(totals.values()))}"
          + ("" if fits else f" (over {mp.PLAN_HEADROOM:g} x the budget even so)"))


if __name__ == "__main__":
    sys.exit(main())
