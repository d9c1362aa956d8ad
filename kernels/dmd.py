"""DMD gradient normalisation and surrogate loss (tianweiy/DMD2 ``sd_guidance.py`` semantics).

Over the N elements of sample n (x0hat from the student, x0_real from the guided teacher, x0_fake
from the critic; all [B, ...] of one dtype):
  norm_n = mean_n |x0hat - x0_real|                            (per-sample, no epsilon)
  grad   = nan_to_num((x0_fake - x0_real) / norm_n)            (NaN -> 0, +-Inf -> +-max)
  loss   = 0.5 * mean(grad^2)  = the value of 0.5 * mse(x0hat, (x0hat - grad).detach())
  d loss / d x0hat = grad * grad_out / (B * N)                 (norm and grad are constants, as
                                                                under torch.no_grad in DMD2)
nan_to_num works in the INPUT dtype (the dtype DMD2 computes grad in): NaN -> 0, and +-Inf or a
value beyond the dtype's range -> +-finfo(dtype).max, so the gradient handed to autograd is finite.
Arithmetic in float32. x0_real and x0_fake receive no gradient.
Returns (loss, stats): loss a 0-dim float32 tensor; stats = DMDStats(norm [B] float32, grad_rms
0-dim float32 = sqrt(mean(grad^2))), both from the same passes as the loss.
Triton, two passes over [B, N] with grid (ceil(N / BLOCK), B), each followed by a one-program-
per-row sum of its [B, ceil(N / BLOCK)] float32 partials (deterministic, no atomics):
  pass 1 (reduction):   partial sums of |x0hat - x0_real|                   -> norm [B];
  pass 2 (elementwise): grad from (x0_fake, x0_real, norm), partial sums of grad^2 -> loss, rms.
Backward recomputes grad elementwise from (x0_fake, x0_real, norm) rather than storing it: two
reads in place of a float32 write + read, and no extra memory between forward and backward.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._reduce import row_sum
from ._utils import bcast, block_for, check_same, compute_dtype, finfo_max, flat, num_warps_for, resolve_impl

__all__ = ["dmd_loss", "dmd_loss_ref", "DMDLossFunction", "DMDStats"]


class DMDStats(NamedTuple):
    norm: torch.Tensor  # [B] per-sample normaliser mean_n |x0hat - x0_real|
    grad_rms: torch.Tensor  # 0-dim, sqrt(mean(grad^2)) over the whole batch


@triton.jit
def _dmd_grad(fake, real, norm, FMAX: tl.constexpr):
    g = tl.math.div_rn(fake - real, norm)
    g = tl.where(g != g, 0.0, g)  # nan_to_num: NaN -> 0
    return tl.minimum(tl.maximum(g, -FMAX), FMAX)  # +-Inf and overflow of the dtype -> +-max


@triton.jit
def _dmd_norm_kernel(x_ptr, real_ptr, part_ptr, N, NB, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    real = tl.load(real_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + b * NB + pid, tl.sum(tl.abs(x - real), axis=0))


@triton.jit
def _dmd_fwd_kernel(real_ptr, fake_ptr, norm_ptr, part_ptr, N, NB, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    norm = tl.load(norm_ptr + b)
    real = tl.load(real_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    fake = tl.load(fake_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(mask, _dmd_grad(fake, real, norm, FMAX), 0.0)
    tl.store(part_ptr + b * NB + pid, tl.sum(g * g, axis=0))


@triton.jit
def _dmd_finalize_kernel(part_ptr, loss_ptr, rms_ptr, NT, inv_numel, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, NT, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < NT, other=0.0)
    mean_sq = tl.sum(acc, axis=0) * inv_numel
    tl.store(loss_ptr, 0.5 * mean_sq)
    tl.store(rms_ptr, tl.sqrt(mean_sq))


@triton.jit
def _dmd_bwd_kernel(real_ptr, fake_ptr, norm_ptr, gout_ptr, dx_ptr, N, inv_numel, FMAX: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    norm = tl.load(norm_ptr + b)
    scale = tl.load(gout_ptr).to(tl.float32) * inv_numel  # grad_out / (B * N)
    real = tl.load(real_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    fake = tl.load(fake_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    # d/dx [0.5 * mean((x - stopgrad(x - grad))^2)] = grad / numel
    dx = _dmd_grad(fake, real, norm, FMAX) * scale
    tl.store(dx_ptr + base + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch(n: int):
    block = block_for(n)
    return block, triton.cdiv(n, block), num_warps_for(block)


def _fwd_triton(x0hat, x0_real, x0_fake):
    x2, r2, f2 = flat(x0hat), flat(x0_real), flat(x0_fake)
    B, N = x2.shape
    block, nb, warps = _launch(N)
    part = torch.empty((2, B, nb), dtype=torch.float32, device=x0hat.device)
    _dmd_norm_kernel[(nb, B)](x2, r2, part[0], N, nb, BLOCK=block, num_warps=warps)
    norm = row_sum(part[0], 1.0 / N)
    _dmd_fwd_kernel[(nb, B)](r2, f2, norm, part[1], N, nb, FMAX=finfo_max(x0hat.dtype), BLOCK=block,
                             num_warps=warps)
    loss, rms = (torch.empty((), dtype=torch.float32, device=x0hat.device) for _ in range(2))
    _dmd_finalize_kernel[(1,)](part[1], loss, rms, B * nb, 1.0 / (B * N),
                               BLOCK=max(16, min(1024, triton.next_power_of_2(B * nb))), num_warps=4)
    return loss, norm, rms


def _bwd_triton(grad_out, x0_real, x0_fake, norm, dtype):
    r2, f2 = flat(x0_real), flat(x0_fake)
    B, N = r2.shape
    block, nb, warps = _launch(N)
    dx = torch.empty(r2.shape, dtype=dtype, device=r2.device)
    _dmd_bwd_kernel[(nb, B)](r2, f2, norm, grad_out, dx, N, 1.0 / (B * N), FMAX=finfo_max(dtype), BLOCK=block,
                             num_warps=warps)
    return dx.view(x0_real.shape)


def _grad_torch(x0_real, x0_fake, norm, dtype):
    cd, fmax = compute_dtype(dtype), finfo_max(dtype)
    g = (x0_fake.to(cd) - x0_real.to(cd)) / bcast(norm, x0_real)
    return torch.nan_to_num_(g, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax)


def _fwd_torch(x0hat, x0_real, x0_fake):
    cd = compute_dtype(x0hat.dtype)
    norm = (x0hat.to(cd) - x0_real.to(cd)).abs_().reshape(x0hat.shape[0], -1).mean(1)
    mean_sq = _grad_torch(x0_real, x0_fake, norm, x0hat.dtype).square_().mean()
    return 0.5 * mean_sq, norm, mean_sq.sqrt()


def _bwd_torch(grad_out, x0_real, x0_fake, norm, dtype):
    g = _grad_torch(x0_real, x0_fake, norm, dtype)
    return (g * (grad_out.to(g.dtype) / g.numel())).to(dtype)


class DMDLossFunction(torch.autograd.Function):
    """(loss, norm, grad_rms) of the DMD surrogate; only loss is differentiable, in x0hat only."""

    @staticmethod
    def forward(ctx, x0hat, x0_real, x0_fake, impl):
        loss, norm, rms = (_fwd_triton if impl == "triton" else _fwd_torch)(x0hat, x0_real, x0_fake)
        ctx.save_for_backward(x0_real, x0_fake, norm)
        ctx.impl, ctx.dtype = impl, x0hat.dtype
        ctx.mark_non_differentiable(norm, rms)
        return loss, norm, rms

    @staticmethod
    def backward(ctx, grad_loss, _grad_norm, _grad_rms):
        x0_real, x0_fake, norm = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (_bwd_triton if ctx.impl == "triton" else _bwd_torch)(grad_loss, x0_real, x0_fake, norm,
                                                                           ctx.dtype)
        return grad_x, None, None, None


def dmd_loss(x0hat: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor,
             impl: str | None = None) -> tuple[torch.Tensor, DMDStats]:
    """DMD surrogate loss (0-dim) and its DMDStats; differentiable in x0hat (see module docstring)."""
    check_same(x0hat, "x0hat", x0_real=x0_real, x0_fake=x0_fake)
    impl = resolve_impl(impl, x0hat, x0_real, x0_fake, op="dmd")
    loss, norm, rms = DMDLossFunction.apply(x0hat, x0_real.detach(), x0_fake.detach(), impl)
    return loss, DMDStats(norm, rms)


def dmd_loss_ref(x0hat: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor
                 ) -> tuple[torch.Tensor, DMDStats]:
    """Pure-torch reference in DMD2's own form (grad under no_grad, mse against a detached target)."""
    cd, fmax = compute_dtype(x0hat.dtype), finfo_max(x0hat.dtype)
    x = x0hat.to(cd).reshape(x0hat.shape[0], -1)
    with torch.no_grad():
        p_real = x - x0_real.to(cd).reshape(x.shape)
        p_fake = x - x0_fake.to(cd).reshape(x.shape)
        norm = p_real.abs().mean(1, keepdim=True)
        grad = torch.nan_to_num((p_real - p_fake) / norm, posinf=fmax, neginf=-fmax)
    loss = 0.5 * F.mse_loss(x, (x - grad).detach())
    return loss, DMDStats(norm.reshape(-1), grad.square().mean().sqrt())
