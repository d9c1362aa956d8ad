"""Megatron-style command-line flags mapped onto the config dataclasses (nothing else here).

Groups mirror the dataclasses: model, parallel, optimizer, training. `parse_flow_args(argv)`
returns a validated `FlowPretrainConfig`; a bad value raises `ConfigError` naming the flag.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from dmd2_mega.config import (DistillConfig, DMD2Config, FlowPretrainConfig, ModelConfig, OptimConfig,
                              ParallelConfig, TrainConfig)
from dmd2_mega.models.registry import MODEL_SIZES


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-size", default="debug", help=f"one of {', '.join(MODEL_SIZES)}")
    g.add_argument("--attention-backend", default="sdpa", help="sdpa | flash (flash-attn, CUDA)")
    g.add_argument("--transformer-impl", default="local", help="local | transformer_engine")
    g.add_argument("--recompute-granularity", default=None, help="full: recompute each block in backward")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default=None, help="nccl | gloo (default: nccl on CUDA)")


def add_optim_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", default="cosine", help="cosine | constant")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--optimizer-impl", default="torch", help="torch | apex")
    g.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--data", default="digits", help="'digits' or a directory of safetensors shards")
    g.add_argument("--micro-batch-size", type=int, default=32)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=1000)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--cond-dropout", type=float, default=0.1)
    g.add_argument("--timestep-shift", type=float, default=1.0)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true", help="load weights only; fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-num-samples", type=int, default=500)
    g.add_argument("--eval-steps", type=int, default=50)
    g.add_argument("--eval-guidance", type=float, default=1.25)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--loss-trace", default=None, help="write every iteration's loss/grad-norm as JSON lines")
    g.add_argument("--deterministic", action="store_true",
                   help="bitwise-repeatable runs (torch deterministic algorithms)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: finish the current iteration, save, exit 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 once this much wall-clock time has passed")
    g.add_argument("--max-nan-iterations", type=int, default=10,
                   help="stop after this many consecutive non-finite (skipped) steps of one role; 0 = never")


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


def model_config(a) -> ModelConfig:
    return ModelConfig(size=a.model_size, attention_backend=a.attention_backend,
                       transformer_impl=a.transformer_impl, recompute_granularity=a.recompute_granularity)


def optim_config(a) -> OptimConfig:
    return OptimConfig(lr=a.lr, min_lr=a.min_lr, lr_warmup_iters=a.lr_warmup_iters,
                       lr_decay_style=a.lr_decay_style, lr_decay_iters=a.lr_decay_iters,
                       weight_decay=a.weight_decay, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
                       adam_eps=a.adam_eps, clip_grad=a.clip_grad, optimizer_impl=a.optimizer_impl, bf16=a.bf16)


def train_config(a) -> TrainConfig:
    keys = ("data", "micro_batch_size", "global_batch_size", "train_iters", "seed", "cond_dropout",
            "timestep_shift", "save", "load", "save_interval", "log_interval", "eval_interval",
            "eval_num_samples", "eval_steps", "eval_guidance", "tensorboard_dir", "deterministic",
            "loss_trace", "no_load_optim", "no_load_rng", "exit_signal_handler", "exit_duration_in_mins",
            "max_nan_iterations")
    return TrainConfig(**{k: getattr(a, k) for k in keys})


def parse_flow_args(argv: Optional[Sequence[str]] = None) -> FlowPretrainConfig:
    a = flow_parser().parse_args(argv)
    return FlowPretrainConfig(model=model_config(a),
                              parallel=ParallelConfig(a.tensor_model_parallel_size, a.distributed_backend),
                              optim=optim_config(a), train=train_config(a))


def add_dmd2_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dmd2")
    g.add_argument("--teacher-load", default=None, help="trained teacher checkpoint (required)")
    g.add_argument("--student-load", default=None, help="student init (default: --teacher-load)")
    g.add_argument("--critic-load", default=None, help="critic init (default: --teacher-load)")
    g.add_argument("--dmd2-denoising-steps", type=int, default=4)
    g.add_argument("--dmd2-student-sigmas", type=float, nargs="+", default=None,
                   help="explicit unshifted student grid, e.g. 1.0 0.75 0.5 0.25")
    g.add_argument("--dmd2-critic-steps-per-rollout", type=int, default=5)
    g.add_argument("--dmd2-score-sigma-range", type=float, nargs=2, default=(0.02, 0.98), metavar=("MIN", "MAX"))
    g.add_argument("--dmd2-critic-scoring", default="shared", help="shared | original")
    g.add_argument("--dmd2-critic-loss-space", default="velocity", help="velocity | x0")
    g.add_argument("--dmd2-teacher-guidance-scale", type=float, default=1.0)
    g.add_argument("--dmd2-critic-grid-size", type=int, default=1000)
    g.add_argument("--critic-lr", type=float, default=None)
    g.add_argument("--critic-min-lr", type=float, default=None)
    g.add_argument("--critic-weight-decay", type=float, default=None)
    g.add_argument("--critic-adam-beta1", type=float, default=None)
    g.add_argument("--critic-adam-beta2", type=float, default=None)
    g.add_argument("--offload-inactive", dest="offload_inactive", action="store_true", default=None,
                   help="sleep the roles a phase does not use (default on with CUDA)")
    g.add_argument("--no-offload-inactive", dest="offload_inactive", action="store_false")
    g = p.add_argument_group("dmd2 GAN head and student EMA")
    g.add_argument("--dmd2-gan", action="store_true",
                   help="train a GAN head on the critic's features; its generator loss joins the actor's")
    g.add_argument("--dmd2-gan-feature-layer", type=int, default=None,
                   help="critic block whose token-mean output feeds the head (default the middle block)")
    g.add_argument("--dmd2-gan-noise", action=argparse.BooleanOptionalAction, default=True,
                   help="noise real and fake to a sigma in the score range (default) or feed them clean")
    g.add_argument("--dmd2-gan-sigma-range", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="unshifted sigma range of the head's input noise (default: --dmd2-score-sigma-range)")
    g.add_argument("--dmd2-gan-disc-weight", type=float, default=1e-2)
    g.add_argument("--dmd2-gan-gen-weight", type=float, default=3e-3)
    g.add_argument("--ema-decay", type=float, default=0.0, help="student EMA decay (0 = off)")
    g.add_argument("--ema-start-iter", type=int, default=0, help="the EMA copies the student before this cycle")
    g.add_argument("--no-ema", action="store_true", help="evaluate the raw student weights, not the EMA")


def dmd2_parser() -> argparse.ArgumentParser:
    p = _common_parser("DMD2 distillation of a flow-matching DiT (Megatron-style flags).")
    add_dmd2_args(p)
    return p


def parse_dmd2_args(argv: Optional[Sequence[str]] = None) -> DistillConfig:
    a = dmd2_parser().parse_args(argv)
    d = DMD2Config(teacher_load=a.teacher_load, student_load=a.student_load, critic_load=a.critic_load,
                   denoising_steps=a.dmd2_denoising_steps, student_sigmas=a.dmd2_student_sigmas,
                   critic_steps_per_rollout=a.dmd2_critic_steps_per_rollout,
                   score_sigma_range=tuple(a.dmd2_score_sigma_range), critic_scoring=a.dmd2_critic_scoring,
                   critic_loss_space=a.dmd2_critic_loss_space, teacher_guidance_scale=a.dmd2_teacher_guidance_scale,
                   critic_grid_size=a.dmd2_critic_grid_size, critic_lr=a.critic_lr, critic_min_lr=a.critic_min_lr,
                   critic_weight_decay=a.critic_weight_decay, critic_adam_beta1=a.critic_adam_beta1,
                   critic_adam_beta2=a.critic_adam_beta2, offload_inactive=a.offload_inactive, gan=a.dmd2_gan,
                   gan_feature_layer=a.dmd2_gan_feature_layer, gan_noise=a.dmd2_gan_noise,
                   gan_sigma_range=tuple(a.dmd2_gan_sigma_range) if a.dmd2_gan_sigma_range else None,
                   gan_disc_weight=a.dmd2_gan_disc_weight, gan_gen_weight=a.dmd2_gan_gen_weight,
                   ema_decay=a.ema_decay, ema_start_iter=a.ema_start_iter, no_ema=a.no_ema)
    return DistillConfig(model=model_config(a), parallel=ParallelConfig(a.tensor_model_parallel_size, a.distributed_backend),
                         optim=optim_config(a), train=train_config(a), dmd2=d)
