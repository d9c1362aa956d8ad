"""Self-attention core: q, k, v [B, heads_local, S, d] -> [B, heads_local, S, d].

`sdpa`: torch.nn.functional.scaled_dot_product_attention (CPU and GPU; flash/mem-efficient
kernels on CUDA). `flash`: flash-attn's `flash_attn_func` (CUDA, fp16/bf16), asked for with
`--attention-backend flash`; missing package or CUDA is a clear error, never a silent fallback.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dmd2_mega.errors import ConfigError


def check_backend(backend: str) -> None:
    if backend == "flash":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("--attention-backend flash needs the flash-attn package, which is not installed "
                              "(pip install flash-attn, or use --attention-backend sdpa)")
        if not torch.cuda.is_available():
            raise ConfigError("--attention-backend flash needs CUDA; use --attention-backend sdpa on CPU")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    if backend == "flash":
        from flash_attn import flash_attn_func
        dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        out = flash_attn_func(*(t.transpose(1, 2).to(dtype) for t in (q, k, v)))
        return out.transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v)
