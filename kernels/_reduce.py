"""Second stage of the per-sample reductions: out[b] = scale * (sigma_b^2 if SIGMA_SQ) * sum_j part[b, j].

part [B, NB] float32 holds one partial sum per program of the first stage (deterministic: no
atomics); one program per sample adds its NB partials. A tiny launch in place of the three or four
small torch ops (sum, divide, square, multiply) it replaces.
"""
import torch
import triton
import triton.language as tl

__all__ = ["row_sum"]


@triton.jit
def _row_sum_kernel(part_ptr, sigma_ptr, out_ptr, NB, scale, SIGMA_SQ: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, NB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + b * NB + offs, mask=offs < NB, other=0.0)
    total = tl.sum(acc, axis=0) * scale
    if SIGMA_SQ:
        sigma = tl.load(sigma_ptr + b)
        total = total * sigma * sigma
    tl.store(out_ptr + b, total)


def row_sum(part: torch.Tensor, scale: float, sigma: torch.Tensor | None = None) -> torch.Tensor:
    """[B, NB] float32 partial sums -> [B] float32 (see the module docstring)."""
    B, nb = part.shape
    out = torch.empty(B, dtype=torch.float32, device=part.device)
    block = max(16, min(1024, triton.next_power_of_2(nb)))
    _row_sum_kernel[(B,)](part, part if sigma is None else sigma, out, nb, scale, SIGMA_SQ=sigma is not None,
                          BLOCK=block, num_warps=4)
    return out
