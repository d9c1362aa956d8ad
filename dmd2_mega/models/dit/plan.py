"""The DiT family's per-rank parameter / FLOP / activation maths (`models/dit/model.py`), for plan/memory_plan.py.

Notation: hidden h, layers L, heads a, patch p, channels C, image side H, tokens S = (H / p)^2, MLP width
m = int(h * mlp_ratio), timestep feature width f, TP degree t, n samples. Weight bytes w = 2 under --bf16 else 4;
activation bytes = w. The DiT runs with TP and DP only (no token split: cp = 1, sp = False).

Parameters (exact; megatron-core splits the output dim of ColumnParallelLinear and the input dim
of RowParallelLinear, RowParallelLinear's bias stays whole):
    sharded (divided by t):  per block adaLN 6h(h+1), qkv 3h(h+1), proj h^2, fc1 m(h+1), fc2 mh;
                             final adaLN 2h(h+1)
    replicated:              x_embed (Cp^2+1)h, t_embed (f+1)h + (h+1)h, labels (classes+1)h or
                             text (D+1)h + (h+1)h, per block the proj and fc2 biases 2h,
                             final (h+1)p^2C
    buffer:                  pos [S, h] and, with text, the negative-prompt embedding (model dtype)
Activations of a training forward of n samples, kept for backward (no S^2 term: SDPA/flash keep
    the log-sum-exp only), per layer:  n S (8h + (5h + 2m) / t) w + n (a / t) S 4
    (layer-norm inputs/outputs, modulated inputs, attention projection and fc2 outputs at full width;
    q, k, v, attention output and its re-laid copy, fc1 output and GELU output per TP shard),
    plus n S (3h + Cp^2) w outside the blocks. --recompute-granularity full keeps only each block's
    input n S h w, plus one block's full set while that block is recomputed in backward. selective
    (`models/recompute.py`) keeps per block also the attention's output and log-sum-exp,
    n S h w / t + 4 n (a / t) S, and recomputes all but the attention core's L 4 S^2 h / t FLOPs (at
    DiT-XL/2's 256 tokens the core is ~4% of a block: selective costs nearly what full does).
    A no-grad forward of n samples holds about n S (4h + max(3h, 2m) / t) w at its peak.
    Measured on CPU with saved-tensor hooks (tests/test_plan_memory.py) the kept bytes are within
    1.25x of this estimate; the peak also holds temporaries of the op running at that moment.
Forward FLOPs per sample (matmuls, 2 per multiply-add, per TP rank), attention included:
    2 S (Cp^2 h + h p^2 C) + 2 (f h + h^2 + [text: D h + h^2]) + 2 h 2h / t
    + L [2 h 6h / t + 2 S (3h^2 + h^2 + 2 h m) / t + 4 S^2 h / t]
"""
from __future__ import annotations

import math

from dmd2_mega.errors import ConfigError
from dmd2_mega.models.family import PlanMaths


def param_counts(ms) -> dict:
    """{'sharded': total over TP ranks, 'replicated': per rank, 'tensors': parameter tensors, 'buffer'}."""
    s, h, m, c, p = ms.spec, ms.spec.hidden_size, ms.mlp, ms.in_channels, ms.spec.patch_size
    per_block = 6 * h * (h + 1) + 3 * h * (h + 1) + h * h + m * (h + 1) + m * h
    sharded = s.num_layers * per_block + 2 * h * (h + 1)
    cond = (ms.num_classes + 1) * h if ms.num_classes is not None else (ms.cond_shape[-1] + 1) * h + (h + 1) * h
    replicated = ((c * p * p + 1) * h + (s.freq_dim + 1) * h + (h + 1) * h + cond
                  + 2 * h * s.num_layers + (h + 1) * p * p * c)
    tensors = 2 + 4 + (1 if ms.num_classes is not None else 4) + 10 * s.num_layers + 2 + 2
    negative = math.prod(ms.cond_shape) if ms.cond_shape is not None else 0
    return {"sharded": sharded, "replicated": replicated, "tensors": tensors, "buffer": ms.tokens * h + negative}


def forward_flops(ms, n: int = 1, tp: int = 1) -> int:
    """Matmul FLOPs of one forward of n samples on one TP rank (module docstring)."""
    s, h, m, c, p, S = ms.spec, ms.spec.hidden_size, ms.mlp, ms.in_channels, ms.spec.patch_size, ms.tokens
    out = 2 * S * (c * p * p * h + h * p * p * c) + 2 * (s.freq_dim * h + h * h) + 2 * h * 2 * h // tp
    if ms.cond_shape is not None:
        out += 2 * (ms.cond_shape[-1] * h + h * h)
    return n * (out + s.num_layers * _block_flops(ms)[0] // tp)


def _block_flops(ms) -> tuple[int, int]:
    """(one block's forward FLOPs per sample at TP 1, its attention core's: q k^T and the weighted sum of v)."""
    h, m, S = ms.spec.hidden_size, ms.mlp, ms.tokens
    core = 4 * S * S * h
    return 2 * h * 6 * h + 2 * S * (3 * h * h + h * h + 2 * h * m) + core, core


def recompute_flops(ms, n: int, tp: int, selective: bool) -> int:
    """The blocks' forward FLOPs of n samples on one TP rank that a backward runs again: every block's (full), less
    its attention core (selective, which keeps its output)."""
    block, core = _block_flops(ms)
    return n * (ms.spec.num_layers * (block - (core if selective else 0)) // tp)


def layer_activation_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    h, m, S, w = ms.spec.hidden_size, ms.mlp, ms.tokens, 2 if bf16 else 4
    return n * S * (8 * h + (5 * h + 2 * m) // tp) * w + n * (ms.spec.num_heads // tp) * S * 4


def block_input_bytes(ms, n: int, bf16: bool, tp: int = 1, cp: int = 1, sp: bool = False) -> int:
    return n * ms.tokens * ms.spec.hidden_size * (2 if bf16 else 4)


def outside_activation_bytes(ms, n: int, tp: int, bf16: bool, recompute: bool, cp: int = 1, sp: bool = False) -> int:
    return n * ms.tokens * (3 * ms.spec.hidden_size + ms.in_channels * ms.spec.patch_size ** 2) * (2 if bf16 else 4)


def nograd_activation_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    h, S, w = ms.spec.hidden_size, ms.tokens, 2 if bf16 else 4
    return n * S * (4 * h + max(3 * h, 2 * ms.mlp) // tp) * w


def attention_kept_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    """Per block, what selective recompute keeps beyond the block's input (module docstring)."""
    h, S, w = ms.spec.hidden_size, ms.tokens, 2 if bf16 else 4
    return n * S * h // tp * w + 4 * n * (ms.spec.num_heads // tp) * S


def score_bytes(ms, *_) -> int:
    raise ConfigError("--attention-kernel math is modelled for the Wan family only")


def kv_cache_bytes(ms, *_) -> tuple[int, int]:
    raise ConfigError(f"--causal-chunk-frames: --model-size {ms.spec.name} is a DiT, an image model with no frames "
                      f"to stream; causal students are video (the Wan family)")


def lora_linears(ms) -> list:
    """The linears LoRA adapters may sit on (`DiTFamily.lora_targets`), every layer: (name, "column" | "row", in,
    out): qkv (h -> 3h), proj (h -> h), fc1 (h -> m), fc2 (m -> h)."""
    h, m = ms.spec.hidden_size, ms.mlp
    return [("qkv", "column", h, 3 * h), ("proj", "row", h, h), ("fc1", "column", h, m),
            ("fc2", "row", m, h)] * ms.spec.num_layers


MATHS = PlanMaths(param_counts, forward_flops, layer_activation_bytes, block_input_bytes, outside_activation_bytes,
                  nograd_activation_bytes, score_bytes, kv_cache_bytes, lora_linears, attention_kept_bytes,
                  recompute_flops)
