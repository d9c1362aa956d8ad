"""Activation recompute of a family's blocks in backward (--recompute-granularity none | selective | full).

full: each block keeps only its inputs and runs again in backward (one more forward of the blocks per backward).
selective: the same checkpoint under a selective policy (torch's `create_selective_checkpoint_contexts`): the outputs
    of the attention ops (SDPA's fused kernels, flash-attn's op: the output and its log-sum-exp) are kept from the
    forward and reused; everything else (norms, modulation, the q / k / v and output projections, q / k norm and
    rotary, the MLP, the residual arithmetic) runs again. A block then keeps its inputs plus each attention call's
    output and log-sum-exp, and backward recomputes the block's FLOPs less its attention cores: at Wan 2.1 1.3B's
    32,760 tokens the core is ~70% of a block, so ~30% of full's extra work for ~1/7 of no recompute's memory.
    An attention the dispatcher does not see as one op (SDPA's math fallback, which decomposes into matmuls) is
    recomputed: selective then costs what full does. With compiled blocks (--compile) the checkpoint is compiled
    with the block inside: the policy marks the graph and the compiler saves the attention outputs (around a
    compiled block a policy would see no op).
Both are torch's NON-reentrant checkpoint on every device: the models have no dropout, so megatron's RNG-tracking
(reentrant) checkpoint buys nothing, and the reentrant one rejects the actor's `backward(inputs=...)` (GAN head) and
trips DDP's "marked ready twice" when two checkpointed forwards share one DDP call. Recompute happens only with grad
in training mode (the rollout's no-grad forwards keep nothing), and never around a stateful mixer (a KV cache being
read and filled: the rerun would see another cache).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dmd2_mega.models import compiled

GRANULARITIES = ("none", "selective", "full")
"""In order of recompute: each saves more memory than the one before and recomputes more."""

KEPT_OPS = ("attention", "flash_attn")
"""Selective keeps the outputs of the dispatcher ops whose names hold one of these (aten's
_scaled_dot_product_{flash,efficient,cudnn}_attention*, flash_attn::*, flash_attn_3::*)."""


def granularity(value) -> str:
    """One of `GRANULARITIES` from a granularity, None (not given: none) or a bool (the old full / none switch)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if value not in GRANULARITIES:
        raise ValueError(f"recompute granularity must be one of {', '.join(GRANULARITIES)}, got {value!r}")
    return value


def kept(func) -> bool:
    """Whether selective keeps this op's outputs (`KEPT_OPS`)."""
    name = str(func)
    return any(k in name for k in KEPT_OPS)


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The (forward, recompute) dispatch modes of one selective checkpoint (`checkpoint`'s context_fn)."""
    return create_selective_checkpoint_contexts(_policy)


def run(how: str, fn: Callable, *args, compile_: bool = False):
    """fn(*args), its activations recomputed in backward as `how` says (module docstring); the caller decides whether
    recompute applies at all (training, grad on, a stateless mixer). `compile_`: fn runs a compiled block; selective
    then compiles the checkpoint with the block inside (`compiled.function`: one graph for every layer)."""
    if how == "none":
        return fn(*args)
    if how == "full":
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    if compile_:
        return compiled.function(_selective, "SelectiveBlock")(fn, *args)
    return _selective(fn, *args)


def _selective(fn: Callable, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=selective_contexts)
