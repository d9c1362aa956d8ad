"""x0 projection from a velocity prediction: ``x0 = x_s - sigma * v``.

Shapes: x_s, v [B, ...] (any trailing shape, one dtype); sigma [B] float32 (a number is broadcast).
Output [B, ...] in the dtype of x_s; arithmetic in float32.
Backward (sigma is a constant): d x0 / d x_s = 1, d x0 / d v = -sigma, so
  grad_x_s = grad_out,   grad_v = -sigma_b * grad_out.
Triton grid: (ceil(N / BLOCK), B) with N = numel per sample; the big axis first (grid axis 0 has
no 65535 limit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (bcast, block_for, check_same, compute_dtype, flat, num_warps_for, per_sample,
                     resolve_impl)

__all__ = ["x0_from_velocity", "x0_from_velocity_ref", "X0FromVelocityFunction"]


@triton.jit
def _x0_fwd_kernel(xs_ptr, v_ptr, sigma_ptr, out_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    sigma = tl.load(sigma_ptr + b).to(tl.float32)
    xs = tl.load(xs_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = xs - sigma * v
    tl.store(out_ptr + base + offs, x0.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _x0_bwd_kernel(g_ptr, sigma_ptr, dv_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    sigma = tl.load(sigma_ptr + b).to(tl.float32)
    g = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    # d/dv [x_s - sigma * v] = -sigma
    tl.store(dv_ptr + base + offs, (-sigma * g).to(dv_ptr.dtype.element_ty), mask=mask)


def _fwd_triton(x_s: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    xs2, v2 = flat(x_s), flat(v)
    B, N = xs2.shape
    out = torch.empty_like(xs2)
    block = block_for(N)
    _x0_fwd_kernel[(triton.cdiv(N, block), B)](xs2, v2, sigma, out, N, BLOCK=block,
                                                num_warps=num_warps_for(block))
    return out.view(x_s.shape)


def _bwd_triton(g: torch.Tensor, sigma: torch.Tensor, v_dtype: torch.dtype) -> torch.Tensor:
    g2 = flat(g)
    B, N = g2.shape
    dv = torch.empty(g2.shape, dtype=v_dtype, device=g.device)
    block = block_for(N)
    _x0_bwd_kernel[(triton.cdiv(N, block), B)](g2, sigma, dv, N, BLOCK=block, num_warps=num_warps_for(block))
    return dv.view(g.shape)


def _fwd_torch(x_s: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    cd = compute_dtype(x_s.dtype)
    return torch.addcmul(x_s.to(cd), bcast(sigma, x_s), v.to(cd), value=-1.0).to(x_s.dtype)


def _bwd_torch(g: torch.Tensor, sigma: torch.Tensor, v_dtype: torch.dtype) -> torch.Tensor:
    return (g.to(compute_dtype(g.dtype)) * -bcast(sigma, g)).to(v_dtype)


class X0FromVelocityFunction(torch.autograd.Function):
    """x0 = x_s - sigma * v on the Triton or torch path; sigma [B] float32 is a constant."""

    @staticmethod
    def forward(ctx, x_s, v, sigma, impl):
        ctx.save_for_backward(sigma)
        ctx.impl, ctx.v_dtype = impl, v.dtype
        return (_fwd_triton if impl == "triton" else _fwd_torch)(x_s, v, sigma)

    @staticmethod
    def backward(ctx, grad_out):
        (sigma,) = ctx.saved_tensors
        grad_xs = grad_out if ctx.needs_input_grad[0] else None
        grad_v = None
        if ctx.needs_input_grad[1]:
            grad_v = (_bwd_triton if ctx.impl == "triton" else _bwd_torch)(grad_out, sigma, ctx.v_dtype)
        return grad_xs, grad_v, None, None


def x0_from_velocity(x_s: torch.Tensor, v: torch.Tensor, sigma, impl: str | None = None) -> torch.Tensor:
    """``x_s - sigma * v`` per sample; differentiable in x_s and v. ``impl``: None | "triton" | "torch"."""
    check_same(x_s, "x_s", v=v)
    impl = resolve_impl(impl, x_s, v, op="x0")
    s = per_sample(sigma, x_s.shape[0], x_s.device, "sigma")
    return X0FromVelocityFunction.apply(x_s, v, s, impl)


def x0_from_velocity_ref(x_s: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
    """Pure-torch reference (eager multi-op, autograd through it): the benchmark's baseline."""
    cd = compute_dtype(x_s.dtype)
    s = torch.as_tensor(sigma, dtype=cd, device=x_s.device).reshape((-1,) + (1,) * (x_s.dim() - 1))
    return (x_s.to(cd) - s * v.to(cd)).to(x_s.dtype)
