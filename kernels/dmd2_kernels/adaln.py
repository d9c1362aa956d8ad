"""LayerNorm (no affine) + adaLN modulation of a DiT block, forward and backward.

x [B, ..., H] (T = all middle dims flattened, so rows are [B, T, H]); shift, scale [B, H] (or any
[B, 1, ..., H] layout with B * H elements). Per row r of sample b, over the hidden dim H:
  mean_r = mean(x_r),  rstd_r = 1 / sqrt(var(x_r) + eps)     (biased variance, eps = 1e-6 as in DiT)
  xhat   = (x - mean_r) * rstd_r
  y      = xhat * (1 + scale_b) + shift_b
Backward with dy = grad_out, wdy = dy * (1 + scale_b), means over H:
  dx       = rstd_r * (wdy - mean(wdy) - xhat * mean(wdy * xhat))
  dscale_b = sum over the T rows of dy * xhat,   dshift_b = sum over the T rows of dy
Output in the dtype of x; gradients in the dtypes of their inputs; arithmetic in float32.
Triton: forward tiles [ROWS, BLOCK_H] of one sample per program and saves mean, rstd [B * T]
float32; backward gives each program a contiguous chunk of one sample's rows, writes dx and
per-chunk partial dscale / dshift [B, chunks, H] float32, summed over chunks in torch. The Triton path is the custom
op ``torch.ops.dmd2.adaln_modulate`` (backward ``dmd2.adaln_modulate_bwd``): torch.compile traces through it.
Hidden sizes that are not a power of two (DiT-XL's 1152) are TILED, not padded: padding 1152 to 2048
leaves 44% of the lanes idle, so `_tile` halves BLOCK_H until at most 1/8 of the lanes of the
ceil(H / BLOCK_H) column tiles are idle (1152: 5 tiles of 256). A row then takes several tiles: the
forward reads x in three sweeps over its tiles (sum -> mean, centred squares -> rstd, then y), the
backward in two (the row sums c1, c2, then dx and the dscale / dshift partials, which each program
accumulates in its own slice of the partial buffer). The extra sweeps re-read a [ROWS, H] block the
program has just read (cache-resident); a power-of-two H keeps the one-tile kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import KernelError, compute_dtype, kernel_op, program_budget, resolve_impl, wrap_triton

PASSES = {"fwd": 2, "fwd+bwd": 5}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): forward reads x and
writes y (shift / scale [B, H] ignored); backward reads x and dy and writes dx.
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["adaln_modulate", "adaln_modulate_ref", "AdaLNModulateFunction"]

TILE = 4096  # elements per [ROWS, BLOCK_H] tile


@triton.jit
def _adaln_fwd_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, T, H, eps,
                      ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < T
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    row_idx = b * T + rows.to(tl.int64)
    offs = row_idx[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / H
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / H + eps)
    shift = tl.load(shift_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row_idx, mean, mask=rmask)
    tl.store(rstd_ptr + row_idx, rstd, mask=rmask)


@triton.jit
def _adaln_bwd_kernel(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dscale_ptr, dshift_ptr,
                      T, H, rows_per_prog, NC, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    scale = tl.load(scale_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_dscale = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_dshift = tl.zeros((BLOCK_H,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, T)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        row_idx = b * T + rows.to(tl.int64)
        offs = row_idx[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row_idx, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + row_idx, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * (1.0 + scale[None, :])  # d y / d xhat = 1 + scale
        c1 = tl.sum(xhat * wdy, axis=1) / H
        c2 = tl.sum(wdy, axis=1) / H
        # d xhat_j / d x_i = rstd (delta_ij - 1/H - xhat_i xhat_j / H)
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_dscale += tl.sum(dy * xhat, axis=0)  # d y / d scale = xhat
        acc_dshift += tl.sum(dy, axis=0)  # d y / d shift = 1
    part = (b * NC + pid) * H + cols
    tl.store(dscale_ptr + part, acc_dscale, mask=cmask)
    tl.store(dshift_ptr + part, acc_dshift, mask=cmask)


@triton.jit
def _adaln_fwd_tiled_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, T, H, eps,
                            ROWS: tl.constexpr, BLOCK_H: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < T
    row_idx = b * T + rows.to(tl.int64)
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for c in range(TILES):  # sweep 1: the row sums
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (cols < H)[None, :]
        acc += tl.sum(tl.load(x_ptr + row_idx[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32), 1)
    mean = acc / H
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for c in range(TILES):  # sweep 2: the centred squares (two-pass variance, as in the one-tile kernel)
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + row_idx[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        acc += tl.sum(xc * xc, 1)
    rstd = tl.math.rsqrt(acc / H + eps)
    for c in range(TILES):  # sweep 3: y
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = rmask[:, None] & cmask[None, :]
        offs = row_idx[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
        y = (x - mean[:, None]) * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row_idx, mean, mask=rmask)
    tl.store(rstd_ptr + row_idx, rstd, mask=rmask)


@triton.jit
def _bwd_tile_terms(x_ptr, dy_ptr, scale_ptr, b, row_idx, rmask, mean, rstd, c, H, BLOCK_H: tl.constexpr):
    """Column tile c of the rows `row_idx`: (cols, cmask, mask, offs, dy, xhat, wdy = dy (1 + scale))."""
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    offs = row_idx[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * H + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return cols, cmask, mask, offs, dy, xhat, dy * (1.0 + scale[None, :])


@triton.jit
def _adaln_bwd_tiled_kernel(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dscale_ptr, dshift_ptr,
                            T, H, rows_per_prog, NC, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                            TILES: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, T)
    part = (b * NC + pid) * H  # this program's slice of the partials (zeroed by the caller)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < row_end
        row_idx = b * T + rows.to(tl.int64)
        mean = tl.load(mean_ptr + row_idx, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + row_idx, mask=rmask, other=0.0)
        c1 = tl.zeros((ROWS,), dtype=tl.float32)
        c2 = tl.zeros((ROWS,), dtype=tl.float32)
        for c in range(TILES):  # sweep 1: c1 = mean(xhat * wdy), c2 = mean(wdy) over the row
            _, _, _, _, _, xhat, wdy = _bwd_tile_terms(x_ptr, dy_ptr, scale_ptr, b, row_idx, rmask, mean, rstd,
                                                       c, H, BLOCK_H)
            c1 += tl.sum(xhat * wdy, 1)
            c2 += tl.sum(wdy, 1)
        c1 = c1 / H
        c2 = c2 / H
        for c in range(TILES):  # sweep 2: dx, and the dscale / dshift partials of these rows
            cols, cmask, mask, offs, dy, xhat, wdy = _bwd_tile_terms(x_ptr, dy_ptr, scale_ptr, b, row_idx, rmask,
                                                                     mean, rstd, c, H, BLOCK_H)
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            ds = tl.load(dscale_ptr + part + cols, mask=cmask, other=0.0)
            tl.store(dscale_ptr + part + cols, ds + tl.sum(dy * xhat, axis=0), mask=cmask)
            dh = tl.load(dshift_ptr + part + cols, mask=cmask, other=0.0)
            tl.store(dshift_ptr + part + cols, dh + tl.sum(dy, axis=0), mask=cmask)


def _tile(H: int):
    """(rows per tile, BLOCK_H, warps, column tiles per row): BLOCK_H is the next power of two of H, halved
    while more than 1/8 of the lanes of the ceil(H / BLOCK_H) tiles would be idle (module docstring)."""
    block_h = triton.next_power_of_2(H)
    while block_h > 16 and triton.cdiv(H, block_h) * block_h - H > H // 8:
        block_h //= 2
    tiles = triton.cdiv(H, block_h)
    rows = max(1, min(128, TILE // block_h))
    warps = 16 if rows * block_h >= 16384 else (8 if rows * block_h >= 2048 else 4)
    return rows, block_h, warps, tiles


@kernel_op("adaln_modulate")
def _fwd_triton(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats [2, B * T] float32: mean and rstd per row)."""
    B, H = shift.shape
    T = x.numel() // (B * H)
    x = x.contiguous()
    y = torch.empty_like(x)
    stats = torch.empty((2, B * T), dtype=torch.float32, device=x.device)
    rows, block_h, warps, tiles = _tile(H)
    grid = (triton.cdiv(T, rows), B)
    if tiles == 1:
        wrap_triton(_adaln_fwd_kernel)[grid](x, shift, scale, y, stats[0], stats[1], T, H, eps,
                                             ROWS=rows, BLOCK_H=block_h, num_warps=warps)
    else:
        wrap_triton(_adaln_fwd_tiled_kernel)[grid](x, shift, scale, y, stats[0], stats[1], T, H, eps,
                                                   ROWS=rows, BLOCK_H=block_h, TILES=tiles, num_warps=warps)
    return y, stats


@kernel_op("adaln_modulate_bwd")
def _bwd_triton(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, stats: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dshift, dscale); dshift and dscale in float32."""
    B, H = scale.shape
    T = x.numel() // (B * H)
    x, dy = x.contiguous(), dy.contiguous()
    rows, block_h, warps, tiles = _tile(H)
    chunks = max(1, min(triton.cdiv(T, rows), triton.cdiv(program_budget(x.device), B)))
    rows_per_prog = triton.cdiv(triton.cdiv(T, chunks), rows) * rows
    chunks = triton.cdiv(T, rows_per_prog)
    dx = torch.empty_like(x)
    if tiles == 1:
        part = torch.empty((2, B, chunks, H), dtype=torch.float32, device=x.device)
        wrap_triton(_adaln_bwd_kernel)[(chunks, B)](x, scale, dy, stats[0], stats[1], dx, part[0], part[1], T, H,
                                                    rows_per_prog, chunks, ROWS=rows, BLOCK_H=block_h,
                                                    num_warps=warps)
    else:  # the tiled kernel accumulates into its partials
        part = torch.zeros((2, B, chunks, H), dtype=torch.float32, device=x.device)
        wrap_triton(_adaln_bwd_tiled_kernel)[(chunks, B)](x, scale, dy, stats[0], stats[1], dx, part[0], part[1], T,
                                                          H, rows_per_prog, chunks, ROWS=rows, BLOCK_H=block_h,
                                                          TILES=tiles, num_warps=warps)
    return dx, part[1].sum(1), part[0].sum(1)


def _setup_triton(ctx, inputs, output):
    x, _, scale, _ = inputs
    ctx.save_for_backward(x, scale, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero tensor for the gradient of the saved statistics


def _backward_triton(ctx, grad_out, _grad_stats):
    x, scale, stats = ctx.saved_tensors
    dx, dshift, dscale = _bwd_triton(grad_out, x, scale, stats)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dshift.to(scale.dtype) if need[1] else None,
            dscale.to(scale.dtype) if need[2] else None, None)


_fwd_triton.register_autograd(_backward_triton, setup_context=_setup_triton)


def _fwd_torch(x, shift, scale, eps):
    B, H = shift.shape
    cd = compute_dtype(x.dtype)
    x3 = x.to(cd).reshape(B, -1, H)
    xhat, mean, rstd = torch.native_layer_norm(x3, (H,), None, None, eps)
    y = torch.addcmul(shift.to(cd)[:, None], xhat, 1.0 + scale.to(cd)[:, None])
    return y.to(x.dtype).view(x.shape), mean, rstd


def _bwd_torch(dy, x, scale, mean, rstd):
    B, H = scale.shape
    cd = compute_dtype(x.dtype)
    x3, dy3 = x.to(cd).reshape(B, -1, H), dy.to(cd).reshape(B, -1, H)
    dscale = (x3 - mean).mul_(rstd).mul_(dy3).sum(1)  # sum_t xhat * dy
    wdy = dy3 * (1.0 + scale.to(cd)[:, None])
    # dx = rstd * (wdy - mean(wdy) - xhat * mean(wdy * xhat)): ATen's LayerNorm backward of wdy
    dx = torch.ops.aten.native_layer_norm_backward(wdy, x3, (H,), mean, rstd, None, None, [True, False, False])[0]
    return dx.view(x.shape), dscale, dy3.sum(1)


class AdaLNModulateFunction(torch.autograd.Function):
    """The torch path: layer_norm(x) * (1 + scale) + shift with shift, scale [B, H]; differentiable in all three."""

    @staticmethod
    def forward(ctx, x, shift, scale, eps):
        y, mean, rstd = _fwd_torch(x, shift, scale, eps)
        ctx.save_for_backward(x, scale, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, scale, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift = _bwd_torch(grad_out, x, scale, mean, rstd)
        need = ctx.needs_input_grad
        return (dx.to(x.dtype) if need[0] else None, dshift.to(scale.dtype) if need[1] else None,
                dscale.to(scale.dtype) if need[2] else None, None)


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                   impl: str | None = None) -> torch.Tensor:
    """``layer_norm(x) * (1 + scale) + shift`` over the last dim, per-sample shift/scale [B, H]."""
    if x.dim() < 2 or x.numel() == 0:
        raise KernelError(f"x must be a non-empty [B, ..., H] tensor, got shape {tuple(x.shape)}")
    B, H = x.shape[0], x.shape[-1]
    for name, t in (("shift", shift), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or t.numel() != B * H or t.shape[0] != B or t.shape[-1] != H:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelError(f"{name} must be [B, H] = [{B}, {H}] (or [B, 1, ..., H]), got {got}")
        if t.device != x.device:
            raise KernelError(f"{name} is on {t.device}, expected {x.device} (the device of x)")
    if shift.dtype != scale.dtype:
        raise KernelError(f"shift ({shift.dtype}) and scale ({scale.dtype}) must share a dtype")
    impl = resolve_impl(impl, x, shift, scale, op="adaln")
    shift, scale = shift.reshape(B, H), scale.reshape(B, H)
    if impl == "triton":  # the kernels read rows of H: contiguous [B, H]
        return _fwd_triton(x, shift.contiguous(), scale.contiguous(), float(eps))[0]
    # the torch path takes the views (a chunk of a block's modulation): no copy; the view it saves for backward keeps
    # that modulation alive (counted so by models/wan/plan.py)
    return AdaLNModulateFunction.apply(x, shift, scale, float(eps))


def adaln_modulate_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Pure-torch reference as a DiT block writes it (F.layer_norm, then modulate): the baseline."""
    B, H = x.shape[0], x.shape[-1]
    cd = compute_dtype(x.dtype)
    view = (B,) + (1,) * (x.dim() - 2) + (H,)
    y = F.layer_norm(x.to(cd), (H,), eps=eps) * (1 + scale.to(cd).reshape(view)) + shift.to(cd).reshape(view)
    return y.to(x.dtype)
