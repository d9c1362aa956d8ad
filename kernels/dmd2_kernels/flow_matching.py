"""Flow-matching (critic) loss per sample, in velocity or x0 space, or its batch mean.

With the target velocity v = eps - x0 and d = v_pred - v over the N elements of sample n:
  velocity space:  loss_n = mean_n(d^2)
  x0 space:        loss_n = mean_n(((x_s - sigma_n * v_pred) - x0)^2) with x_s = (1 - sigma_n) x0 + sigma_n eps,
                   and (x_s - sigma v_pred) - x0 = -sigma_n d, so loss_n = sigma_n^2 mean_n(d^2).
The op computes w_n * mean_n(d^2) with w_n = 1 or sigma_n^2 (exact, and free of the cancellation in x_s - x0);
``reduction="mean"`` returns their batch mean (1/B) sum_n loss_n (0-dim) instead of the [B] losses, computed in the
same launches (the critic's loss: no further op forward or backward).
Backward (x0 and eps are targets, not differentiated):
  d loss_n / d v_pred = 2 w_n d / N,  so grad_v_pred = (2 w_n grad_out_n / N) * d   (mean: grad_out / B each).
Shapes: v_pred, x0, eps [B, ...] (one dtype); sigma a [B] float32 tensor (any stride) or a Python number.
Output [B] (or 0-dim) float32 (float64 for float64 inputs on the torch path). Arithmetic in float32.
Triton (the custom op ``torch.ops.dmd2.flow_matching_fwd``, backward ``dmd2.flow_matching_bwd``), two launches:
  1. grid (ceil(N / BLOCK), B): per-program partial sums of d^2 -> part [B, ceil(N / BLOCK)] float32;
  2. one program: loss_n = w_n / N * sum_j part[n, j] for each n, and their mean, each summed in index order.
Deterministic (no atomics in the sums), so a resumed run reproduces its losses bit for bit. One launch is not
possible without giving that up or carrying state between calls: the program that adds the partials must know that
all the others have written theirs, i.e. count arrivals on a counter that is zero when the launch starts; zeroing it
is itself a launch (a fill), unless each call leaves it zeroed for the next, a buffer shared by every call on the
device (wrong under two streams, and under CUDA-graph capture of the call that allocates it). dmd_loss can do it
because its first launch zeroes the counter of its second.
Triton backward = one elementwise pass recomputing d (nothing is saved beyond the inputs); grad_out of any stride.
Torch path: autograd through F.mse_loss against the target eps - x0 (float32 inputs; 16-bit inputs add their
casts): velocity space 3 aten ops forward (sub, mse_loss, mean) and 2 backward, or 2 and 1 for the mean; x0 space
2 more forward for the weights (square, multiply) and 1 more backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import (KernelError, block_for, check_same, compute_dtype, flat, kernel_op, load_scalar, num_warps_for,
                     per_sample, resolve_impl, scalar_args, scalar_parts, wrap_triton)

PASSES = {"fwd": 3, "fwd+bwd": 7}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): forward reads
v_pred, x0 and eps (the loss is per sample); backward reads them again and writes grad_v.
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["flow_matching_loss", "flow_matching_loss_ref", "SPACES", "REDUCTIONS"]

SPACES = ("velocity", "x0")
REDUCTIONS = ("none", "mean")
FINAL_BLOCK = 1024  # partials added per step by the final program


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
def _fm_final_kernel(part_ptr, s_ptr, s_stride, s_value, S_PTR: tl.constexpr, out_ptr, B, NB, inv_n,
                     X0_SPACE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program: loss_b = w_b / N * sum_j part[b, j] for each b, in index order; stores them, or their mean."""
    total = 0.0
    for b in range(0, B):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, NB, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(part_ptr + b * NB + offs, mask=offs < NB, other=0.0)
        loss = tl.sum(acc, axis=0) * inv_n
        if X0_SPACE:
            sigma = load_scalar(s_ptr, s_stride, s_value, b, S_PTR)
            loss = loss * sigma * sigma
        if MEAN:
            total += loss
        else:
            tl.store(out_ptr + b, loss)
    if MEAN:
        tl.store(out_ptr, total / B)


@triton.jit
def _fm_bwd_kernel(v_ptr, x0_ptr, eps_ptr, s_ptr, s_stride, s_value, S_PTR: tl.constexpr, gout_ptr, gout_stride,
                   dv_ptr, N, scale, X0_SPACE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    coef = 2.0 * scale * tl.load(gout_ptr + b * gout_stride).to(tl.float32)  # 2 w_n grad_out_n / N (mean: / B)
    if X0_SPACE:
        sigma = load_scalar(s_ptr, s_stride, s_value, b, S_PTR)
        coef = coef * sigma * sigma
    v = tl.load(v_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    eps = tl.load(eps_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    # d/dv_pred [w mean(d^2)] = 2 w d / N
    tl.store(dv_ptr + base + offs, (coef * (v - (eps - x0))).to(dv_ptr.dtype.element_ty), mask=mask)


@kernel_op("flow_matching_fwd")
def _fwd_triton(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma: Optional[torch.Tensor],
                sigma_value: float, x0_space: bool, mean: bool) -> torch.Tensor:
    v2 = flat(v_pred)
    B, N = v2.shape
    block = block_for(N)
    nb = triton.cdiv(N, block)
    part = torch.empty((B, nb), dtype=torch.float32, device=v_pred.device)
    out = torch.empty(() if mean else (B,), dtype=torch.float32, device=v_pred.device)
    wrap_triton(_fm_fwd_kernel)[(nb, B)](v2, flat(x0), flat(eps), part, N, nb, BLOCK=block,
                                         num_warps=num_warps_for(block))
    wrap_triton(_fm_final_kernel)[(1,)](part, *scalar_args(sigma, sigma_value, part), out, B, nb, 1.0 / N,
                                        X0_SPACE=x0_space, MEAN=mean,
                                        BLOCK=min(FINAL_BLOCK, max(16, triton.next_power_of_2(nb))), num_warps=4)
    return out


@kernel_op("flow_matching_bwd")
def _bwd_triton(grad_out: torch.Tensor, v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor,
                sigma: Optional[torch.Tensor], sigma_value: float, x0_space: bool) -> torch.Tensor:
    v2 = flat(v_pred)
    B, N = v2.shape
    dv = torch.empty_like(v2)
    block = block_for(N)
    mean = grad_out.dim() == 0  # the gradient of the batch mean: grad_out / B for every sample
    wrap_triton(_fm_bwd_kernel)[(triton.cdiv(N, block), B)](
        v2, flat(x0), flat(eps), *scalar_args(sigma, sigma_value, v2), grad_out, 0 if mean else grad_out.stride(0),
        dv, N, 1.0 / (N * B) if mean else 1.0 / N, X0_SPACE=x0_space, BLOCK=block, num_warps=num_warps_for(block))
    return dv.view(v_pred.shape)


def _setup_triton(ctx, inputs, output):
    v_pred, x0, eps, sigma, ctx.sigma_value, ctx.x0_space, _ = inputs
    ctx.save_for_backward(v_pred, x0, eps, sigma)


def _backward_triton(ctx, grad_out):
    v_pred, x0, eps, sigma = ctx.saved_tensors
    grad_v = None
    if ctx.needs_input_grad[0]:
        grad_v = _bwd_triton(grad_out, v_pred, x0, eps, sigma, ctx.sigma_value, ctx.x0_space)
    return grad_v, None, None, None, None, None, None


_fwd_triton.register_autograd(_backward_triton, setup_context=_setup_triton)


def _fwd_torch(v_pred, x0, eps, sigma, x0_space, mean):
    """Autograd through mse_loss against the target (which needs no gradient): its backward is one op,
    2 (v_pred - target) grad / N, times the weights."""
    cd = compute_dtype(v_pred.dtype)
    target = eps.to(cd) - x0.to(cd)
    if mean and not x0_space:
        return F.mse_loss(v_pred.to(cd), target)
    loss = F.mse_loss(v_pred.to(cd), target, reduction="none").reshape(v_pred.shape[0], -1).mean(1)
    if x0_space:
        loss = loss * (sigma * sigma if isinstance(sigma, float) else sigma.to(cd).square())
    return loss.mean() if mean else loss


def flow_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma,
                       space: str = "velocity", impl: str | None = None, reduction: str = "none") -> torch.Tensor:
    """Flow-matching loss in ``space`` "velocity" or "x0", differentiable in v_pred: per sample [B], or its batch
    mean (0-dim) with ``reduction="mean"`` (computed inside the op: no further launch forward or backward)."""
    check_same(v_pred, "v_pred", x0=x0, eps=eps)
    if space not in SPACES:
        raise KernelError(f"space={space!r}: expected 'velocity' or 'x0'")
    if reduction not in REDUCTIONS:
        raise KernelError(f"reduction={reduction!r}: expected 'none' or 'mean'")
    if torch.is_grad_enabled() and (x0.requires_grad or eps.requires_grad):
        raise KernelError("flow_matching_loss differentiates v_pred only: x0 and eps are targets, "
                          "pass them detached")
    impl = resolve_impl(impl, v_pred, op="flow_matching")
    s = per_sample(sigma, v_pred.shape[0], v_pred.device, "sigma")
    if impl == "triton":
        return _fwd_triton(v_pred, x0, eps, *scalar_parts(s), space == "x0", reduction == "mean")
    return _fwd_torch(v_pred, x0, eps, s, space == "x0", reduction == "mean")


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
