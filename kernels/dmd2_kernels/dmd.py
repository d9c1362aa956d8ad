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
Triton (the custom op ``torch.ops.dmd2.dmd_loss``, backward ``dmd2.dmd_loss_bwd``): two launches, deterministic
(every sum is taken in a fixed order; atomics only count arrivals):
  1. grid (P, B), P <= about the device's program budget / B: program p adds |x0hat - x0_real| over its chunk of
     row b -> part [B, P]; program (0, 0) also zeroes the arrival counter of launch 2;
  2. grid (ceil(N / BLOCK), B): each program first adds the P partials of its row, in index order (every program of
     the row gets the same norm_b; program 0 stores it), then writes the partial sum of grad^2 over its tile and
     takes a ticket (an atomic add on the counter, after a barrier that orders its store before it); the program
     that draws the last ticket adds all the grad^2 partials in index order -> loss and grad_rms.
  P is capped so that re-reading the P partials costs each program of launch 2 little next to its tile.
Triton backward = one elementwise pass recomputing grad from (x0_fake, x0_real, norm) rather than storing it: two
reads in place of a float32 write + read, and no extra memory between forward and backward. Allocations: forward one
float32 buffer (norm and the partials) and the two 0-dim outputs, backward the gradient.
Torch path (float32 inputs): 10 aten ops forward (norm: sub, abs, mean; grad: sub, div, nan_to_num; loss and rms:
square, mean, mul, sqrt), 2 backward (the forward keeps grad, a float32 [B, ...] tensor: grad_out / (B N) and one
multiply); 16-bit inputs add their casts and a clamp to the dtype's range.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import (bcast, block_for, check_same, compute_dtype, finfo_max, flat, kernel_op, num_warps_for,
                     program_budget, resolve_impl, wrap_triton)

PASSES = {"fwd": 4, "fwd+bwd": 7}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): the forward is two
passes of two reads (x0hat and x0_real for the normaliser, then x0_fake and x0_real for the DMD gradient); with a
backward the forward also writes that gradient, which the backward reads before writing grad_x0hat (4 + 1 + 2).
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["dmd_loss", "dmd_loss_ref", "DMDLossFunction", "DMDStats"]

FINAL_BLOCK = 1024  # partials added per step by the program that draws the last ticket


class DMDStats(NamedTuple):
    norm: torch.Tensor  # [B] per-sample normaliser mean_n |x0hat - x0_real|
    grad_rms: torch.Tensor  # 0-dim, sqrt(mean(grad^2)) over the whole batch


@triton.jit
def _dmd_grad(fake, real, norm, FMAX: tl.constexpr):
    g = tl.math.div_rn(fake - real, norm)
    g = tl.where(g != g, 0.0, g)  # nan_to_num: NaN -> 0
    return tl.minimum(tl.maximum(g, -FMAX), FMAX)  # +-Inf and overflow of the dtype -> +-max


@triton.jit
def _dmd_norm_kernel(x_ptr, real_ptr, part_ptr, count_ptr, N, P, CHUNK, BLOCK: tl.constexpr):
    """Program (p, b): sum of |x - real| over elements [p CHUNK, (p + 1) CHUNK) of row b -> part[b, p]."""
    p = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    base = b * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(p * CHUNK, tl.minimum((p + 1) * CHUNK, N), BLOCK):  # CHUNK is a multiple of BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        real = tl.load(real_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.abs(x - real)  # masked lanes: |0 - 0| = 0
    tl.store(part_ptr + b * P + p, tl.sum(acc, axis=0))
    if (p == 0) & (b == 0):
        tl.store(count_ptr, 0)  # launch 2's arrival counter starts at zero (launches run in stream order)


@triton.jit
def _dmd_fwd_kernel(real_ptr, fake_ptr, part_ptr, sq_ptr, count_ptr, norm_ptr, loss_ptr, rms_ptr, N, P, NB,
                    inv_n, inv_numel, FMAX: tl.constexpr, BLOCK: tl.constexpr, P_BLOCK: tl.constexpr,
                    FINAL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    B = tl.num_programs(1)
    # norm_b: the row's P partials of launch 1, added in index order (the same value in every program of the row)
    poffs = tl.arange(0, P_BLOCK)
    norm = tl.sum(tl.load(part_ptr + b * P + poffs, mask=poffs < P, other=0.0), axis=0) * inv_n
    if pid == 0:
        tl.store(norm_ptr + b, norm)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    base = b * N
    real = tl.load(real_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    fake = tl.load(fake_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(mask, _dmd_grad(fake, real, norm, FMAX), 0.0)
    tl.store(sq_ptr + b * NB + pid, tl.sum(g * g, axis=0))
    tl.debug_barrier()  # every thread's part of the store above happens before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")  # release: this program's partial; acquire: all others'
    if ticket == NB * B - 1:  # the last program to arrive: all NB * B partials are written
        total = NB * B
        acc = tl.zeros((FINAL,), dtype=tl.float32)
        for start in range(0, total, FINAL):
            o = start + tl.arange(0, FINAL)
            acc += tl.load(sq_ptr + o, mask=o < total, other=0.0, cache_modifier=".cg")
        mean_sq = tl.sum(acc, axis=0) * inv_numel
        tl.store(loss_ptr, 0.5 * mean_sq)
        tl.store(rms_ptr, tl.sqrt_rn(mean_sq))


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


def _split(B: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """Launch 1's programs per row P, elements per program CHUNK (a multiple of BLOCK), and BLOCK."""
    block = block_for(N)
    tiles = triton.cdiv(N, block)
    P = max(1, min(tiles, program_budget(device) // B))
    chunk = triton.cdiv(tiles, P) * block
    return triton.cdiv(N, chunk), chunk, block


@kernel_op("dmd_loss")
def _fwd_triton(x0hat: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x2, r2, f2 = flat(x0hat), flat(x0_real), flat(x0_fake)
    B, N = x2.shape
    P, chunk, block = _split(B, N, x2.device)
    nb = triton.cdiv(N, block)
    # one float32 buffer: norm [B] (returned; a view of it), launch 1's partials [B, P], launch 2's [B, nb], counter
    buf = torch.empty(B + B * P + B * nb + 1, dtype=torch.float32, device=x2.device)
    norm, part, sq = buf[:B], buf[B:B + B * P], buf[B + B * P:-1]
    count = buf[-1:].view(torch.int32)
    loss, rms = torch.empty((), dtype=torch.float32, device=x2.device), torch.empty((), dtype=torch.float32,
                                                                                    device=x2.device)
    warps = num_warps_for(block)
    wrap_triton(_dmd_norm_kernel)[(P, B)](x2, r2, part, count, N, P, chunk, BLOCK=block, num_warps=warps)
    wrap_triton(_dmd_fwd_kernel)[(nb, B)](r2, f2, part, sq, count, norm, loss, rms, N, P, nb, 1.0 / N, 1.0 / (B * N),
                                          FMAX=finfo_max(x0hat.dtype), BLOCK=block,
                                          P_BLOCK=max(16, triton.next_power_of_2(P)),
                                          FINAL=min(FINAL_BLOCK, max(16, triton.next_power_of_2(B * nb))),
                                          num_warps=warps)
    return loss, norm, rms


@kernel_op("dmd_loss_bwd")
def _bwd_triton(grad_out: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor, norm: torch.Tensor
                ) -> torch.Tensor:
    r2, f2 = flat(x0_real), flat(x0_fake)
    B, N = r2.shape
    block = block_for(N)
    dx = torch.empty_like(r2)
    wrap_triton(_dmd_bwd_kernel)[(triton.cdiv(N, block), B)](r2, f2, norm, grad_out, dx, N, 1.0 / (B * N),
                                                            FMAX=finfo_max(x0_real.dtype), BLOCK=block,
                                                            num_warps=num_warps_for(block))
    return dx.view(x0_real.shape)


def _setup_triton(ctx, inputs, output):
    _, x0_real, x0_fake = inputs
    ctx.save_for_backward(x0_real, x0_fake, output[1])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero tensors for the gradients of norm and grad_rms, which are unused


def _backward_triton(ctx, grad_loss, _grad_norm, _grad_rms):
    x0_real, x0_fake, norm = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0] and grad_loss is not None:
        grad_x = _bwd_triton(grad_loss, x0_real, x0_fake, norm)
    return grad_x, None, None


_fwd_triton.register_autograd(_backward_triton, setup_context=_setup_triton)


def _grad_torch(x0_real, x0_fake, norm, dtype):
    cd, fmax = compute_dtype(dtype), finfo_max(dtype)
    g = torch.nan_to_num_(torch.div(x0_fake.to(cd) - x0_real.to(cd), bcast(norm, x0_real)),
                          nan=0.0, posinf=fmax, neginf=-fmax)
    # values beyond a 16-bit dtype's range (finite in float32) -> +-max, as nan_to_num in that dtype does
    return g if finfo_max(cd) == fmax else g.clamp_(-fmax, fmax)


class DMDLossFunction(torch.autograd.Function):
    """The torch path: (loss, norm, grad_rms) of the DMD surrogate; only loss is differentiable, in x0hat only."""

    @staticmethod
    def forward(ctx, x0hat, x0_real, x0_fake):
        cd = compute_dtype(x0hat.dtype)
        norm = (x0hat.to(cd) - x0_real.to(cd)).abs_().reshape(x0hat.shape[0], -1).mean(1)
        g = _grad_torch(x0_real, x0_fake, norm, x0hat.dtype)
        mean_sq = g.square().mean()
        ctx.save_for_backward(g)
        ctx.x_dtype = x0hat.dtype
        loss, rms = mean_sq * 0.5, mean_sq.sqrt()
        ctx.mark_non_differentiable(norm, rms)
        ctx.set_materialize_grads(False)  # no zero tensors for the gradients of norm and grad_rms, which are unused
        return loss, norm, rms

    @staticmethod
    def backward(ctx, grad_loss, _grad_norm, _grad_rms):
        (g,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            # d/dx [0.5 * mean((x - stopgrad(x - grad))^2)] = grad / numel
            grad_x = torch.mul(g, grad_loss.to(g.dtype) / g.numel()).to(ctx.x_dtype)
        return grad_x, None, None


def dmd_loss(x0hat: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor,
             impl: str | None = None) -> tuple[torch.Tensor, DMDStats]:
    """DMD surrogate loss (0-dim) and its DMDStats; differentiable in x0hat (see module docstring)."""
    check_same(x0hat, "x0hat", x0_real=x0_real, x0_fake=x0_fake)
    impl = resolve_impl(impl, x0hat, op="dmd")
    if impl == "triton":
        loss, norm, rms = _fwd_triton(x0hat, x0_real.detach(), x0_fake.detach())
    else:
        loss, norm, rms = DMDLossFunction.apply(x0hat, x0_real.detach(), x0_fake.detach())
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
