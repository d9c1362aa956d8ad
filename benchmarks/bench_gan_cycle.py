"""What DMD2's GAN head costs per cycle: a DMD-only cycle against a cycle with `--dmd2-gan`, measured in one run.

    python benchmarks/bench_gan_cycle.py [--model-size digits --data digits --micro-batch-size 64 \
        --dmd2-denoising-steps 4 --dmd2-critic-steps-per-rollout 5] [--gan-flags "--dmd2-gan-sigma-range 0.05 0.3"]
    # the Triton kernel path on a CPU:  DMD2_KERNELS=triton TRITON_INTERPRET=1 python benchmarks/bench_gan_cycle.py

Two trainers built by benchmarks/bench_dmd2_cycle.py's `Harness` (its flags, same seed: the same random teacher,
data and draws), the second with `--dmd2-gan` and --gan-flags. After --warmup rounds, each of --repeats rounds times
one cycle of each at the same cycle index (shared scoring, offload off), the order alternating between rounds;
reported: the median ms of each, their ratio and the median of the rounds' paired ratios.
Cost model, in F = one forward of B samples, a backward 2F (bench_dmd2_cycle's): the DMD-only cycle is
`memory_plan.cycle_passes`; the head adds, with d = (l + 1) / L the share of the critic's L blocks run up to its
feature block l, the real samples' forward and backward on r K samples per cycle (r = --dmd2-gan-real-rows, default
B), 3 d r K / B F, and the actor's
generator term through the frozen critic, 3 d F at most (its backward reaches the input only); the fakes' logits
come from the critic's own forward. The kernel path in use (`dmd2_kernels.resolve_impl`) is printed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dmd2_kernels  # noqa: E402
from benchmarks.bench_dmd2_cycle import Harness, add_flags  # noqa: E402
from dmd2_mega.plan import memory_plan as mp  # noqa: E402


def parse_args(argv=None):
    p = add_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--gan-flags", default="", help="further pretrain_dmd2.py flags of the GAN trainer, one string")
    p.set_defaults(repeats=7)
    return p.parse_args(argv)


def expected(a, gan) -> dict:
    """The cost model's passes (module docstring) of both cycles and their ratio."""
    base = mp.cycle_passes(a.dmd2_critic_steps_per_rollout, a.dmd2_denoising_steps, a.dmd2_teacher_guidance_scale,
                           "shared", a.recompute_granularity == "full")["cycle"]
    critic, settings = gan.tr.roles["critic"].model, gan.tr.method.settings.gan
    d = (critic.layer + 1) / critic.num_feature_layers
    extra = 3 * d * settings.real_rows * a.dmd2_critic_steps_per_rollout / a.micro_batch_size + 3 * d
    return {"dmd": base, "gan": base + extra, "ratio": (base + extra) / base, "d": d, "layer": critic.layer}


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available() and a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench_gan_") as tmp:
        dmd = Harness(a, os.path.join(tmp, "dmd"))
        gan = Harness(a, os.path.join(tmp, "gan"), ("--dmd2-gan", *shlex.split(a.gan_flags)))
        runs = {"dmd": [], "gan": []}
        for rnd in range(a.warmup + a.repeats):
            order = ("dmd", "gan") if rnd % 2 == 0 else ("gan", "dmd")
            for name in order:
                h = {"dmd": dmd, "gan": gan}[name]
                h.at(rnd)  # both variants at the same cycle: the same data and rollout draws
                ms = h.timed(lambda mark, h=h: h.cycle("shared", mark))["all"]
                if rnd >= a.warmup:
                    runs[name].append(ms)
        path = dmd2_kernels.resolve_impl(None, torch.zeros(1, device=dmd.dev))
        model = expected(a, gan)
    med = {k: statistics.median(v) for k, v in runs.items()}
    paired = statistics.median(g / d for g, d in zip(runs["gan"], runs["dmd"]))
    dev = torch.cuda.get_device_name(dmd.dev) if dmd.cuda else \
        f"CPU ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f})"
    print(f"device: {dev} | torch {torch.__version__} | kernels {path} | {a.model_size} on {a.data} | "
          f"B={a.micro_batch_size} K={a.dmd2_critic_steps_per_rollout} N={a.dmd2_denoising_steps} "
          f"g={a.dmd2_teacher_guidance_scale} | GAN: --dmd2-gan {a.gan_flags} (feature block {model['layer']}, "
          f"d={model['d']:.2f}) | median of {a.repeats} rounds after {a.warmup}")
    print(f"cost model: DMD-only cycle {model['dmd']:.2f}F, GAN cycle {model['gan']:.2f}F -> {model['ratio']:.3f}x")
    print(f"DMD-only cycle: {med['dmd']:.1f} ms | GAN cycle: {med['gan']:.1f} ms | GAN / DMD-only: "
          f"{med['gan'] / med['dmd']:.3f} (paired median {paired:.3f})")
    ratio = med["gan"] / med["dmd"]
    print(f"acceptance: GAN / DMD-only cycle <= 1.15: {ratio:.3f} -> {'PASS' if ratio <= 1.15 else 'FAIL'}")
    return {"dmd_ms": med["dmd"], "gan_ms": med["gan"], "ratio": ratio, "paired": paired}


if __name__ == "__main__":
    main()
