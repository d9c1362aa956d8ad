#!/usr/bin/env python
"""Size a DMD2 job before submitting it: per-rank bytes of each role and of each phase.

    python launch/plan_memory.py --model-size 8b --tensor-model-parallel-size 8 --data-parallel-size 16 \
        --micro-batch-size 4 --bf16 --dmd2-critic-steps-per-rollout 5 --dmd2-denoising-steps 4 \
        --image-size 32 --in-channels 4 --patch 2 --num-classes 1000 --recompute-granularity full
    # Wan (a registered size, or a diffusers config.json / model folder): video latents [C, T, H, W], text
    python launch/plan_memory.py --model-size wan2.1-14b --latent-shape 16 21 60 104 --text-len 512 \
        --tensor-model-parallel-size 4 --context-parallel-size 2 --sequence-parallel --micro-batch-size 1 --bf16
    # pick the layout: the smallest TP x CP (then the least recompute, then the least offload) that fits 80 GB GPUs
    python launch/plan_memory.py --model-size wan2.1-14b --latent-shape 16 21 60 104 --text-len 512 \
        --micro-batch-size 1 --bf16 --world-size 64 --gpus-per-node 8 --search [--emit-flags]

The flags that describe the run (model, parallel sizes, micro-batch, --bf16, recompute, K, N, guidance, --dmd2-gan and
its head, real rows, fakes, noise and feature layer, --gpu-memory-gb) are launch/pretrain_dmd2.py's own
(`arguments.add_memory_plan_args`: same names, defaults, help and checks); --data-parallel-size, the latent shape,
--attention-kernel and the search are the planner's. Which roles each phase needs is DMD2's phase table
(`methods.dmd2.phases.table`, with the GAN head's part under --dmd2-gan). Without --gpu-memory-gb it plans for 80 GiB
GPUs (the trainer reads its device's).
Prints, per rank (one GPU): each role's parameters (the critic's with the GAN head's under --dmd2-gan, whole on
every rank: `methods.dmd2.gan.head_plan`), gradients, fp32 master gradients (--bf16, alive
during the optimizer step), optimizer state (fp32 masters under --bf16 + AdamW moments + step
counters) and DDP gradient buckets (DP > 1); then each phase (rollout / critic / actor) with
time-slicing (--offload-inactive: roles the phase does not use sleep) and with every role resident,
plus an activation estimate (with the GAN head's real rows, generator term and head: `methods.dmd2.gan.gan_passes`);
the recompute granularity of each phase with grad (critic, actor): without
--recompute-granularity the least recompute whose time-sliced phase fits 0.9 x --gpu-memory-gb, with each
granularity's bytes and extra FLOPs, the most recomputing choice applied to every phase (the trainer runs one) and
its flag; and the peak against --gpu-memory-gb. The maths is in
dmd2_mega/plan/memory_plan.py. Parameters, gradients and optimizer state are exact (checked against
built models in tests/test_plan_memory.py); activations are an estimate (see that module), divided
by --context-parallel-size and --sequence-parallel where they split the tokens (Wan).
--causal (with the trainer's --causal-chunk-frames N, --causal-local-attn-chunks W, --causal-sink-chunks S:
`models/causal.CausalLayout`) plans a causal student's KV cache at the layout planned (or chosen): per layer, per
rank and over the TP x CP ranks, at its peak over the chunks, for streaming generation of --stream-frames F latent
frames (default the data's) and for the training-time rollout (the same stream over the data's frames at the
micro-batch), each with one chunk's no-grad forward (`memory_plan.kv_cache_plan`):
    python launch/plan_memory.py --model-size wan2.1-14b --latent-shape 16 21 60 104 --text-len 512 \
        --micro-batch-size 1 --bf16 --world-size 64 --search --causal --causal-chunk-frames 3 --stream-frames 63
--search tries every layout of --world-size GPUs (TP inside a node, CP, DP, recompute, offload), prints
them best first and the chosen one's phases; --emit-flags prints only the chosen layout's trainer flags
(what the SLURM recipes read), its time-slicing as --offload-roles ROLE[,ROLE] (a planned subset),
--offload-inactive (every role) or --no-offload-inactive (none).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "TE / Apex not installed": moot here

from dmd2_mega.arguments import add_memory_plan_args, memory_plan_configs  # noqa: E402
from dmd2_mega.errors import ConfigError  # noqa: E402
from dmd2_mega.methods.dmd2 import phases as dmd2_phases  # noqa: E402
from dmd2_mega.methods.dmd2.gan import gan_passes, head_plan  # noqa: E402
from dmd2_mega.models.registry import get_size  # noqa: E402
from dmd2_mega.plan import memory_plan as mp  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402

DEFAULT_GPU_MEMORY_GB = 80.0  # without --gpu-memory-gb: an 80 GB GPU (the trainer reads its device's)


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


def parser() -> argparse.ArgumentParser:
    """The trainer's flags that describe the run (`arguments.add_memory_plan_args`), then the planner's own."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_memory_plan_args(p)
    g = p.add_argument_group("planner")
    g.add_argument("--gpu-memory-gib", dest="DMD2Config.gpu_memory_gb", type=float, metavar="GPU_MEMORY_GB",
                   help="the old name of --gpu-memory-gb")
    g.add_argument("--data-parallel-size", type=int, default=1, help="DP: the trainer's is world / (TP x CP)")
    g.add_argument("--attention-kernel", default="fused", choices=["fused", "math"],
                   help="fused: flash-attn or SDPA's flash / memory-efficient kernels (log-sum-exp only); math: "
                        "SDPA's fallback, which keeps the S x S probabilities (Wan)")
    g.add_argument("--world-size", type=int, default=None, help="GPUs of the job, for --search")
    g.add_argument("--gpus-per-node", type=int, default=8, help="TP stays inside a node (--search)")
    g.add_argument("--search", action="store_true", help="try every layout of --world-size GPUs; print the best")
    g.add_argument("--emit-flags", action="store_true", help="with --search: print only the chosen trainer flags")
    g.add_argument("--latent-shape", type=int, nargs="+", default=None, metavar="N",
                   help="latents C T H W (video, Wan) or C H W; instead of --in-channels / --image-size")
    g.add_argument("--text-len", type=int, default=None, help="Wan: text tokens L of the embeddings (default 512)")
    g.add_argument("--image-size", type=int, default=32, help="latent side H (= W)")
    g.add_argument("--in-channels", type=int, default=4)
    g.add_argument("--patch", type=int, default=None, help="default: the size's patch")
    g.add_argument("--num-classes", type=int, default=1000, help="class-conditional (default)")
    g.add_argument("--cond-shape", type=int, nargs="+", default=None, help="text embeddings [L, D] instead")
    g.add_argument("--stream-frames", type=int, default=None, metavar="F",
                   help="with --causal: latent frames of the streamed generation (default: the data's)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The planner's own flags, plus `a.run`: the trainer's flags of the run as its dataclasses (`.model`,
    `.parallel`, `.optim`, `.train`, `.dmd2`, `.gan`; `arguments.memory_plan_configs`), and `a.gpu_memory_gb`
    (--gpu-memory-gb, default `DEFAULT_GPU_MEMORY_GB`). ConfigError naming the first bad flag."""
    a = parser().parse_args(argv)
    check_args(a)
    a.run = memory_plan_configs(a)  # the trainer's checks of its own flags
    a.causal = a.run.model.causal_layout()
    if a.causal is None and a.stream_frames is not None:
        raise ConfigError("--stream-frames: the length of a causal student's streamed generation; add --causal")
    a.gpu_memory_gb = a.run.dmd2.gpu_memory_gb or DEFAULT_GPU_MEMORY_GB
    if a.search and a.world_size is None:
        raise ConfigError("--search needs --world-size (the job's GPUs)")
    if a.emit_flags and not a.search:
        raise ConfigError("--emit-flags prints the layout --search chose; add --search")
    return a


def check_args(a: argparse.Namespace) -> None:
    """ConfigError naming the first of the planner's own flags out of range (counts and sizes >= 1)."""
    for flag in ("data_parallel_size", "image_size", "in_channels", "num_classes", "patch", "text_len", "world_size",
                 "gpus_per_node", "stream_frames"):
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if a.latent_shape is not None and (len(a.latent_shape) not in (3, 4) or min(a.latent_shape) < 1):
        raise ConfigError(f"--latent-shape must be C T H W or C H W with sizes >= 1, got "
                          f"{' '.join(map(str, a.latent_shape))}")
    if a.cond_shape is not None and (len(a.cond_shape) not in (1, 2) or min(a.cond_shape) < 1):
        raise ConfigError(f"--cond-shape must be D or L D with sizes >= 1, got {' '.join(map(str, a.cond_shape))}")


def phase_table(a: argparse.Namespace):
    """DMD2's phase table of the run (with the GAN head's part under --dmd2-gan)."""
    return dmd2_phases.table(a.run.gan.enabled)


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
    name = a.run.model.size
    size = get_size(name)  # ConfigError for an unknown name or a folder no family recognises
    shape = size.family.plan_data(size.spec, name, latent_shape=a.latent_shape, in_channels=a.in_channels,
                                  image_size=a.image_size, num_classes=a.num_classes, cond_shape=a.cond_shape,
                                  text_len=a.text_len)
    return mp.model_shape(name, shape.in_channels, shape.spatial, a.patch, num_classes=shape.num_classes,
                          cond_shape=None if shape.cond_parts else shape.cond_shape, cond_parts=shape.cond_parts)


def describe_model(name: str, ms: mp.ModelShape) -> str:
    latents = "x".join(map(str, (ms.in_channels, *ms.spatial)))
    return ms.family.describe(name, ms.spec, latents, ms.tokens, ms.text_len)


def describe_gan(gan, ms: mp.ModelShape) -> str:
    """The run's GAN head in the plan's first line: what it adds to the critic's role bytes (`gan.head_plan`)."""
    added = head_plan(gan, ms).get("critic")
    return f"GAN head on ({gan.head}, {fmt_count(added[0])} params on the critic)" if added else "GAN head off"


def search(a: argparse.Namespace) -> None:
    """--search: every layout of --world-size GPUs, best first, then the chosen one's plan (or, with --emit-flags,
    only its trainer flags). ConfigError when none fits."""
    ms, run = shape_from_args(a), a.run
    d, b = run.dmd2, run.train.micro_batch_size
    budget = mp.PLAN_HEADROOM * a.gpu_memory_gb * 2 ** 30
    found = mp.search_layouts(ms, phase_table(a), world=a.world_size, gpus_per_node=a.gpus_per_node, budget=budget,
                              micro=b, steps=d.critic_steps_per_rollout, denoise=d.denoising_steps,
                              bf16=run.optim.bf16, guidance=d.teacher_guidance_scale,
                              scores=a.attention_kernel == "math", lora=lora_ranks(run), added=head_plan(run.gan, ms),
                              passes=gan_passes(run.gan, ms, b))
    best, plan_, _, fits = found[0]
    if not fits:
        raise ConfigError(f"no layout of {a.world_size} GPUs fits {a.gpu_memory_gb:g} GiB per GPU for "
                          f"--model-size {run.model.size} at --micro-batch-size {b}: the smallest "
                          f"peak is {fmt_bytes(min(max(f[2].values()) for f in found))} ({found[0][0].describe()})")
    if a.emit_flags:
        print(" ".join(best.flags()))
        return
    print(describe_model(run.model.size, ms))
    print(f"layouts of {a.world_size} GPUs ({a.gpus_per_node} per node), best first; peak per GPU against "
          f"{mp.PLAN_HEADROOM:g} x {a.gpu_memory_gb:g} GiB:")
    rows = [[f[0].describe(), fmt_bytes(max(f[2].values())), "fits" if f[3] else "no"] for f in found[:12]]
    print(mp.format_table(["layout", "peak", "fits"], rows, left=3))
    if len(found) > 12:
        print(f"... and {len(found) - 12} more")
    print(f"\nchosen: {best.describe()}\n  flags: {' '.join(best.flags())}\n")
    a.data_parallel_size = best.dp
    run.parallel = replace(run.parallel, tensor_model_parallel_size=best.tp, context_parallel_size=best.cp,
                           sequence_parallel=best.sp)
    run.optim = replace(run.optim, use_distributed_optimizer=best.dist_opt)
    run.model = replace(run.model, recompute_granularity=best.recompute)
    a.recompute_given = "the layout chosen"
    plan(a)


def lora_ranks(run) -> dict:
    """{role: LoRA rank} of --student-lora-rank / --critic-lora-rank (0: full weights); LoRA roles share the
    teacher's weights, as pretrain_dmd2.py builds them by default."""
    return {"student": run.lora.student_rank, "critic": run.lora.critic_rank}


def role_label(role: str, run) -> str:
    rank = lora_ranks(run).get(role, 0)
    if rank:
        role = f"{role} (LoRA r={rank}, the teacher's weights shared)"
    return f"{role} + GAN head" if role.startswith("critic") and run.gan.enabled else role


def plan(a: argparse.Namespace) -> None:
    ms, run = shape_from_args(a), a.run
    p, d, bf16, dist_opt = run.parallel, run.dmd2, run.optim.bf16, run.optim.use_distributed_optimizer
    tp, dp, cp, sp = p.tensor_model_parallel_size, a.data_parallel_size, p.context_parallel_size, p.sequence_parallel
    per_rank = mp.params_per_rank(ms, tp)  # ConfigError unless TP divides the heads
    if cp > 1 and ms.spec.num_heads % (tp * cp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} must divide the "
                          f"{ms.spec.num_heads} heads")
    b = run.train.micro_batch_size
    kv = None if a.causal is None else (  # its ConfigError (a family or spec with no causal student) before any line
        mp.kv_cache_plan(ms, a.causal, b, tp, bf16, cp, sp, frames=a.stream_frames),
        mp.kv_cache_plan(ms, a.causal, b, tp, bf16, cp, sp))
    counts = mp.param_counts(ms)
    total = counts["sharded"] + counts["replicated"]
    k, n, g = d.critic_steps_per_rollout, d.denoising_steps, d.teacher_guidance_scale
    kw = dict(tp=tp, dp=dp, micro=b, steps=k, denoise=n, bf16=bf16, guidance=g, dist_opt=dist_opt, cp=cp, sp=sp,
              scores=a.attention_kernel == "math", lora=lora_ranks(run), added=head_plan(run.gan, ms),
              passes=gan_passes(run.gan, ms, b))
    forced = run.model.recompute_granularity
    options = mp.recompute_options(ms, phase_table(a), mp.PLAN_HEADROOM * a.gpu_memory_gb * 2 ** 30,
                                   scoring=d.critic_scoring, **kw)
    chosen = mp.choose_recompute(options, forced)
    recompute = mp.applied_recompute(chosen)
    plan = mp.plan_cycle(ms, phase_table(a), recompute=recompute, **kw)
    print(describe_model(run.model.size, ms))
    layout = (f"CP={cp} " if cp > 1 else "") + f"DP={dp}" + (" SP" if sp else "")
    print(f"parameters {fmt_count(total)} in all, {fmt_count(per_rank)} per rank at TP={tp} "
          f"({fmt_count(counts['replicated'])} replicated); {layout} ({tp * cp * dp} GPUs); B={b} per DP rank, "
          f"K={k}, N={n}; {'bf16 + fp32 masters' if bf16 else 'fp32'}"
          f"{'; optimizer state sharded over DP x CP' if dist_opt else ''}; "
          f"recompute {recompute} ({recompute_given(a) if forced else 'chosen per phase, below'}); "
          f"teacher guidance {g}; {describe_gan(run.gan, ms)}")
    print(f"forward {mp.forward_flops(ms, 1, tp) / cp / 1e12:.4g} TFLOP per sample per rank (matmuls, attention "
          f"included)")
    print("\nper-rank bytes of each role (AdamW):")
    kinds = ["weights", "grads", "optimizer"]
    head = ["role", "parameters", "fp32 gradients", "optimizer state", "total"]
    print(mp.format_table(head,
                [[role_label(r, run)] + [fmt_bytes(v[k_]) for k_ in kinds] + [fmt_bytes(sum(v.values()))]
                 for r, v in plan.roles.items()]))
    if plan.shared_base:
        print("LoRA roles over the teacher's shared weights: nothing is time-sliced (the base stays resident), so "
              "the time-sliced rows equal the resident ones")
    print("\nper-rank bytes resident in each phase (a time-sliced role sleeps whole, grad buffer included; it holds "
          "what the phase needs of it):")
    rows = []
    for phase in mp.PHASES:
        for sliced in (True, False):
            row = plan.phases[(phase, sliced)]
            rows.append([phase, "time-sliced" if sliced else "all resident"]
                        + [fmt_bytes(row[c]) for c in (*plan.roles, "activations", "total")])
    head = ["phase", "mode", *plan.roles, "activations (est.)", "total"]
    print(mp.format_table(head, rows, left=2))
    print_recompute(a, options, chosen, forced)
    budget = a.gpu_memory_gb * 2 ** 30
    given = "" if d.gpu_memory_gb else " (--gpu-memory-gb not given)"
    print()
    for sliced in (True, False):
        phase, peak = mp.peak(plan, sliced)
        verdict = "fits" if peak <= 0.9 * budget else ("tight (> 90%)" if peak <= budget else "does NOT fit")
        print(f"peak {'time-sliced ' if sliced else 'all resident'}: {fmt_bytes(peak)} ({phase} phase) -> "
              f"{verdict} in {a.gpu_memory_gb:g} GiB{given}")
    roles, totals, fits = mp.choose_offload(plan, mp.PLAN_HEADROOM * budget)
    print(f"default offload of pretrain_dmd2.py on CUDA with --gpu-memory-gb {a.gpu_memory_gb:g}: "
          f"{'+'.join(sorted(roles)) or 'none'} -> peak {fmt_bytes(max(totals.values()))}"
          + ("" if fits else f" (over {mp.PLAN_HEADROOM:g} x the budget even so)")
          + f"; flags {' '.join(mp.offload_flags(roles, plan.roles))}")
    if kv is not None:
        print_kv_cache(a, plan, *kv, layout=f"TP={tp} CP={cp}{' SP' if sp else ''}")


def recompute_given(a: argparse.Namespace) -> str:
    """What fixed one granularity for every phase: the flag, or --search's layout."""
    return getattr(a, "recompute_given", "--recompute-granularity")


def print_recompute(a: argparse.Namespace, options: dict, chosen: dict, forced) -> None:
    """Each phase with grad at each recompute granularity (`memory_plan.recompute_options`), the one chosen marked,
    then the granularity the run applies to every phase and its flag."""
    why = (f"{recompute_given(a)}: every phase" if forced else
           f"the least recompute whose time-sliced phase fits {mp.PLAN_HEADROOM:g} x {a.gpu_memory_gb:g} GiB")
    print(f"\nrecompute per phase with grad ({why}; the rollout has no grad, nothing to recompute):")
    rows = [[o.phase, o.granularity, fmt_bytes(o.activations), fmt_bytes(o.total), f"+{100 * o.share:.1f}%",
             "yes" if o.fits else "no", "chosen" if chosen[o.phase] == o else ""]
            for opts in options.values() for o in opts]
    print(mp.format_table(["phase", "recompute", "activations (est.)", "phase (time-sliced)", "extra FLOPs",
                           "fits", ""], rows, left=2))
    applied = mp.applied_recompute(chosen)
    note = "" if len({o.granularity for o in chosen.values()}) == 1 else (
        "; the trainer runs one granularity, the most any phase chose")
    print("recompute chosen: " + ", ".join(f"{p} {o.granularity} ({fmt_bytes(o.total)}, +{100 * o.share:.1f}% FLOPs)"
                                 for p, o in chosen.items())
          + f" -> applied to every phase: {applied}{note}; flags --recompute-granularity {applied}")


def print_kv_cache(a: argparse.Namespace, plan: mp.CyclePlan, gen: mp.KVCachePlan, roll: mp.KVCachePlan,
                   layout: str) -> None:
    """The causal student's KV cache at this layout (`memory_plan.kv_cache_plan`): streaming generation of
    --stream-frames (`gen`) and the training-time rollout (`roll`), per layer, per rank and over the TP x CP ranks."""
    b, budget = a.run.train.micro_batch_size, a.gpu_memory_gb * 2 ** 30
    print(f"\nKV cache of the causal student ({a.causal.describe()}), per rank at {layout}, B={b}, "
          f"{'bf16' if a.run.optim.bf16 else 'fp32'}; at its peak chunk (the chunks held while it is written):")
    rows = []
    for name, k in ((f"generation, {gen.frames} frames", gen), (f"rollout, {roll.frames} frames (data)", roll)):
        rows.append([name, f"{k.peak_chunk + 1} of {k.chunks}", str(len(k.held)), fmt_bytes(k.self_layer),
                     fmt_bytes(k.text_layer), fmt_bytes(k.per_layer), fmt_bytes(k.total), fmt_bytes(k.group_total),
                     fmt_bytes(k.forward), fmt_bytes(k.with_forward)])
    head = ["stream", "peak chunk", "chunks held", "self k/v per layer", "text k/v per layer", "per layer",
            f"per rank ({gen.layers} layers)", f"x {gen.group} ranks", "chunk fwd (est.)", "cache + fwd"]
    print(mp.format_table(head, rows))
    weights = plan.roles["student"]["weights"]
    print(f"generation per rank: student weights {fmt_bytes(weights)} + cache {fmt_bytes(gen.total)} + one chunk's "
          f"forward {fmt_bytes(gen.forward)} = {fmt_bytes(weights + gen.with_forward)}")
    row = plan.phases[("rollout", True)]
    roles = row["total"] - row["activations"]
    total = roles + roll.with_forward
    verdict = "fits" if total <= 0.9 * budget else ("tight (> 90%)" if total <= budget else "does NOT fit")
    print(f"streamed rollout phase per rank (time-sliced roles {fmt_bytes(roles)} + cache + one chunk's forward): "
          f"{fmt_bytes(total)} -> {verdict} in {a.gpu_memory_gb:g} GiB")


if __name__ == "__main__":
    sys.exit(main())
