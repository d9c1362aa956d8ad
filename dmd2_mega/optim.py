"""Optimizer, LR schedule and TP/DP-correct gradient clipping, written thinly over torch.

megatron-core's optimizer needs CUDA and does not keep Adam's step count across a resume, so
the optimizer is torch AdamW (fused on CUDA) or apex FusedAdam (`--optimizer-impl apex`), with
two parameter groups: weight decay on matrices, none on biases, norms and embedding tables.

Gradient norm under TP x DP: after the DP all-reduce every DP rank holds the same gradients, so
only TP matters. A TP-sharded parameter contributes its shard's squared norm on each TP rank
(summed over the TP group); a replicated parameter has identical gradients on every TP rank and
is counted once, so ||g||^2 = allreduce_TP(sum_sharded ||g_i||^2) + sum_replicated ||g_j||^2.
"""
from __future__ import annotations

import importlib.util
import math
from typing import Iterable

import torch
import torch.distributed as dist

from dmd2_mega.config import ConfigError, OptimConfig
from dmd2_mega.models.dit import tp_partition_dim


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_table = name.endswith("table.weight")
        (no_decay if p.ndim < 2 or is_table else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    on_cuda = next(model.parameters()).is_cuda
    if cfg.optimizer_impl == "apex":
        if importlib.util.find_spec("apex") is None:
            raise ConfigError("--optimizer-impl apex needs the apex package, which is not installed "
                              "(use --optimizer-impl torch)")
        if not on_cuda:
            raise ConfigError("--optimizer-impl apex needs CUDA; use --optimizer-impl torch on CPU")
        from apex.optimizers import FusedAdam
        return FusedAdam(groups, adam_w_mode=True, **kw)
    return torch.optim.AdamW(groups, fused=on_cuda, **kw)


class LRSchedule:
    """lr(it): linear warmup 0 -> lr over `lr_warmup_iters`, then cosine to `min_lr` at
    `lr_decay_iters` (default train_iters) or constant. A pure function of the iteration."""

    def __init__(self, cfg: OptimConfig, train_iters: int):
        self.cfg = cfg
        self.decay_iters = cfg.lr_decay_iters or max(train_iters, 1)

    def __call__(self, it: int) -> float:
        c = self.cfg
        if c.lr_warmup_iters and it < c.lr_warmup_iters:
            return c.lr * (it + 1) / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        span = max(self.decay_iters - c.lr_warmup_iters, 1)
        frac = min(max(it - c.lr_warmup_iters, 0) / span, 1.0)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * frac))

    def apply(self, optimizer: torch.optim.Optimizer, it: int) -> float:
        lr = self(it)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"decay_iters": self.decay_iters, "style": self.cfg.lr_decay_style, "lr": self.cfg.lr}

    def load_state_dict(self, state: dict) -> None:
        self.decay_iters = state["decay_iters"]


def grad_norm(params: Iterable[torch.nn.Parameter], tp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 tensor, no host sync); see module docstring."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    dev = params[0].grad.device
    sharded = [p.grad for p in params if tp_partition_dim(p) is not None]
    replicated = [p.grad for p in params if tp_partition_dim(p) is None]

    def sq(gs):
        if not gs:
            return torch.zeros((), device=dev, dtype=torch.float32)
        return torch.stack([g.detach().float().pow(2).sum() for g in gs]).sum()

    s = sq(sharded)
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(s, group=tp_group)
    return (s + sq(replicated)).sqrt()


def clip_gradients(params: list, max_norm: float, tp_group=None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (0 = no clip); returns the
    norm before clipping. The scale is a device tensor: no host sync."""
    norm = grad_norm(params, tp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
