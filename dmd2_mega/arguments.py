"""Megatron-style command-line flags mapped onto the config dataclasses (nothing else here).

Every flag is declared with `_flag(group, "--flag", Config, "field", ...)`: its value lands in that field, and a
flag not given is left out of the namespace (argparse.SUPPRESS), so its field keeps the dataclass default (never
restated here) and building a config is `Config(**given values)`. The namespace is thus exactly what the command
line gave, which `config.check_switches` reads: a flag that has no effect in the run (a `Needs` row whose switch
is off: --dmd2-gan-disc-weight without --dmd2-gan) is refused even at its default value. Groups mirror the
dataclasses: model, parallel, optimizer, training, dmd2, GAN head and EMA. `parse_flow_args(argv)` returns a
validated `FlowPretrainConfig`, `parse_dmd2_args(argv)` a `DistillConfig`; a bad value raises `ConfigError` naming
the flag.
The DMD2 flags that size a run's memory (`PLANNED`) are declared once, here, for the trainer and for
launch/plan_memory.py (`add_memory_plan_args`, read back by `memory_plan_configs` as the trainer's dataclasses),
so the two cannot differ in name, default, help or check.
"""
from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace
from typing import Optional, Sequence

from dmd2_mega.config import (DistillConfig, DMD2Config, EMAConfig, FlowPretrainConfig, GANConfig, LoRAConfig,
                              ModelConfig, OptimConfig, ParallelConfig, TrainConfig, check_switches)
from dmd2_mega.errors import ConfigError
from dmd2_mega.models.registry import MODEL_SIZES


def _has_default(cls, name: str) -> None:
    """TypeError unless `cls.name` has a plain default: what a flag left out of the command line keeps."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no plain default for a flag not given to keep")


def _flag(g, flag: str, cls, name: str, **kw) -> None:
    """`flag` sets `cls.name`; not given, it is absent from the namespace and the field keeps its dataclass default
    (which must exist); a value's metavar is the field's name."""
    _has_default(cls, name)
    if "action" not in kw:
        kw.setdefault("metavar", name.upper())
    g.add_argument(flag, dest=f"{cls.__name__}.{name}", default=argparse.SUPPRESS, **kw)


def _roles(text: str) -> tuple:
    """ROLE[,ROLE] -> (ROLE, ...); the names are checked by `DMD2Config`."""
    return tuple(r.strip() for r in text.split(","))


# The flags of a DMD2 run that launch/plan_memory.py sizes it by: flag -> (dataclass, field, argparse keywords).
# The trainer's groups add them from here (`_planned`), the planner with `add_memory_plan_args`.
PLANNED = {
    "--model-size": (ModelConfig, "size", dict(
        help=f"one of {', '.join(MODEL_SIZES)}, or a diffusers config.json / model folder a family recognises")),
    "--recompute-granularity": (ModelConfig, "recompute_granularity", dict(
        help="none | selective (all but the attention, whose outputs are kept) | full: what each block recomputes "
             "in backward (default none; launch/plan_memory.py without it chooses per phase)")),
    "--causal": (ModelConfig, "causal", dict(
        action="store_true",
        help="a causal streaming model: frames in chunks, each attending to itself and earlier chunks")),
    "--causal-chunk-frames": (ModelConfig, "causal_chunk_frames", dict(
        type=int, help="latent frames per chunk (3: chunk-wise; 1: frame-wise); the first chunk may be shorter")),
    "--causal-local-attn-chunks": (ModelConfig, "causal_local_attn_chunks", dict(
        type=int, help="attend to the last W chunks only (rolling window; default: all)")),
    "--causal-sink-chunks": (ModelConfig, "causal_sink_chunks", dict(
        type=int, help="with a window, the first S chunks stay visible (attention sink)")),
    "--tensor-model-parallel-size": (ParallelConfig, "tensor_model_parallel_size", dict(type=int)),
    "--context-parallel-size": (ParallelConfig, "context_parallel_size", dict(
        type=int, help="ranks that split each sample's tokens (Ulysses; TP x CP must divide the heads)")),
    "--sequence-parallel": (ParallelConfig, "sequence_parallel", dict(
        action="store_true",
        help="shard LayerNorm / modulation / residual regions along the sequence inside the TP group")),
    "--bf16": (OptimConfig, "bf16", dict(
        action="store_true",
        help="bf16 parameters and compute; the optimizer keeps fp32 master weights and Adam state")),
    "--use-distributed-optimizer": (OptimConfig, "use_distributed_optimizer", dict(
        action="store_true",
        help="shard fp32 master weights, reduced gradients and Adam state over the DP group (ZeRO-1/2)")),
    "--micro-batch-size": (TrainConfig, "micro_batch_size", dict(type=int, help="B per data-parallel rank")),
    "--dmd2-denoising-steps": (DMD2Config, "denoising_steps", dict(
        type=int, help="student steps N (default: the number of --dmd2-student-sigmas if given, else 4)")),
    "--dmd2-student-sigmas": (DMD2Config, "student_sigmas", dict(
        type=float, nargs="+", help="explicit unshifted student grid, e.g. 1.0 0.75 0.5 0.25")),
    "--dmd2-critic-steps-per-rollout": (DMD2Config, "critic_steps_per_rollout", dict(
        type=int, help="K critic steps per student step (one rollout of K*B samples)")),
    "--dmd2-teacher-guidance-scale": (DMD2Config, "teacher_guidance_scale", dict(
        type=float, help="CFG of the teacher's score; > 1 doubles the teacher's batch")),
    "--gpu-memory-gb": (DMD2Config, "gpu_memory_gb", dict(
        type=float, help="GiB of device memory per rank for the offload plan (default: the device's total; "
                         "launch/plan_memory.py, which has no device, plans for 80)")),
    "--student-lora-rank": (LoRAConfig, "student_rank", dict(
        type=int, help="the student as adapters of this rank over the teacher's frozen, shared weights (0: full)")),
    "--critic-lora-rank": (LoRAConfig, "critic_rank", dict(type=int, help="the same for the critic")),
    "--dmd2-gan": (GANConfig, "enabled", dict(
        action="store_true",
        help="train a GAN head on the critic's features; its generator loss joins the actor's (and the actor phase "
             "holds the critic's weights)")),
    "--dmd2-gan-feature-layer": (GANConfig, "feature_layer", dict(
        type=int,
        help="critic block whose output token grid feeds the head (default the last block of the first half)")),
    "--dmd2-gan-fakes": (GANConfig, "fakes", dict(
        choices=("own", "separate"),
        help="own: the critic forward's rows in the GAN range (default, no forward of their own); separate: the x0hat "
             "of as many rows as --dmd2-gan-real-rows noised apart into the range (tianweiy/DMD2's; those rows through "
             "the critic's first half more per step)")),
    "--dmd2-gan-head": (GANConfig, "head", dict(
        choices=("conv", "mlp"),
        help="conv: strided convolutions + GroupNorm + SiLU over the token grid (tianweiy/DMD2's form; default); "
             "mlp: the token mean into an MLP (the head before)")),
    "--dmd2-gan-noise": (GANConfig, "noise", dict(
        action=argparse.BooleanOptionalAction,
        help="noise real and fake to a sigma in the GAN range (default) or feed them clean")),
    "--dmd2-gan-real-rows": (GANConfig, "real_rows", dict(
        type=int,
        help="dataset samples the head sees per critic step, 1..B (default B: each of a micro-batch's K x B samples "
             "once per cycle)")),
}


def _planned(g, *flags: str) -> None:
    for flag in flags:
        cls, name, kw = PLANNED[flag]
        _flag(g, flag, cls, name, **kw)


def _values(ns: argparse.Namespace, cls) -> dict:
    """The fields of `cls` the command line gave, with their values."""
    prefix = cls.__name__ + "."
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)}


_PARTS = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig, "train": TrainConfig,
          "dmd2": DMD2Config, "gan": GANConfig, "ema": EMAConfig, "lora": LoRAConfig}


def _configs(ns: argparse.Namespace, composed, *parts: str):
    """`composed(part=that dataclass built from the flags in ns, ...)`, then `config.check_switches` of the flags the
    command line gave (those in `ns`)."""
    given = {p: _values(ns, _PARTS[p]) for p in parts}
    run = composed(**{p: _PARTS[p](**values) for p, values in given.items()})
    check_switches(run, {(_PARTS[p], name) for p, values in given.items() for name in values})
    return run


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    _planned(g, "--model-size")
    _flag(g, "--attention-backend", ModelConfig, "attention_backend",
          help="sdpa (torch's SDPA, its kernel chosen per device) | cudnn | flash3 (FlashAttention-3) | flash "
               "(flash-attn 2)")
    _flag(g, "--transformer-impl", ModelConfig, "transformer_impl", help="local | transformer_engine")
    _flag(g, "--compile", ModelConfig, "compile", action=argparse.BooleanOptionalAction,
          help="each transformer block under torch.compile (default: on with CUDA, off on a CPU)")
    _planned(g, "--recompute-granularity")
    c = p.add_argument_group("causal student (docs/causal.md)")
    _planned(c, "--causal", "--causal-chunk-frames", "--causal-local-attn-chunks", "--causal-sink-chunks")
    _flag(c, "--causal-context-noise", ModelConfig, "causal_context_noise", type=float,
          help="level at which a generated chunk is re-run to write the KV cache (0: clean)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel")
    _planned(g, "--tensor-model-parallel-size", "--context-parallel-size", "--sequence-parallel")
    _flag(g, "--distributed-backend", ParallelConfig, "distributed_backend", help="nccl | gloo (default: nccl on CUDA)")


def add_optim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    for name, typ in (("lr", float), ("min_lr", float), ("lr_warmup_iters", int), ("lr_decay_iters", int),
                      ("weight_decay", float), ("adam_beta1", float), ("adam_beta2", float), ("adam_eps", float),
                      ("clip_grad", float)):
        _flag(g, "--" + name.replace("_", "-"), OptimConfig, name, type=typ)
    _flag(g, "--lr-decay-style", OptimConfig, "lr_decay_style", help="cosine | constant")
    _flag(g, "--optimizer-impl", OptimConfig, "optimizer_impl", help="torch | apex")
    _flag(g, "--override-opt-param-scheduler", OptimConfig, "override_opt_param_scheduler", action="store_true",
          help="on --load, use the flags' LR schedule where it differs from the checkpoint's")
    _flag(g, "--use-checkpoint-opt-param-scheduler", OptimConfig, "use_checkpoint_opt_param_scheduler",
          action="store_true", help="on --load, keep the checkpoint's LR schedule where it differs from the flags")
    _planned(g, "--bf16", "--use-distributed-optimizer")


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    T = TrainConfig
    _flag(g, "--data", T, "data", help="'digits', 'moving-digits' (4-frame clips), 'moving-digits:T' (T frames, "
          "wrapping round the canvas) or a directory of safetensors shards")
    _planned(g, "--micro-batch-size")
    for name, typ in (("global_batch_size", int), ("train_iters", int), ("seed", int),
                      ("num_workers", int), ("cond_dropout", float), ("timestep_shift", float), ("save_interval", int),
                      ("log_interval", int), ("eval_interval", int), ("eval_num_samples", int), ("eval_steps", int),
                      ("eval_guidance", float)):
        _flag(g, "--" + name.replace("_", "-"), T, name, type=typ)
    for name in ("save", "load", "tensorboard_dir"):
        _flag(g, "--" + name.replace("_", "-"), T, name)
    _flag(g, "--eval-prompts", T, "eval_prompts", metavar="FILE",
          help="validation prompt embeddings (prepare_data.py --prompts-only): the eval samples one per prompt")
    _flag(g, "--vae", T, "vae", metavar="DIR",
          help="diffusers VAE folder of latent --data: the eval decodes its samples to MP4 / GIF / PNG media")
    _flag(g, "--no-load-optim", T, "no_load_optim", action="store_true", help="load weights only; fresh optimizer")
    _flag(g, "--overwrite-save", T, "overwrite_save", action="store_true",
          help="write into a --save that holds another run's checkpoints (without it such a --save is refused, unless "
               "--load names it: a resume)")
    _flag(g, "--no-load-rng", T, "no_load_rng", action="store_true")
    _flag(g, "--loss-trace", T, "loss_trace", help="write every iteration's loss/grad-norm as JSON lines")
    _flag(g, "--deterministic", T, "deterministic", action="store_true",
          help="bitwise-repeatable runs (torch deterministic algorithms)")
    _flag(g, "--exit-signal-handler", T, "exit_signal_handler", action="store_true",
          help="on SIGTERM: finish the current iteration, save, exit 0 (with several ranks: at the next "
               "--log-interval / --save-interval iteration)")
    _flag(g, "--exit-duration-in-mins", T, "exit_duration_in_mins", type=float,
          help="save and exit 0 once this much wall-clock time has passed (with several ranks: at the next "
               "--log-interval / --save-interval iteration)")
    _flag(g, "--max-nan-iterations", T, "max_nan_iterations", type=int,
          help="stop after this many consecutive non-finite (skipped) steps of one role; 0 = never (checked at "
               "each --log-interval / --save-interval iteration: up to --log-interval - 1 iterations later)")
    _flag(g, "--curves-reference", T, "curves_reference", action="append", metavar="NAME=VALUE",
          help="a reference line on the eval metric's panel of <save>/curves.png, e.g. \"teacher 50 steps=1.307\" "
               "(repeatable; needs --save and --eval-interval)")


def _common_parser(description: str) -> argparse.ArgumentParser:
    """The flag groups every training script takes: model, parallel, optimizer, training."""
    p = argparse.ArgumentParser(description=description)
    add_model_args(p)
    add_parallel_args(p)
    add_optim_args(p)
    add_train_args(p)
    return p


def flow_parser() -> argparse.ArgumentParser:
    return _common_parser("Pretrain a flow-matching DiT teacher (Megatron-style flags).")


def parse_flow_args(argv: Optional[Sequence[str]] = None) -> FlowPretrainConfig:
    return _configs(flow_parser().parse_args(argv), FlowPretrainConfig, "model", "parallel", "optim", "train")


def add_dmd2_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dmd2")
    D = DMD2Config
    _flag(g, "--teacher-load", D, "teacher_load", help="trained teacher checkpoint (required)")
    _flag(g, "--distill-method", D, "distill_method",
          help="dmd2 | self-forcing (a --causal student on its own autoregressive rollouts; docs/causal.md)")
    _flag(g, "--self-forcing-exit", D, "self_forcing_exit",
          help="self-forcing: chunk (one exit step per chunk for the batch) | sample (per sample and chunk)")
    _flag(g, "--self-forcing-rollout-frames", D, "self_forcing_rollout_frames", type=int,
          help="self-forcing: roll out F frames (default: the data's T) and score one window of T per micro-batch")
    _flag(g, "--causal-grad-chunks", D, "causal_grad_chunks", type=int,
          help="self-forcing: the DMD gradient reaches the last M chunks only (default: all)")
    _flag(g, "--offload-prefetch", D, "offload_prefetch", action="store_true",
          help="wake the next phase's sleeping roles during the current phase's last step (both resident meanwhile)")
    _flag(g, "--cuda-graphs", D, "cuda_graphs", action="store_true",
          help="replay each model call of a cycle from a CUDA graph captured once per shape (CUDA; no offload, "
               "TP = CP = 1)")
    _flag(g, "--student-load", D, "student_load", help="student init (default: --teacher-load)")
    _flag(g, "--critic-load", D, "critic_load", help="critic init (default: --teacher-load)")
    _planned(g, "--dmd2-denoising-steps", "--dmd2-student-sigmas", "--dmd2-critic-steps-per-rollout")
    _flag(g, "--dmd2-score-sigma-range", D, "score_sigma_range", type=float, nargs=2, metavar=("MIN", "MAX"))
    _flag(g, "--dmd2-critic-scoring", D, "critic_scoring", help="shared | original")
    _flag(g, "--dmd2-critic-loss-space", D, "critic_loss_space", help="velocity | x0")
    _planned(g, "--dmd2-teacher-guidance-scale")
    _flag(g, "--dmd2-critic-grid-size", D, "critic_grid_size", type=int)
    for name in ("critic_lr", "critic_min_lr", "critic_weight_decay", "critic_adam_beta1", "critic_adam_beta2"):
        _flag(g, "--" + name.replace("_", "-"), D, name, type=float)
    _flag(g, "--offload-inactive", D, "offload_inactive", action="store_const", const=True,
          help="every role sleeps in the phases that do not use it (default: on CUDA, the roles the memory plan "
               "says must sleep to fit --gpu-memory-gb; none on a CPU)")
    g.add_argument("--no-offload-inactive", dest=f"{D.__name__}.offload_inactive", action="store_const", const=False,
                   default=argparse.SUPPRESS, help="no role sleeps")
    _flag(g, "--offload-roles", D, "offload_roles", type=_roles, metavar="ROLE[,ROLE]",
          help="only these roles sleep in the phases that do not use them (e.g. critic,teacher: what "
               "launch/plan_memory.py --emit-flags writes for a planned subset); not with --[no-]offload-inactive")
    _flag(g, "--allow-student-teacher", D, "allow_student_teacher", action="store_true",
          help="accept a student checkpoint as --teacher-load (distilling a distilled model)")
    _planned(g, "--gpu-memory-gb")
    g = p.add_argument_group("dmd2 GAN head and student EMA")
    _planned(g, "--dmd2-gan", "--dmd2-gan-feature-layer", "--dmd2-gan-fakes", "--dmd2-gan-head", "--dmd2-gan-noise")
    _flag(g, "--dmd2-gan-sigma-range", GANConfig, "sigma_range", type=float, nargs=2, metavar=("MIN", "MAX"),
          help="unshifted sigma range of the head's input noise (default: --dmd2-score-sigma-range)")
    _flag(g, "--dmd2-gan-disc-weight", GANConfig, "disc_weight", type=float)
    _flag(g, "--dmd2-gan-gen-weight", GANConfig, "gen_weight", type=float)
    _flag(g, "--dmd2-gan-head-lr-mult", GANConfig, "head_lr_mult", type=float,
          help="the head's learning rate as a multiple of the critic's (it starts from scratch)")
    _flag(g, "--dmd2-gan-head-weight-decay", GANConfig, "head_weight_decay", type=float,
          help="AdamW weight decay of the head's parameters, biases and norms included (default 0.01: tianweiy/DMD2's "
               "guidance AdamW)")
    _flag(g, "--dmd2-gan-head-clip-grad", GANConfig, "head_clip_grad", type=float,
          help="clip the head's gradients by their own norm to this, apart from --clip-grad (0 = no clip; default 10: "
               "tianweiy/DMD2's max_grad_norm for the guidance model)")
    _planned(g, "--dmd2-gan-real-rows")
    _flag(g, "--ema-decay", EMAConfig, "decay", type=float, help="student EMA decay (0 = off)")
    _flag(g, "--ema-start-iter", EMAConfig, "start_iter", type=int, help="the EMA copies the student before this cycle")
    _flag(g, "--no-ema", EMAConfig, "no_ema", action="store_true", help="evaluate the raw student weights, not the EMA")
    g = p.add_argument_group("LoRA roles")
    L = LoRAConfig
    _planned(g, "--student-lora-rank", "--critic-lora-rank")
    _flag(g, "--lora-alpha", L, "alpha", type=float, help="adapter scale alpha / rank (default alpha = rank)")
    _flag(g, "--lora-target-modules", L, "target_modules", type=_roles,
          help="the family's linears to adapt, comma-separated (default all: Wan to_q,to_k,to_v,to_out,fc1,fc2; "
               "DiT qkv,proj,fc1,fc2)")
    _flag(g, "--lora-allow-other-base", L, "allow_other_base", action="store_true",
          help="resume adapters trained over other base weights (by fingerprint)")
    _flag(g, "--no-lora-shared-base", L, "no_shared_base", action="store_true",
          help="each LoRA role keeps its own copy of the base instead of sharing the teacher's weights")


def dmd2_parser() -> argparse.ArgumentParser:
    p = _common_parser("DMD2 distillation of a flow-matching DiT (Megatron-style flags).")
    add_dmd2_args(p)
    return p


def parse_dmd2_args(argv: Optional[Sequence[str]] = None, unread: Optional[dict] = None,
                    script: str = "this entry point") -> DistillConfig:
    """The DMD2 flags as a `DistillConfig`. `unread` {part: field names, or "all"}: the flags of the shared parser
    that `script`'s method never reads (`CausalInitMethod.unread`: the critic's, the GAN head's); given on the
    command line, each is a ConfigError naming it: no flag is a silent no-op."""
    parser = dmd2_parser()
    ns = parser.parse_args(argv)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for part, names in (unread or {}).items():
        cls = _PARTS[part]
        for name in _values(ns, cls):
            if names == "all" or name in names:
                raise ConfigError(f"{flags[f'{cls.__name__}.{name}']} has no effect in {script}: its method never "
                                  f"reads it; leave the flag out")
    return _configs(ns, DistillConfig, *_PARTS)


_PLAN_GROUPS = {ModelConfig: "model", ParallelConfig: "parallel", OptimConfig: "optimizer", TrainConfig: "training",
                DMD2Config: "dmd2", GANConfig: "dmd2 GAN head", LoRAConfig: "LoRA roles"}


def add_memory_plan_args(p: argparse.ArgumentParser) -> None:
    """The trainer's flags that size a DMD2 run (`PLANNED`), grouped as pretrain_dmd2.py groups them, for
    launch/plan_memory.py."""
    groups = {}
    for flag, (cls, _, _) in PLANNED.items():
        if cls not in groups:
            groups[cls] = p.add_argument_group(f"{_PLAN_GROUPS[cls]} (launch/pretrain_dmd2.py's flags)")
        _planned(groups[cls], flag)


def memory_plan_configs(ns: argparse.Namespace) -> SimpleNamespace:
    """The flags of `add_memory_plan_args` as the trainer's dataclasses, checked by them (ConfigError naming the
    flag, and a flag without effect refused as the trainer refuses it): `.model`, `.parallel`, `.optim`, `.train`,
    `.dmd2`, `.gan`, `.lora`, as on a `DistillConfig` (every other field is its default)."""
    return _configs(ns, SimpleNamespace, "model", "parallel", "optim", "train", "dmd2", "gan", "lora")
