"""x0 projection from a velocity prediction: ``x0 = x_s - sigma * v``.

Shapes: x_s, v [B, ...] (any trailing shape, one dtype); sigma [B] float32 (a number is broadcast).
Output [B, ...] in the dtype of x_s; arithmetic in float32.
Backward (sigma is a constant): d x0 / d x_s = 1, d x0 / d v = -sigma, so
  grad_x_s = grad_out,   grad_v = -sigma_b * grad_out.
Triton grid: (ceil(N / BLOCK), B) with N = numel per sample; the big axis first (grid axis 0 has
no 65535 limit). One launch each way. The Triton path is the custom op ``torch.ops.dmd2.x0_fwd`` (backward
``dmd2.x0_bwd``); sigma reaches the kernels as a [B] tensor of any stride or as a Python float (_utils.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import (bcast, block_for, check_same, compute_dtype, flat, kernel_op, load_scalar, num_warps_for,
                     per_sample, resolve_impl, scalar_args, scalar_parts, wrap_triton)

PASSES = {"fwd": 3, "fwd+bwd": 5}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): forward reads x_s
and v and writes x0; backward reads the incoming grad and writes grad_v (grad_x_s is that grad itself).
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["x0_from_velocity", "x0_from_velocity_ref", "X0FromVelocityFunction"]


@triton.jit
def _x0_fwd_kernel(xs_ptr, v_ptr, s_ptr, s_stride, s_value, S_PTR: tl.constexpr, out_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    sigma = load_scalar(s_ptr, s_stride, s_value, b, S_PTR)
    xs = tl.load(xs_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = xs - sigma * v
    tl.store(out_ptr + base + offs, x0.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _x0_bwd_kernel(g_ptr, s_ptr, s_stride, s_value, S_PTR: tl.constexpr, dv_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    sigma = load_scalar(s_ptr, s_stride, s_value, b, S_PTR)
    g = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    # d/dv [x_s - sigma * v] = -sigma
    tl.store(dv_ptr + base + offs, (-sigma * g).to(dv_ptr.dtype.element_ty), mask=mask)


@kernel_op("x0_fwd")
def _fwd_triton(x_s: torch.Tensor, v: torch.Tensor, sigma: Optional[torch.Tensor], sigma_value: float) -> torch.Tensor:
    xs2, v2 = flat(x_s), flat(v)
    B, N = xs2.shape
    out = torch.empty_like(xs2)
    block = block_for(N)
    wrap_triton(_x0_fwd_kernel)[(triton.cdiv(N, block), B)](
        xs2, v2, *scalar_args(sigma, sigma_value, xs2), out, N, BLOCK=block, num_warps=num_warps_for(block))
    return out.view(x_s.shape)


@kernel_op("x0_bwd")
def _bwd_triton(g: torch.Tensor, sigma: Optional[torch.Tensor], sigma_value: float) -> torch.Tensor:
    g2 = flat(g)
    B, N = g2.shape
    dv = torch.empty_like(g2)
    block = block_for(N)
    wrap_triton(_x0_bwd_kernel)[(triton.cdiv(N, block), B)](
        g2, *scalar_args(sigma, sigma_value, g2), dv, N, BLOCK=block, num_warps=num_warps_for(block))
    return dv.view(g.shape)


def _setup_triton(ctx, inputs, output):
    _, _, sigma, ctx.sigma_value = inputs
    ctx.save_for_backward(sigma)


def _backward_triton(ctx, grad_out):
    (sigma,) = ctx.saved_tensors
    grad_v = _bwd_triton(grad_out, sigma, ctx.sigma_value) if ctx.needs_input_grad[1] else None
    return grad_out if ctx.needs_input_grad[0] else None, grad_v, None, None


_fwd_triton.register_autograd(_backward_triton, setup_context=_setup_triton)


class X0FromVelocityFunction(torch.autograd.Function):
    """The torch path: x0 = x_s - sigma * v in one op; sigma ([B] float32 or a float) is a constant."""

    @staticmethod
    def forward(ctx, x_s, v, sigma):
        ctx.sigma = sigma
        cd = compute_dtype(x_s.dtype)
        s = bcast(sigma, x_s)
        if isinstance(s, float):
            return torch.add(x_s.to(cd), v.to(cd), alpha=-s).to(x_s.dtype)
        return torch.addcmul(x_s.to(cd), s, v.to(cd), value=-1.0).to(x_s.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad_v = None
        if ctx.needs_input_grad[1]:
            # d/dv [x_s - sigma * v] = -sigma
            grad_v = (grad_out.to(compute_dtype(grad_out.dtype)) * -bcast(ctx.sigma, grad_out)).to(grad_out.dtype)
        return grad_out if ctx.needs_input_grad[0] else None, grad_v, None


def x0_from_velocity(x_s: torch.Tensor, v: torch.Tensor, sigma, impl: str | None = None) -> torch.Tensor:
    """``x_s - sigma * v`` per sample; differentiable in x_s and v. ``impl``: None | "triton" | "torch"."""
    check_same(x_s, "x_s", v=v)
    impl = resolve_impl(impl, x_s, v, op="x0")
    s = per_sample(sigma, x_s.shape[0], x_s.device, "sigma")
    if impl == "triton":
        return _fwd_triton(x_s, v, *scalar_parts(s))
    return X0FromVelocityFunction.apply(x_s, v, s)


def x0_from_velocity_ref(x_s: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
    """Pure-torch reference (eager multi-op, autograd through it): the benchmark's baseline."""
    cd = compute_dtype(x_s.dtype)
    s = torch.as_tensor(sigma, dtype=cd, device=x_s.device).reshape((-1,) + (1,) * (x_s.dim() - 1))
    return (x_s.to(cd) - s * v.to(cd)).to(x_s.dtype)
