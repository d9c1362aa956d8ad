"""Classifier-free guidance fused with the x0 projection (teacher scoring, forward only).

  v  = v_neg + g * (v_pos - v_neg)         (g = 1: no guidance)
  x0 = x_s - sigma * v
Shapes: x_s, v_pos, v_neg [B, ...] (one dtype); sigma, guidance [B] float32 tensors on x_s's device (any stride;
a one-element tensor is broadcast) or Python numbers (kernel scalar arguments: no tensor is built, no host work).
Output [B, ...] in the dtype of x_s; arithmetic in float32. One read of each input and one write, instead of eager
torch's four intermediate tensors; the Triton path is the custom op ``torch.ops.dmd2.cfg_x0``, the torch path two
ops in float32 (lerp, then addcmul, or add for a number sigma; plus the casts of 16-bit inputs).
Forward only: the teacher is frozen, so the op raises if any input requires grad while grad mode
is on (call it under ``torch.no_grad()``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import (KernelError, bcast, block_for, check_same, compute_dtype, flat, kernel_op, load_scalar,
                     num_warps_for, per_sample, resolve_impl, scalar_args, scalar_parts, wrap_triton)

PASSES = {"fwd": 4}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): forward reads x_s,
v_pos and v_neg and writes x0 (no backward: the teacher is frozen).
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["cfg_x0", "cfg_x0_ref"]


@triton.jit
def _cfg_x0_fwd_kernel(xs_ptr, vp_ptr, vn_ptr, s_ptr, s_stride, s_value, S_PTR: tl.constexpr,
                       g_ptr, g_stride, g_value, G_PTR: tl.constexpr, out_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    sigma = load_scalar(s_ptr, s_stride, s_value, b, S_PTR)
    g = load_scalar(g_ptr, g_stride, g_value, b, G_PTR)
    xs = tl.load(xs_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    vp = tl.load(vp_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    vn = tl.load(vn_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    v = vn + g * (vp - vn)
    tl.store(out_ptr + base + offs, (xs - sigma * v).to(out_ptr.dtype.element_ty), mask=mask)


@kernel_op("cfg_x0")
def _fwd_triton(x_s: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor, sigma: Optional[torch.Tensor],
                sigma_value: float, guidance: Optional[torch.Tensor], guidance_value: float) -> torch.Tensor:
    xs2 = flat(x_s)
    B, N = xs2.shape
    out = torch.empty_like(xs2)
    block = block_for(N)
    wrap_triton(_cfg_x0_fwd_kernel)[(triton.cdiv(N, block), B)](
        xs2, flat(v_pos), flat(v_neg), *scalar_args(sigma, sigma_value, xs2),
        *scalar_args(guidance, guidance_value, xs2), out, N, BLOCK=block, num_warps=num_warps_for(block))
    return out.view(x_s.shape)


def _fwd_torch(x_s, v_pos, v_neg, sigma, guidance):
    cd = compute_dtype(x_s.dtype)
    v = torch.lerp(v_neg.to(cd), v_pos.to(cd), bcast(guidance, x_s))
    s = bcast(sigma, x_s)
    if isinstance(s, float):
        return torch.add(x_s.to(cd), v, alpha=-s).to(x_s.dtype)
    return torch.addcmul(x_s.to(cd), s, v, value=-1.0).to(x_s.dtype)


def cfg_x0(x_s: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor, sigma, guidance,
           impl: str | None = None) -> torch.Tensor:
    """``x_s - sigma * (v_neg + guidance * (v_pos - v_neg))`` per sample; forward only. ``sigma`` and ``guidance``:
    Python numbers or [B] (or one-element) tensors on x_s's device; neither makes any host work or launch."""
    check_same(x_s, "x_s", v_pos=v_pos, v_neg=v_neg)
    if torch.is_grad_enabled() and (x_s.requires_grad or v_pos.requires_grad or v_neg.requires_grad):
        raise KernelError("cfg_x0 is forward-only (the teacher is frozen): call it under torch.no_grad() "
                          "or pass detached tensors")
    impl = resolve_impl(impl, x_s, op="cfg")
    B = x_s.shape[0]
    s = per_sample(sigma, B, x_s.device, "sigma")
    g = per_sample(guidance, B, x_s.device, "guidance")
    if impl == "triton":
        return _fwd_triton(x_s, v_pos, v_neg, *scalar_parts(s), *scalar_parts(g))
    return _fwd_torch(x_s, v_pos, v_neg, s, g)


def cfg_x0_ref(x_s: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor, sigma, guidance) -> torch.Tensor:
    """Pure-torch reference (eager multi-op): the benchmark's baseline."""
    cd = compute_dtype(x_s.dtype)
    shape = (-1,) + (1,) * (x_s.dim() - 1)
    s = torch.as_tensor(sigma, dtype=cd, device=x_s.device).reshape(shape)
    g = torch.as_tensor(guidance, dtype=cd, device=x_s.device).reshape(shape)
    vp, vn = v_pos.to(cd), v_neg.to(cd)
    return (x_s.to(cd) - s * (vn + g * (vp - vn))).to(x_s.dtype)
