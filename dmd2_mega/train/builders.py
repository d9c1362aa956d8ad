"""Builders both trainers (and the benchmarks, tests and `launch/sample.py`) share.

`data_info(dataset)`: the dict of sample shape and condition kind that checkpoints store and compare;
`build_model(model_cfg, info, ps)`: the `--model-size` model (registry: family + spec) at this run's TP
degree, built on the CPU from the default RNG (identical on every rank: TP-invariant) and moved to
the compute device; `cast_model(model, bf16)`: `--bf16` casts the parameters (fp32 masters live in
the optimizer); `enable_determinism()`: `--deterministic`.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from dmd2_mega.data.dataset import parts_record
from dmd2_mega.config import ModelConfig, OptimConfig
from dmd2_mega.train.dist_optim import DistributedOptimizer
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.models import DataShape, FamilyModel
from dmd2_mega.models import build_model as build_registered
from dmd2_mega.train.optim import Optimizer
from dmd2_mega.distributed.parallel import ParallelState


def enable_determinism() -> None:
    """--deterministic: deterministic torch kernels (cuBLAS needs its workspace setting before the
    first GEMM), no cuDNN autotuning. The project's Triton kernels reduce without atomics."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def data_info(dataset) -> dict:
    """Sample shape [C, *spatial] and condition kind (square images also as `image_size`, as checkpoints
    written before video data recorded them; compare infos through `DataShape.from_info`)."""
    info = {"in_channels": dataset.channels, "latent_shape": [dataset.channels, *dataset.spatial],
            "num_classes": dataset.num_classes,
            "cond_shape": tuple(dataset.cond_shape) if dataset.cond_shape is not None else None}
    if getattr(dataset, "cond_parts", None):  # a condition of parts (`models.DataShape.cond_parts`)
        info["cond_parts"] = parts_record(dataset.cond_parts)
    if len(dataset.spatial) == 2 and dataset.spatial[0] == dataset.spatial[1]:
        info["image_size"] = dataset.spatial[0]
    return info


def build_model(model_cfg: ModelConfig, info: dict, ps: ParallelState, negative=None) -> FamilyModel:
    """`negative`: the data's negative-prompt embedding, CFG's negative condition (families that take one)."""
    on, _ = model_cfg.compile_choice(ps.device, ps.tp_size, ps.cp_size, ps.sequence_parallel)
    options = replace(model_cfg.options(), context_parallel=ps.cp_size, sequence_parallel=ps.sequence_parallel,
                      compile=on)
    model = build_registered(model_cfg.size, DataShape.from_info(info), ps.tp_size, options)
    if negative is not None:
        model.set_negative(negative)
    return model.to(ps.device)


def cast_model(model: torch.nn.Module, bf16: bool) -> torch.nn.Module:
    """--bf16: bf16 parameters and compute (fp32 masters live in the optimizer)."""
    return model.to(torch.bfloat16) if bf16 else model


def build_grads_and_optimizer(model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState):
    """A trained role's fp32 gradient buffer (DP-reduced) and its optimizer: `optim.Optimizer`, or with
    --use-distributed-optimizer `dist_optim.DistributedOptimizer` over a buffer whose buckets are sharded. The
    weights are replicated over DP x CP, so both reduce (and shard) over that group; the mean is over DP."""
    grads = GradBuffer(model, ps.dp_cp_group, shard=cfg.use_distributed_optimizer, average_over=ps.dp_size,
                       tp_group=ps.tp_group)
    kind = DistributedOptimizer if cfg.use_distributed_optimizer else Optimizer
    return grads, kind(model, cfg, ps.tp_group, ps.dp_cp_group, grads)
