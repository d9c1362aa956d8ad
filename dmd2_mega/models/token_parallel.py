"""Context and sequence parallelism: how one forward splits a sample's S tokens over ranks.

Context parallelism (CP, `--context-parallel-size C`, megatron-core's CP group): each CP rank holds one
contiguous chunk of the token sequence from the patch embedding to the output projection. Self-attention
needs every token, so it exchanges heads for sequence with an all-to-all (Ulysses): the local q / k / v
[B, S/C, H, d] become [B, S, H/C, d], attention runs over the full sequence for H/C heads, and the inverse
all-to-all brings [B, S/C, H, d] back. Under TP the H heads are already TP's share, so TP x CP must divide
the heads. Cross-attention needs no exchange: the text is replicated on every rank. Rotary tables are sliced
at each chunk's global offset.

Sequence parallelism (SP, `--sequence-parallel`, Megatron's, inside the TP group): between the matmuls the
chunk is split again over the TP ranks, so LayerNorm, modulation, gates and residual adds hold S / (C x TP)
tokens. Column-parallel linears all-gather their input along the sequence and keep only the local part (the
backward gathers it again, and reduce-scatters the input gradient), and a row-parallel one reduce-scatters its
output (backward: all-gather), in place of the all-reduces TP makes.

Padding: any S works. The sequence is padded with zero tokens to a multiple of C (x TP under SP). The pad
sits at the end of the last chunk, so after the all-to-all it is the tail of the full sequence and attention
drops it by slicing keys, values and queries to the S real tokens (no mask, so flash kernels still apply).
The output gather strips it (the velocity's and the token grid of `features`); no loss ever sees it.

Gradients: every CP rank computes the same loss on the same gathered output, so the gather's backward keeps
this rank's slice, and each weight's gradient on a CP rank is the part from its own tokens; the gradient
buffer sums them over DP x CP (and divides by DP). Under SP, per-sample tensors entering the sharded region
(the timestep embedding and modulation) go through `enter_sp` (identity; backward all-reduce over TP), and
the replicated parameters used only inside it (modulation tables, row-parallel biases, the cross-attention
LayerNorm, the patch embedding and output projection) carry `sequence_parallel = True` (megatron-core's
attribute), whose gradients the buffer all-reduces over TP (`grad_buffer.GradBuffer`).

With C = 1 and no SP every function here is the identity and nothing is communicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu


def _gather_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """All-gather [B, s, ...] along dim 1 over `group` -> [B, size * s, ...] (rank order)."""
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (size, x.shape[0])).transpose(0, 1).flatten(1, 2)


def _reduce_scatter_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Sum [B, size * s, ...] over `group` and keep this rank's chunk [B, s, ...] of dim 1."""
    parts = x.unflatten(1, (size, -1)).transpose(0, 1).contiguous()  # [size, B, s, ...]
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, parts.flatten(0, 1), group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, s, H, d] (this rank's tokens, all heads) -> [B, size * s, H / size, d] (all tokens, head group rank)."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j -> rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's tokens, my head group
    return recv.transpose(0, 1).reshape(b, size * s, h // size, d)


def _heads_to_seq(y: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [B, size * s, H / size, d] -> [B, s, H, d]."""
    b, n, hc, d = y.shape
    send = y.reshape(b, size, n // size, hc, d).transpose(0, 1).contiguous()  # token chunk j -> rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: my tokens, head group i
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // size, size * hc, d)


class _Adjoint(torch.autograd.Function):
    """y = fwd(x, group, size) whose gradient is bwd(dy, group, size): the sequence <-> heads all-to-alls are each
    other's adjoint, as are the reduce-scatter and the all-gather along the sequence."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, group, size):
        ctx.bwd, ctx.group, ctx.size = bwd, group, size
        return fwd(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g.contiguous(), ctx.group, ctx.size), None, None, None, None


class _GatheredLinears(torch.autograd.Function):
    """SP column-parallel linears on one input: y_i = gather(x) W_i^T + b_i, keeping only this rank's x. The
    backward gathers x again for the weights' gradients and reduce-scatters the summed input gradient once
    (Megatron's sequence-parallel column linear: the gathered input is never kept for backward)."""

    @staticmethod
    def forward(ctx, x, group, size, *weights_and_biases):
        ctx.group, ctx.size = group, size
        ctx.save_for_backward(x, *weights_and_biases[::2])
        ctx.has_bias = [b is not None for b in weights_and_biases[1::2]]
        full = _gather_seq(x, group, size)
        return tuple(F.linear(full, w, b) for w, b in zip(weights_and_biases[::2], weights_and_biases[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = _gather_seq(x, ctx.group, ctx.size).flatten(0, -2)
        gx, out = None, []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias):
            gx = g.matmul(w) if gx is None else gx + g.matmul(w)
            g2 = g.flatten(0, -2)
            out += [g2.t().matmul(full), g2.sum(0) if has_bias else None]
        return (_reduce_scatter_seq(gx, ctx.group, ctx.size), None, None, *out)


class _GatherOutput(torch.autograd.Function):
    """The output gather: every rank of the group goes on with the same full tensor (and the same loss), so the
    backward keeps this rank's slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.rank, ctx.n = rank, x.shape[1]
        return _gather_seq(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None, None


class _IdentitySum(torch.autograd.Function):
    """A replicated tensor entering the sequence-sharded region: identity; backward all-reduce sum (each TP rank's
    gradient is the part from its tokens). megatron-core's `copy_to_tensor_model_parallel_region`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


@dataclass(frozen=True)
class TokenSplit:
    """The split of one forward's `tokens` real tokens: `cp` CP ranks x `sp` SP (TP) ranks; see the module
    docstring. `TokenSplit(tokens)` is the unsplit identity."""

    tokens: int
    cp: int = 1
    cp_rank: int = 0
    sp: int = 1
    sp_rank: int = 0

    @classmethod
    def current(cls, tokens: int, context_parallel: int, sequence_parallel: bool) -> "TokenSplit":
        """This rank's split under megatron-core's groups (`context_parallel` must be the CP group's size)."""
        cp_rank = mpu.get_context_parallel_rank() if context_parallel > 1 else 0
        sp = mpu.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        sp_rank = mpu.get_tensor_model_parallel_rank() if sp > 1 else 0
        return cls(tokens, context_parallel, cp_rank, sp, sp_rank)

    @property
    def padded(self) -> int:
        parts = self.cp * self.sp
        return -(-self.tokens // parts) * parts

    @property
    def cp_tokens(self) -> int:
        """Tokens of one CP chunk (padding included): what the matmuls and attention's queries see."""
        return self.padded // self.cp

    @property
    def local_tokens(self) -> int:
        """Tokens this rank holds between the matmuls (a CP chunk, split again over TP under SP)."""
        return self.cp_tokens // self.sp

    @property
    def _start(self) -> int:
        """This rank's first token in the padded sequence (CP chunk, then its SP part)."""
        return (self.cp_rank * self.sp + self.sp_rank) * self.local_tokens

    @property
    def _cp_group(self):
        return mpu.get_context_parallel_group()

    @property
    def _sp_group(self):
        return mpu.get_tensor_model_parallel_group()

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        extra = self.padded - self.tokens
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra)) if extra else t

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a full [B, S, ...] tensor that no gradient flows back into (the patches)."""
        if self.cp == self.sp == 1:
            return t
        # a copy: a view would keep every token of the padded tensor alive for backward
        return self._pad(t)[:, self._start:self._start + self.local_tokens].contiguous()

    def cp_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This CP chunk's rows of a per-token table [S, ...] (rotary cos / sin), padded with the last row."""
        if self.padded == self.tokens and self.cp == 1:
            return t
        extra = self.padded - self.tokens
        t = torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]) if extra else t
        return t[self.cp_rank * self.cp_tokens:(self.cp_rank + 1) * self.cp_tokens]

    def local_index(self, device=None) -> torch.Tensor:
        """The sequence index of each token this rank holds [local_tokens] (int64), padding as the last real token:
        which row of a per-token table each local token reads."""
        idx = torch.arange(self._start, self._start + self.local_tokens, device=device)
        return idx.clamp_(max=self.tokens - 1)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[B, local, ...] -> the full [B, S, ...] on every rank (SP, then CP), padding stripped."""
        if self.sp > 1:
            t = _GatherOutput.apply(t, self._sp_group, self.sp, self.sp_rank)
        if self.cp > 1:
            t = _GatherOutput.apply(t, self._cp_group, self.cp, self.cp_rank)
        return t[:, :self.tokens] if self.padded != self.tokens else t

    def enter_sp(self, t: torch.Tensor) -> torch.Tensor:
        """A replicated tensor used by the SP-sharded tokens (module docstring); the identity without SP."""
        return _IdentitySum.apply(t, self._sp_group) if self.sp > 1 else t

    def sp_linears(self, x: torch.Tensor, *linears) -> tuple:
        """Column-parallel linears (`linears.column`) on this rank's tokens x [B, local, D] -> outputs on the CP
        chunk [B, cp_tokens, out / TP]: under SP one all-gather, the gathered input not kept for backward (a linear's
        LoRA adapter, `models/lora.py`, included: its A is one more matmul on the gathered input)."""
        if self.sp == 1:
            return tuple(lin(x) for lin in linears)
        adapted = [lin for lin in linears if lin.lora is not None]  # a LoRA's A rides in the gathered matmuls
        params = [t for lin in linears for t in (lin.weight, lin.bias)]
        params += [t for lin in adapted for t in (lin.lora.A, None)]
        out = _GatheredLinears.apply(x, self._sp_group, self.sp, *params)
        if not adapted:
            return out
        down = iter(out[len(linears):])
        return tuple(y if lin.lora is None else y + lin.lora.up(next(down)) for y, lin in zip(out, linears))

    def sp_reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[B, cp_tokens, D] partial sums -> [B, local, D] reduced: a row-parallel linear's output under SP."""
        return _Adjoint.apply(y, _reduce_scatter_seq, _gather_seq, self._sp_group, self.sp) if self.sp > 1 else y

    def attention_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Self-attention's q / k / v [B, cp_tokens, H, d] -> [B, S, H / C, d]: all real tokens, this rank's heads."""
        if self.cp == 1:
            return t[:, :self.tokens] if self.padded != self.tokens else t
        return _Adjoint.apply(t, _seq_to_heads, _heads_to_seq, self._cp_group, self.cp)[:, :self.tokens]

    def attention_tokens(self, o: torch.Tensor) -> torch.Tensor:
        """The inverse of `attention_heads` for the attention output: [B, S, H / C, d] -> [B, cp_tokens, H, d]."""
        o = self._pad(o)
        return _Adjoint.apply(o, _heads_to_seq, _seq_to_heads, self._cp_group, self.cp) if self.cp > 1 else o
