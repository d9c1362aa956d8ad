"""megatron-core on a CPU-only torch: the few places it hard-codes CUDA, handled in one module.

megatron-core 0.16 assumes CUDA in
  * its RNG tracker (`tensor_parallel.random.CudaRNGStatesTracker.add/fork` read and write
    `torch.cuda` generator state; `model_parallel_cuda_manual_seed` calls `torch.cuda.manual_seed`),
  * `torch.cuda.current_device()` in layer constructors when weights are initialised on the GPU
    (we always pass `use_cpu_initialization=True` on CPU, so that path is never taken),
  * `torch.cuda.current_device()` in `gather_from_tensor_model_parallel_region` (the output
    gather of a ColumnParallelLinear with gather_output=True): `gather_from_tp` below,
  * `torch.cuda.synchronize()` in its timers (we do not use them; `synchronize()` below is ours).
Everything here is active only when CUDA is absent: on a CUDA machine each function calls the
megatron-core original. Nothing patches torch tensor types; the only megatron-core state touched is
its module-level RNG tracker, which gets a CPU generator-backed tracker of the same class family.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mcore_random


def cuda_available() -> bool:
    return torch.cuda.is_available()


class CPURNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron-core's tracker with the CPU default generator in place of the CUDA one.

    `fork(name)` swaps the CPU RNG state to the named stream and back, exactly the contract
    megatron-core's layers rely on (e.g. `with get_cuda_rng_tracker().fork(): dropout(...)`).
    """

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already tracked")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not tracked")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """megatron-core's `model_parallel_cuda_manual_seed`, with a CPU tracker when CUDA is absent.

    Streams (megatron's convention): data-parallel `seed`; tensor-model-parallel
    `seed + 2718 + tp_rank`; expert `seed + 1024`.
    """
    if cuda_available():
        mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, force_reset_rng=True)
        return
    tracker = CPURNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def rng_tracker_states() -> dict:
    """The tracker's named states (for checkpoints)."""
    return {k: v.clone() for k, v in mcore_random.get_cuda_rng_tracker().get_states().items()}


def set_rng_tracker_states(states: dict) -> None:
    mcore_random.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in states.items()})


def current_device() -> torch.device:
    """`torch.cuda.current_device()` where CUDA exists, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """`torch.cuda.synchronize()` where CUDA exists; a no-op on CPU (ops there are synchronous)."""
    if cuda_available():
        torch.cuda.synchronize()


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim over the TP group; backward keeps this rank's slice.

    y = [x_0 | x_1 | ... | x_{T-1}]  =>  dL/dx_r = (dL/dy)[..., r*n:(r+1)*n]
    """

    @staticmethod
    def forward(ctx, x):
        group = mpu.get_tensor_model_parallel_group()
        world, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        ctx.rank, ctx.n = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous()


def gather_from_tp(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's `gather_from_tensor_model_parallel_region` (allocates on CUDA) or its CPU twin."""
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return x
    if cuda_available():
        return tensor_parallel.gather_from_tensor_model_parallel_region(x)
    return _GatherLastDim.apply(x)
