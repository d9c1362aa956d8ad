"""Query/key RMSNorm across all heads + interleaved rotary embedding (Wan's ``WanAttention``), TP-aware.

x [B, S, HL] with HL = local_heads * D (D = head_dim, even); weight [HL] (this rank's slice of the
RMSNorm weight); cos, sin [S, D/2] float32, or both None (no rotary: cross-attention). Under tensor
parallelism each of the G ranks of ``group`` holds a contiguous block of heads, so the full hidden
is H = HL * G and the norm's sum of squares spans every rank. Per row r = (b, s):
  ss_r   = sum_c x_rc^2  over the local HL columns, then all-reduced (SUM) over ``group`` if G > 1
  rstd_r = 1 / sqrt(ss_r / H + eps)
  z      = x * rstd_r * weight                         (torch.nn.RMSNorm(H) over all heads)
  y      = rotate(z): per head h and pair j in [0, D/2), columns e = h D + 2j, o = e + 1:
           y_e = z_e cos[s, j] - z_o sin[s, j],   y_o = z_e sin[s, j] + z_o cos[s, j]
           (diffusers' ``x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)`` convention; no rotary: y = z)
Backward, given dy (rotation R = [[c, -s], [s, c]] is orthogonal, so d/dz = R^T dy):
  dz_e = dy_e cos + dy_o sin,   dz_o = -dy_e sin + dy_o cos
  u = x * rstd,  du = dz * weight,  dweight = sum over rows of dz * u   (the local slice)
  c_r = sum over the FULL hidden of du * u: the local row sum, all-reduced (SUM) over ``group``
  dx  = rstd * (du - u * c_r / H)          (d u_j / d x_i = rstd (delta_ij - u_i u_j / H))
cos, sin get no gradient. Output in x's dtype, dweight in weight's dtype, arithmetic in float32;
the forward saves rstd [B * S] float32. Two small collectives: one [B * S] float32 all-reduce in the
forward, one in the backward; none when G = 1 (group None or torch.distributed not initialised).
Triton (the custom op ``torch.ops.dmd2.qk_norm_rope``, backward ``dmd2.qk_norm_rope_bwd``: torch.compile traces
through them; the group goes in by name and the all-reduce is a functional collective, which a trace records):
each direction is two kernels with the all-reduce between them.
  forward  pass 1 (rows):  ss [B * S];  pass 2 (rows x column tiles): rstd, y
  backward pass 1 (rows):  c partial [B * S];  pass 2 (row chunks x column tiles): dx and per-chunk
           partial dweight [chunks, HL] float32, summed over chunks in torch (no atomics)
Pairs: a tile is loaded as a contiguous [ROWS, BLOCK] block (vectorised loads), viewed as
[ROWS, BLOCK / 2, 2] with ``tl.reshape``, and ``tl.split`` yields its even / odd halves [ROWS, BLOCK / 2];
``tl.join`` + ``tl.reshape`` re-interleave the rotated halves for the store. Column tiles never
straddle a pair (BLOCK and HL are even); a non-power-of-two HL (1536, 3072, 5120) takes BLOCK halved
from the next power of two until at most 1/8 of the lanes are idle (1536: 3 tiles of 512), as in
adaln.py. The Triton path makes x contiguous first (a strided q view of a fused qkv projection is copied); the
torch path takes it as it is.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import KernelError, compute_dtype, kernel_op, program_budget, resolve_impl, wrap_triton

PASSES = {"fwd": 3, "fwd+bwd": 8}
"""Bytes the fused op must move, in units of N s (N elements of s bytes each; [B] tensors ignored): the two-pass
kernels' traffic (the TP all-reduce of the row sums sits between the passes): forward reads x twice and writes y;
backward reads x and dy twice and writes dx (a one-pass kernel's minimum would be 2 and 5; the [S, D / 2] cos / sin
tables are ignored).
benchmarks/bench_kernels.py divides them by the measured time for GB/s and % of copy bandwidth."""

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "QKNormRopeFunction"]

TILE = 4096  # elements per [ROWS, BLOCK] tile


@triton.jit
def _col_tile(rows, rmask, t, HL, BLOCK: tl.constexpr):
    """Columns [BLOCK] of column tile t, their mask, and the [ROWS, BLOCK] offsets / mask of the rows."""
    cols = t * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < HL
    return cols, cmask, rows[:, None] * HL + cols[None, :], rmask[:, None] & cmask[None, :]


@triton.jit
def _rotate(t, cos_ptr, sin_ptr, rows, rmask, tile, S, HL, HALF, ROWS: tl.constexpr, BLOCK: tl.constexpr,
            INVERSE: tl.constexpr):
    """Rotate the interleaved pairs (t[:, 2j], t[:, 2j + 1]) of t [ROWS, BLOCK] (column tile `tile`) by
    the angle of (cos, sin)[s, j % HALF], or by its opposite (R^T) if INVERSE: the [ROWS, BLOCK / 2, 2]
    view is split into its even / odd halves [ROWS, BLOCK / 2] and re-joined after."""
    j = tile * (BLOCK // 2) + tl.arange(0, BLOCK // 2)  # local pair index; pair j % HALF of its head
    offs = (rows % S)[:, None] * HALF + (j % HALF)[None, :]
    mask = rmask[:, None] & (2 * j < HL)[None, :]
    c = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    te, to = tl.split(tl.reshape(t, (ROWS, BLOCK // 2, 2)))
    # (e, o) -> (e cos - o sin, e sin + o cos)
    return tl.reshape(tl.join(te * c - to * s, te * s + to * c), (ROWS, BLOCK))


@triton.jit
def _sumsq_kernel(x_ptr, ss_ptr, N, HL, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for t in range(0, tl.cdiv(HL, BLOCK)):
        _, _, offs, mask = _col_tile(rows, rmask, t, HL, BLOCK)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    tl.store(ss_ptr + rows, acc, mask=rmask)


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, ss_ptr, rstd_ptr, y_ptr, N, S, HL, HALF, inv_h, eps,
                ROWS: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    pid_c = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    cols, cmask, offs, mask = _col_tile(rows, rmask, pid_c, HL, BLOCK)
    rstd = tl.math.rsqrt(tl.load(ss_ptr + rows, mask=rmask, other=0.0) * inv_h + eps)
    if pid_c == 0:  # one column tile saves rstd for the backward
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    z = x * rstd[:, None] * w[None, :]
    if ROPE:
        z = _rotate(z, cos_ptr, sin_ptr, rows, rmask, pid_c, S, HL, HALF, ROWS, BLOCK, False)
    tl.store(y_ptr + offs, z.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rowsum_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, dy_ptr, rstd_ptr, c_ptr, N, S, HL, HALF,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for t in range(0, tl.cdiv(HL, BLOCK)):
        cols, cmask, offs, mask = _col_tile(rows, rmask, t, HL, BLOCK)
        dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ROPE:  # dz = R^T dy
            dz = _rotate(dz, cos_ptr, sin_ptr, rows, rmask, t, S, HL, HALF, ROWS, BLOCK, True)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.sum(dz * w[None, :] * x, axis=1)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    tl.store(c_ptr + rows, acc * rstd, mask=rmask)  # local part of c = sum du * u = rstd sum dz w x


@triton.jit
def _bwd_dx_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, dy_ptr, rstd_ptr, c_ptr, dx_ptr, dw_ptr, N, S, HL, HALF,
                   inv_h, rows_per_prog, ROWS: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    pid = tl.program_id(0)
    pid_c = tl.program_id(1)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, N)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < HL, other=0.0).to(tl.float32)
    acc_dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS).to(tl.int64)
        rmask = rows < row_end
        _, _, offs, mask = _col_tile(rows, rmask, pid_c, HL, BLOCK)
        dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ROPE:  # dz = R^T dy
            dz = _rotate(dz, cos_ptr, sin_ptr, rows, rmask, pid_c, S, HL, HALF, ROWS, BLOCK, True)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        c = tl.load(c_ptr + rows, mask=rmask, other=0.0) * inv_h
        u = x * rstd[:, None]
        du = dz * w[None, :]  # d z / d u = weight
        # d u_j / d x_i = rstd (delta_ij - u_i u_j / H)
        dx = rstd[:, None] * (du - u * c[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_dw += tl.sum(dz * u, axis=0)  # d z / d weight = u
    tl.store(dw_ptr + pid.to(tl.int64) * HL + cols, acc_dw, mask=cols < HL)


def _tile(HL: int):
    """(rows per tile, BLOCK columns, warps): BLOCK is the next power of two of HL, halved while more
    than 1/8 of the lanes of the ceil(HL / BLOCK) column tiles would be idle (module docstring)."""
    block = triton.next_power_of_2(HL)
    while block > 16 and triton.cdiv(HL, block) * block - HL > HL // 8:
        block //= 2
    rows = max(1, min(128, TILE // block))
    warps = 8 if rows * block >= 2048 else 4
    return rows, block, warps


def _world(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, group, G: int) -> torch.Tensor:
    """The torch path's in-place SUM over ``group`` (nothing when G = 1)."""
    if G > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _all_reduce_named(t: torch.Tensor, group_name: str, G: int) -> torch.Tensor:
    """The Triton path's SUM over the process group named ``group_name``: a functional collective (a custom op
    takes a group by name, and a trace of the op records the collective)."""
    if G == 1:
        return t
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, "sum", group_name))


@kernel_op("qk_norm_rope")
def _fwd_triton(x: torch.Tensor, w: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], S: int,
                D: int, eps: float, group_name: str, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [N, HL], rstd [N] float32) of x [N, HL] (N = B * S rows)."""
    N, HL = x.shape
    rows, block, warps = _tile(HL)
    ss = torch.empty(N, dtype=torch.float32, device=x.device)
    wrap_triton(_sumsq_kernel)[(triton.cdiv(N, rows),)](x, ss, N, HL, ROWS=rows, BLOCK=block, num_warps=warps)
    ss = _all_reduce_named(ss, group_name, G)
    rstd, y = torch.empty_like(ss), torch.empty_like(x)
    rope = cos is not None
    grid = (triton.cdiv(N, rows), triton.cdiv(HL, block))
    wrap_triton(_fwd_kernel)[grid](x, w, cos if rope else x, sin if rope else x, ss, rstd, y, N, S, HL, D // 2,
                                   1.0 / (HL * G), eps, ROWS=rows, BLOCK=block, ROPE=rope, num_warps=warps)
    return y, rstd


@kernel_op("qk_norm_rope_bwd")
def _bwd_triton(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor], rstd: torch.Tensor, S: int, D: int, group_name: str, G: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [N, HL], dweight [HL] float32)."""
    N, HL = x.shape
    dy = dy.contiguous()
    rows, block, warps = _tile(HL)
    rope = cos is not None
    cos, sin = (cos, sin) if rope else (x, x)
    c = torch.empty(N, dtype=torch.float32, device=x.device)
    wrap_triton(_bwd_rowsum_kernel)[(triton.cdiv(N, rows),)](x, w, cos, sin, dy, rstd, c, N, S, HL, D // 2,
                                                             ROWS=rows, BLOCK=block, ROPE=rope, num_warps=warps)
    c = _all_reduce_named(c, group_name, G)
    col_tiles = triton.cdiv(HL, block)
    chunks = max(1, min(triton.cdiv(N, rows), triton.cdiv(program_budget(x.device), col_tiles)))
    rows_per_prog = triton.cdiv(triton.cdiv(N, chunks), rows) * rows
    chunks = triton.cdiv(N, rows_per_prog)
    dx = torch.empty_like(x)
    part = torch.empty((chunks, HL), dtype=torch.float32, device=x.device)
    wrap_triton(_bwd_dx_kernel)[(chunks, col_tiles)](x, w, cos, sin, dy, rstd, c, dx, part, N, S, HL, D // 2,
                                                     1.0 / (HL * G), rows_per_prog, ROWS=rows, BLOCK=block, ROPE=rope,
                                                     num_warps=warps)
    return dx, part.sum(0)


def _setup_triton(ctx, inputs, output):
    x, weight, cos, sin, *ctx.args = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero tensor for the gradient of the saved statistics


def _backward_triton(ctx, grad_out, _grad_rstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    S, head_dim, _, group_name, G = ctx.args
    dx, dw = _bwd_triton(grad_out, x, weight, cos, sin, rstd, S, head_dim, group_name, G)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw.to(weight.dtype) if need[1] else None) + (None,) * 7


_fwd_triton.register_autograd(_backward_triton, setup_context=_setup_triton)


def _rotate_torch(t, cos, sin, S, D):
    """Rotate the interleaved pairs of t [B * S, HL] (float32 / float64) by (cos, sin) [S, D/2]; per head, in t's
    dtype. Eager: each pair a complex number times cos + i sin, one complex multiply (2 launches instead of the 7 of
    four products, a sum, a difference and a stack). Under torch.compile: the real products, which inductor fuses
    into one kernel (it generates no code for complex operators)."""
    N, HL = t.shape
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    if not torch.compiler.is_compiling():
        pairs = torch.view_as_complex(t.reshape(N // S, S, HL // D, D // 2, 2))
        return torch.view_as_real(pairs * torch.complex(c, s)[None, :, None]).view(N, HL)
    te, to = t.view(N // S, S, HL // D, D // 2, 2).unbind(-1)
    c, s = c[None, :, None], s[None, :, None]
    return torch.stack((te * c - to * s, te * s + to * c), -1).view(N, HL)


def _fwd_torch(x, w, cos, sin, S, D, eps, group, G):
    HL = x.shape[1]
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    ss = _all_reduce(xf.square().sum(1), group, G)
    rstd = torch.rsqrt(ss / (HL * G) + eps)
    z = xf * rstd[:, None] * w.to(cd)
    y = z if cos is None else _rotate_torch(z, cos, sin, S, D)
    return y.to(x.dtype), rstd


def _bwd_torch(dy, x, w, cos, sin, rstd, S, D, group, G):
    HL = x.shape[1]
    cd = compute_dtype(x.dtype)
    dz = dy.to(cd)
    if cos is not None:
        dz = _rotate_torch(dz, cos, -sin, S, D)  # R^T dy: rotation by the opposite angle
    u = x.to(cd) * rstd[:, None]
    du = dz * w.to(cd)
    c = _all_reduce((du * u).sum(1), group, G)
    dx = rstd[:, None] * (du - u * (c / (HL * G))[:, None])
    return dx, (dz * u).sum(0)


class QKNormRopeFunction(torch.autograd.Function):
    """The torch path: rotate(rms_norm over all TP ranks' heads (x) * weight) with x [B * S, HL]; differentiable in
    x and weight."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, S, head_dim, eps, group):
        G = _world(group)
        y, rstd = _fwd_torch(x, weight, cos, sin, S, head_dim, eps, group, G)
        ctx.save_for_backward(x, weight, cos, sin, rstd)
        ctx.args = (S, head_dim, group, G)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        S, head_dim, group, G = ctx.args
        dx, dw = _bwd_torch(grad_out.contiguous(), x, weight, cos, sin, rstd, S, head_dim, group, G)
        need = ctx.needs_input_grad
        return (dx.to(x.dtype) if need[0] else None, dw.to(weight.dtype) if need[1] else None,
                None, None, None, None, None, None)


def _check(x, weight, cos, sin, head_dim):
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.numel() == 0:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelError(f"x must be a non-empty [B, S, heads * head_dim] tensor, got {got}")
    B, S, HL = x.shape
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise KernelError(f"head_dim must be a positive even int (rotary pairs), got {head_dim!r}")
    if HL % head_dim:
        raise KernelError(f"the last dim of x ({HL}) must be a multiple of head_dim ({head_dim})")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (HL,):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise KernelError(f"weight must be [HL] = [{HL}] (this rank's slice of the RMSNorm weight), got {got}")
    if (cos is None) != (sin is None):
        raise KernelError("cos and sin must be given both (rotary) or neither (no rotary)")
    for name, t in (("weight", weight), ("cos", cos), ("sin", sin)):
        if t is None:
            continue
        if name != "weight":
            if tuple(t.shape) != (S, head_dim // 2) or not t.is_floating_point():
                raise KernelError(f"{name} must be a float [S, head_dim // 2] = [{S}, {head_dim // 2}] tensor, "
                                  f"got {tuple(t.shape)} {t.dtype}")
            if t.requires_grad and torch.is_grad_enabled():
                raise KernelError(f"{name} must not require grad: the rotary tables are constants")
        if t.device != x.device:
            raise KernelError(f"{name} is on {t.device}, expected {x.device} (the device of x)")


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 head_dim: int, eps: float = 1e-6, group=None, impl: str | None = None) -> torch.Tensor:
    """RMSNorm of x [B, S, HL] over the full hidden (all ranks of ``group``) times weight [HL], then the
    interleaved rotary embedding of each head with cos, sin [S, head_dim // 2] (none if both are None)."""
    _check(x, weight, cos, sin, head_dim)
    B, S, HL = x.shape
    if cos is not None:
        cos = cos.detach().to(torch.float32).contiguous()
        sin = sin.detach().to(torch.float32).contiguous()
    impl = resolve_impl(impl, x, weight, op="qk_norm_rope")
    x2 = x.reshape(B * S, HL)
    if impl == "triton":
        G = _world(group)
        y = _fwd_triton(x2.contiguous(), weight.contiguous(), cos, sin, S, head_dim, float(eps),
                        group.group_name if G > 1 else "", G)[0]
    else:
        y = QKNormRopeFunction.apply(x2, weight, cos, sin, S, head_dim, float(eps), group)
    return y.view(B, S, HL)


def qk_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     head_dim: int, eps: float = 1e-6) -> torch.Tensor:
    """Eager reference for G = 1 as diffusers' WanAttention writes it (RMSNorm over all heads, then per
    head ``x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)`` and the strided stores): the baseline."""
    cd = compute_dtype(x.dtype)
    z = F.rms_norm(x.to(cd), (x.shape[-1],), weight.to(cd), eps)
    if cos is None:
        return z.to(x.dtype)
    q = z.unflatten(-1, (-1, head_dim))  # [B, S, heads, D]
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos.to(cd)[None, :, None], sin.to(cd)[None, :, None]
    out = torch.empty_like(q)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.flatten(-2).to(x.dtype)
