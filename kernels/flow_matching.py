"""Flow-matching (critic) loss per sample, in velocity or x0 space.

With the target velocity v = eps - x0 and d = v_pred - v over the N elements of sample n:
  velocity space:  loss_n = mean_n(d^2)
  x0 space:        loss_n = mean_n(((x_s - sigma_n * v_pred) - x0)^2) with x_s = (1 - sigma_n) x0 + sigma_n eps,
                   and (x_s - sigma v_pred) - x0 = -sigma_n d, so loss_n = sigma_n^2 mean_n(d^2).
The kernel computes w_n * mean_n(d^2) with w_n = 1 or sigma_n^2 (exact, and free of the
cancellation in x_s - x0). Backward (x0 and eps are targets, not differentiated):
  d loss_n / d v_pred = 2 w_n d / N,  so grad_v_pred = (2 w_n grad_out_n / N) * d.
Shapes: v_pred, x0, eps [B, ...] (one dtype); sigma [B] float32 (a number is broadcast).
Output [B] float32 (float64 for float64 inputs on the torch path). Arithmetic in float32.
Triton: forward = one pass writing per-program partial sums [B, ceil(N / BLOCK)], then one small
program per sample adding them and applying w_n / N (_reduce.row_sum; deterministic, no atomics);
backward = one elementwise pass recomputing d (nothing is saved beyond the inputs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._reduce import row_sum
from ._utils import KernelError, block_for, check_same, compute_dtype, flat, num_warps_for, per_sample, resolve_impl

__all__ = ["flow_matching_loss", "flow_matching_loss_ref", "FlowMatchingLossFunction", "SPACES"]

SPACES = ("velocity", "x0")


@triton.jit
def _fm_fwd_kernel(v_ptr, x0_ptr, eps_ptr, part_ptr, N, NB, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    eps = tl.load(eps_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    d = v - (eps - x0)  # masked lanes: 0 - (0 - 0) = 0
    tl.store(part_ptr + b * NB + pid, tl.sum(d * d, axis=0))


@triton.jit
def _fm_bwd_kernel(v_ptr, x0_ptr, eps_ptr, sigma_ptr, gout_ptr, dv_ptr, N, X0_SPACE: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    coef = 2.0 * tl.load(gout_ptr + b).to(tl.float32) / N  # 2 * w_n * grad_out_n / N
    if X0_SPACE:
        sigma = tl.load(sigma_ptr + b)
        coef = coef * sigma * sigma
    v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    eps = tl.load(eps_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    # d/dv_pred [w mean(d^2)] = 2 w d / N
    tl.store(dv_ptr + base + offs, (coef * (v - (eps - x0))).to(dv_ptr.dtype.element_ty), mask=mask)


def _fwd_triton(v_pred, x0, eps, sigma, x0_space):
    v2 = flat(v_pred)
    B, N = v2.shape
    block = block_for(N)
    nb = triton.cdiv(N, block)
    part = torch.empty((B, nb), dtype=torch.float32, device=v_pred.device)
    _fm_fwd_kernel[(nb, B)](v2, flat(x0), flat(eps), part, N, nb, BLOCK=block, num_warps=num_warps_for(block))
    return row_sum(part, 1.0 / N, sigma if x0_space else None)


def _bwd_triton(grad_out, v_pred, x0, eps, sigma, x0_space):
    v2 = flat(v_pred)
    B, N = v2.shape
    dv = torch.empty_like(v2)
    block = block_for(N)
    _fm_bwd_kernel[(triton.cdiv(N, block), B)](v2, flat(x0), flat(eps), sigma, grad_out.contiguous(), dv, N,
                                                X0_SPACE=x0_space, BLOCK=block, num_warps=num_warps_for(block))
    return dv.view(v_pred.shape)


def _diff_torch(v_pred, x0, eps):
    cd = compute_dtype(v_pred.dtype)
    return (v_pred.to(cd) - eps.to(cd)).add_(x0.to(cd)).reshape(v_pred.shape[0], -1)


def _weight_torch(sigma, x0_space, dtype):
    s = sigma.to(dtype)
    return s * s if x0_space else torch.ones_like(s)


def _fwd_torch(v_pred, x0, eps, sigma, x0_space):
    d = _diff_torch(v_pred, x0, eps)
    return _weight_torch(sigma, x0_space, d.dtype) * torch.linalg.vector_norm(d, dim=1).square() / d.shape[1]


def _bwd_torch(grad_out, v_pred, x0, eps, sigma, x0_space):
    d = _diff_torch(v_pred, x0, eps)
    coef = (2.0 / d.shape[1]) * _weight_torch(sigma, x0_space, d.dtype) * grad_out.to(d.dtype)
    return (coef[:, None] * d).to(v_pred.dtype).view(v_pred.shape)


class FlowMatchingLossFunction(torch.autograd.Function):
    """Per-sample w_n * mean_n((v_pred - (eps - x0))^2); differentiable in v_pred only."""

    @staticmethod
    def forward(ctx, v_pred, x0, eps, sigma, x0_space, impl):
        ctx.save_for_backward(v_pred, x0, eps, sigma)
        ctx.impl, ctx.x0_space = impl, x0_space
        return (_fwd_triton if impl == "triton" else _fwd_torch)(v_pred, x0, eps, sigma, x0_space)

    @staticmethod
    def backward(ctx, grad_out):
        v_pred, x0, eps, sigma = ctx.saved_tensors
        grad_v = None
        if ctx.needs_input_grad[0]:
            bwd = _bwd_triton if ctx.impl == "triton" else _bwd_torch
            grad_v = bwd(grad_out, v_pred, x0, eps, sigma, ctx.x0_space)
        return grad_v, None, None, None, None, None


def flow_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma,
                       space: str = "velocity", impl: str | None = None) -> torch.Tensor:
    """Per-sample flow-matching loss [B] in ``space`` "velocity" or "x0"; differentiable in v_pred."""
    check_same(v_pred, "v_pred", x0=x0, eps=eps)
    if space not in SPACES:
        raise KernelError(f"space={space!r}: expected 'velocity' or 'x0'")
    if torch.is_grad_enabled() and (x0.requires_grad or eps.requires_grad):
        raise KernelError("flow_matching_loss differentiates v_pred only: x0 and eps are targets, "
                          "pass them detached")
    impl = resolve_impl(impl, v_pred, x0, eps, op="flow_matching")
    s = per_sample(sigma, v_pred.shape[0], v_pred.device, "sigma")
    return FlowMatchingLossFunction.apply(v_pred, x0, eps, s, space == "x0", impl)


def flow_matching_loss_ref(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma,
                           space: str = "velocity") -> torch.Tensor:
    """Pure-torch reference, written as the maths reads (x0 space through x_s): the baseline."""
    cd = compute_dtype(v_pred.dtype)
    B = v_pred.shape[0]
    v_pred, x0, eps = (t.to(cd).reshape(B, -1) for t in (v_pred, x0, eps))
    if space == "velocity":
        return ((v_pred - (eps - x0)) ** 2).mean(1)
    s = torch.as_tensor(sigma, dtype=cd, device=v_pred.device).reshape(-1, 1)
    x_s = (1 - s) * x0 + s * eps
    return (((x_s - s * v_pred) - x0) ** 2).mean(1)
