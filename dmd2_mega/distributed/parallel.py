"""Distributed setup: torchrun environment, TP/CP/DP groups from megatron-core, and RNG streams.

World = TP x CP x DP (no pipeline parallel). Ranks of one TP group hold shards of the same layers, ranks of
one CP group hold chunks of the same token sequence (`models/token_parallel.py`); both must see identical data
and noise. DP ranks see different data. Rank layout is megatron-core's: TP ranks are adjacent, then CP (ranks
0,1 form TP group 0 and ranks 0,2 CP group 0 when TP=2, CP=2). Weights are replicated over DP x CP, so
gradients are reduced (and a distributed optimizer shards) over that group: `dp_cp_group`.

Noise and per-sample randomness come from `micro_batch_generator(seed, iteration, j)`, keyed by
the iteration and the GLOBAL micro-batch index j (not by the rank): the same global batch gets the
same noise whether it is processed by DP=1 with 2 micro-batches or DP=2 with one each, a resume
replays exactly, TP ranks (same j) agree, and DP ranks (different j) differ.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from dmd2_mega.distributed import megatron_compat
from dmd2_mega.errors import ConfigError


class ParallelSettings(Protocol):
    """What `init_distributed` reads (`config.ParallelConfig` is one; this module sits below config)."""

    tensor_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    distributed_backend: Optional[str]


@dataclass
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    backend: str
    cp_rank: int = 0
    cp_size: int = 1
    sequence_parallel: bool = False

    @property
    def tp_group(self):
        return mpu.get_tensor_model_parallel_group()

    @property
    def dp_group(self):
        """The data-parallel group: ranks that see different data (CP excluded)."""
        return mpu.get_data_parallel_group()

    @property
    def dp_cp_group(self):
        """The ranks that hold the same weights: DP x CP. Gradients are summed over it and divided by DP."""
        return mpu.get_data_parallel_group(with_context_parallel=True)

    @property
    def writes_shards(self) -> bool:
        """This rank writes its TP shard of a checkpoint: the first of its DP x CP replicas."""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def layout(self) -> str:
        """'TP=2 CP=2 DP=2 SP' (CP and SP named only when on): the log's description of this run's layout."""
        cp = f" CP={self.cp_size}" if self.cp_size > 1 else ""
        return f"TP={self.tp_size}{cp} DP={self.dp_size}" + (" SP" if self.sequence_parallel else "")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: ParallelSettings, seed: int = 1234) -> ParallelState:
    """Join the torchrun job (or make a world of one), build TP/DP groups, seed megatron's RNG.

    Without torchrun's environment (plain `python launch/...py`) a single-rank world is created on an
    in-process store: no TCP port is opened, so concurrent single-rank runs cannot collide on one. A world of one
    whose RANK a previous world of one in this process set (no MASTER_ADDR: torchrun always sets it) is standalone
    too, so `pretrained.load_model` in a notebook can follow a torn-down run.
    """
    standalone = "RANK" not in os.environ or ("MASTER_ADDR" not in os.environ
                                              and os.environ.get("WORLD_SIZE") == "1")
    if standalone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    tp, cp = cfg.tensor_model_parallel_size, cfg.context_parallel_size
    if world % (tp * cp) != 0:
        what = f"--tensor-model-parallel-size {tp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "")
        raise ConfigError(f"{what} does not divide the world size {world} (torchrun --nproc-per-node x --nnodes)")
    if cfg.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel shards the sequence inside the TP group; it needs "
                          "--tensor-model-parallel-size > 1")
    cuda = torch.cuda.is_available()
    backend = cfg.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on a CPU machine")
    # TF32 for fp32 matmuls and convolutions on CUDA (Ampere+), as Megatron runs them; no effect on a CPU
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if standalone:
            kwargs["store"] = dist.HashStore()
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10), **kwargs)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    state = ParallelState(rank=rank, world_size=world, local_rank=local_rank,
                          tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=tp,
                          dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
                          device=device, backend=backend, cp_rank=mpu.get_context_parallel_rank(), cp_size=cp,
                          sequence_parallel=cfg.sequence_parallel)
    seed_everything(seed, state.tp_rank)
    return state


def seed_everything(seed: int, tp_rank: int) -> None:
    """Same default RNG on every rank (TP-invariant CPU weight init); megatron's tracker per TP rank."""
    torch.manual_seed(seed)
    megatron_compat.model_parallel_seed(seed, tp_rank)


def destroy_distributed() -> None:
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def micro_batch_generator(seed: int, iteration: int, micro_index: int, device: Optional[torch.device],
                          stream: int = 0, generator: Optional[torch.Generator] = None) -> torch.Generator:
    """The generator of (iteration, global micro-batch index, stream); see module docstring. A new one on `device`,
    or `generator` re-seeded in place (`device` unused): `manual_seed` resets a generator's whole state (a CPU one's
    cached normal too), so its draws are bit-equal to a new generator's; a run keeps one per (index, stream)."""
    # SeedSequence mixes all four keys into well-spread bits: torch's CPU generator keeps only
    # the low 32 bits of a seed, so packing keys into high bits would collide.
    words = np.random.SeedSequence([seed, iteration, micro_index, stream]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator(device=device) if generator is None else generator
    gen.manual_seed(int(words[0]) | (int(words[1]) << 31))
    return gen


def tp_partition_dim(param: torch.Tensor) -> Optional[int]:
    """The dim a parameter is split along across TP ranks (megatron-core's `partition_dim`
    attribute), or None if it is replicated."""
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None


def mark_sequence_parallel(params, on: bool = True) -> None:
    """Tag replicated parameters used only on the sequence-parallel tokens of a TP rank (megatron-core's
    `sequence_parallel` attribute): each TP rank's gradient is a part, summed over TP (`grad_buffer.GradBuffer`)."""
    if on:
        for p in params:
            p.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def sums_over_tp(param: torch.Tensor) -> bool:
    """Whether each TP rank's gradient of a replicated parameter is a part of the whole, to be summed over TP: the
    sequence-parallel ones, and a LoRA adapter's replicated factor (`models/lora.py`: tagged `tp_partial_grad`)."""
    return is_sequence_parallel(param) or bool(getattr(param, "tp_partial_grad", False))


def mark_whole_over_cp(params, on: bool = True) -> None:
    """Tag parameters applied only to values every CP rank holds whole (the GAN head on the CP-gathered token grid):
    each CP rank's gradient is the whole one, where the rest of a CP model's is the part from its tokens, so the
    gradient buffer divides it by CP before summing over DP x CP (`grad_buffer.GradBuffer`)."""
    if on:
        for p in params:
            p.whole_over_cp = True


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that does not make the host wait: pinned and non-blocking on CUDA (a pageable
    non_blocking copy is synchronous); a plain `.to` elsewhere."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def all_reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place mean over `group` (default: data parallel); identity in a world of one."""
    group = group if group is not None else mpu.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return t


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """Collective over `group` (default: the world, when one is initialised): True if `flag` is True on any of its
    ranks. One host sync."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def barrier(group: Optional[object] = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
