"""fp32 gradient buffers and the data-parallel gradient reduction (Megatron's `main_grad`), in place of torch DDP.

Every trainable parameter p gets `p.main_grad`, an fp32 view into ONE persistent flat buffer per model,
whatever p's dtype, and `p.grad` IS that view, bound once here and for good. With `p.grad` defined and grad mode off
in the backward (any backward without create_graph), autograd's AccumulateGrad adds each backward's gradient into
it IN PLACE (`p.grad += g`), so with M micro-batches

    main_grad = sum_j fp32(g_j)           (g_j: micro-batch j's gradient, in p's dtype: bf16 under --bf16)

is accumulated in fp32 by autograd itself: no hook, no Python call and no launch of ours per parameter or per
backward. A bf16 parameter's `.grad` is fp32 (torch's grad setter insists on p's dtype, so the view is bound while
p's data is swapped for it; autograd never checks it again, and `fp32 += bf16` promotes), so each g_j is added
exactly, one fp32 rounding per add: M bf16 roundings of the g_j summed in fp32, not M roundings of a running bf16
sum (torch DDP on a bf16 model accumulates and all-reduces in bf16). This is the very `main_grad.add_(g_j)` the
per-parameter hook of before made, now made by autograd: the same bits, no transient `.grad`, no model-dtype
gradient buffer. Nothing may set `p.grad = None` (`model.zero_grad()`): the next backward would then steal its
gradient into a fresh `.grad` and main_grad would miss it; `zero()` (the optimizer's `zero_grad`) zeroes in place.
A backward with create_graph=True would do the same (autograd's out-of-place sum); none is run on a trained role.
`bound()` checks the binding; `check_in_place_accumulation`, run once per device and dtype as a buffer is
built, that this torch accumulates in place.

DP reduction: the buffer is cut into buckets of whole parameters, in reverse registration order (roughly the order
backward produces them). `finish()` (`optim.Optimizer.step` calls it) reduces what the backwards outside `no_sync()`
left: every bucket is scaled by 1 / `average_over` (one kernel over the buffer) and all-reduced (SUM, fp32) over the
DP group, all buckets launched asynchronously, then waited for. A parameter without a gradient keeps a zero
main_grad, as DDP would. Whether a synchronising backward ran is read from the buffer's version counter (autograd's
in-place adds into its views bump it; `no_sync()` records it as it exits; so does any other in-place change, e.g.
the optimizer's clip, which is why the trainers zero after each step): no hook and no host sync. Unlike DDP (and
Megatron with --overlap-grad-reduce) the reduction does not overlap the backward: it starts once the backward is
done. Megatron's default (overlap off) does the same; what is gained is no Python call per parameter in the
backward (Wan 1.3B: 825 parameter tensors, each backward).

Sharded (`shard=True`, the distributed optimizer `dist_optim.DistributedOptimizer`): each bucket is padded
with zeros to a multiple of DP and cut into DP equal shards; the bucket's reduction is a reduce-scatter in
place (Megatron's), after which rank r's shard `shard_range(b)` holds the DP mean of its elements and the
rest of the bucket holds this rank's own, unreduced values. Only the shard's owner reads it.

Context parallelism: the weights are replicated over DP x CP, and each CP rank's gradient is the part from its
own tokens, so the group is DP x CP and the SUM is divided by DP only (`average_over`); a parameter tagged
`whole_over_cp` (`parallel.mark_whole_over_cp`: the GAN head) has the whole gradient on each CP rank and is
divided by CP first (one foreach division). Sequence parallelism: a parameter tagged `sequence_parallel`
(`parallel.mark_sequence_parallel`) holds the part from this TP rank's tokens (and a LoRA adapter's replicated
factor, tagged `tp_partial_grad`, the part from this rank's slice of its other factor: `parallel.sums_over_tp`);
`finish()` all-reduces those main_grads over the TP group first, all of them in one message (gathered, reduced,
copied back), before the DP reduction (TP sum and DP mean commute, and the no_sync micro-batches are in main_grad
already). Per element the arithmetic is that of before: TP sum, / CP, / DP, DP sum.

Memory: one fp32 copy of the trainable parameters (4 bytes each), in place of DDP's grads + buckets in
the model dtype; there is no other gradient tensor.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_mega.distributed.parallel import sums_over_tp

# elements per DP bucket (fp32): Megatron's default size, 40 M
BUCKET_ELEMENTS = 40_000_000


@torch.no_grad()
def bind_grad(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` (fp32, p's shape) p's `.grad`, whatever p's dtype; a gradient p already holds is carried into it.
    torch's setter refuses a grad of another dtype, so for a bf16 / fp16 p the view is bound while p's data IS the
    view, and p's own data is put back (its storage, hence every alias of it, is unchanged)."""
    if p.grad is not None and p.grad is not view:
        view.add_(p.grad)
    if p.dtype == view.dtype:
        p.grad = view
        return
    data = p.data
    p.data = view
    p.grad = view
    p.data = data


@functools.lru_cache(maxsize=None)
def check_in_place_accumulation(device: str, dtype: torch.dtype) -> None:
    """Once per (device, dtype): autograd adds a `dtype` parameter's gradient into its bound fp32 `.grad` view in
    place (what the buffer rests on: module docstring); raise if this torch does not."""
    p = torch.zeros(2, dtype=dtype, device=device, requires_grad=True)
    base = torch.zeros(4, dtype=torch.float32, device=device)
    bind_grad(p, base[1:3])
    view = p.grad
    with torch.enable_grad():
        (p * 3).sum().backward()
        (p * 3).sum().backward()
    if p.grad is not view or base.tolist() != [0.0, 6.0, 6.0, 0.0]:
        raise RuntimeError(f"GradBuffer: torch {torch.__version__} does not accumulate a {dtype} parameter's "
                           f"gradient into its fp32 .grad in place on {device}; the gradient buffer needs it")


class GradBuffer:
    """fp32 `main_grad` (= `.grad`) of every trainable parameter of `model`, reduced over `dp_group` (see module
    docstring).

    dp_group: the data-parallel group, or None (or a group of one) for no reduction.
    bucket_elements: the size of one all-reduce (whole parameters; a larger parameter is its own bucket).
    shard: reduce-scatter each bucket (padded to a multiple of DP) instead of all-reducing it, for the
    distributed optimizer; `shard_range(b)` is this rank's part of bucket b, `offsets` / `regions` the layout.
    average_over: the reduced sum is divided by this (default: the group's size; DP when the group is DP x CP).
    tp_group: the TP group, over which `sequence_parallel` parameters' gradients are summed.
    """

    def __init__(self, model: torch.nn.Module, dp_group=None, bucket_elements: int = BUCKET_ELEMENTS,
                 shard: bool = False, average_over: Optional[int] = None, tp_group=None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("GradBuffer: the model has no trainable parameters")
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None and dist.is_initialized() else 1
        self.dp_group = dp_group if self.dp_size > 1 else None
        self.dp_rank = dist.get_rank(dp_group) if self.dp_group is not None else 0
        self.average_over = average_over if average_over is not None else self.dp_size
        self.shard = shard
        tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        self.tp_group = tp_group if tp > 1 else None
        self._cp = cp = self.dp_size // self.average_over  # the group is DP x CP
        device = self.params[0].device
        for dtype in {p.dtype for p in self.params}:
            check_in_place_accumulation(str(device), dtype)
        self.buckets: list[list[int]] = [[]]  # parameter indices per bucket
        self.bucket_of: list[int] = [0] * len(self.params)
        filled = 0
        for i in reversed(range(len(self.params))):  # the last registered parameter is first in the buffer's tail
            n = self.params[i].numel()
            if filled and filled + n > bucket_elements:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(i)
            self.bucket_of[i] = len(self.buckets) - 1
            filled += n
        pad = self.dp_size if shard else 1  # sharded: each bucket's size is a multiple of DP (zero padding at its end)
        sizes = [-(-sum(self.params[i].numel() for i in b) // pad) * pad for b in self.buckets]
        self.buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self.regions: list[tuple[int, int]] = []
        """(start, size) in `buffer` of each bucket, padding included."""
        self.offsets: list[int] = [0] * len(self.params)
        """Element offset of each parameter's main_grad in `buffer`."""
        end = self.buffer.numel()
        for b, size in zip(self.buckets, sizes):
            start = end - size
            self.regions.append((start, size))
            offset = start
            for i in reversed(b):  # ascending registration order within the bucket
                p = self.params[i]
                p.main_grad = self.buffer[offset:offset + p.numel()].view(p.shape)
                bind_grad(p, p.main_grad)
                self.offsets[i] = offset
                offset += p.numel()
            end = start
        self._views = [self.buffer.narrow(0, start, size) for start, size in self.regions]
        # the main_grads finish() reduces over TP (1-D) and divides by CP
        self._tp_sums = [p.main_grad.view(-1) for p in self.params if sums_over_tp(p)] if self.tp_group else []
        self._tp_sizes = [t.numel() for t in self._tp_sums]
        self._whole = [p.main_grad for p in self.params if getattr(p, "whole_over_cp", False)] if cp > 1 else []
        self._syncing = True
        self._pending = False  # a synchronising backward ran before the current no_sync() block
        self._settled = self.buffer._version  # the version when nothing was left to reduce

    def shard_range(self, b: int) -> tuple[int, int]:
        """(start, end) in `buffer` of this DP rank's shard of bucket b (`shard`: the elements whose reduced
        gradient this rank receives and whose optimizer state it owns); the whole bucket without sharding."""
        start, size = self.regions[b]
        if not self.shard:
            return start, start + size
        n = size // self.dp_size
        return start + self.dp_rank * n, start + (self.dp_rank + 1) * n

    def bound(self) -> bool:
        """Whether every parameter's `.grad` is still its main_grad (one Python check per parameter: not per step)."""
        return all(p.grad is p.main_grad for p in self.params)

    def _settle(self) -> None:
        self._settled, self._pending = self.buffer._version, False

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate (the micro-batches before the last): `finish()` reduces only when a
        backward ran outside."""
        outer = self._syncing
        if outer:
            self._pending = self._pending or self.buffer._version != self._settled
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = outer
            if outer:
                self._settled = self.buffer._version

    def _reduce(self, b: int):
        view = self._views[b]
        if self.shard:  # in place: this rank's shard of the bucket receives the reduced sum; the rest is stale
            start, end = self.shard_range(b)
            return dist.reduce_scatter_single(self.buffer[start:end], view, group=self.dp_group, async_op=True)
        return dist.all_reduce(view, group=self.dp_group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce what the backwards outside `no_sync()` accumulated since the last `finish()` / `zero()` (TP sums,
        / CP, DP mean; module docstring); a no-op without DP and TP sums, or after `no_sync` backwards only."""
        if self.dp_group is None and not self._tp_sums:
            return
        if not (self._pending or self.buffer._version != self._settled):
            return
        if self._tp_sums:  # one message: the parts of this TP rank's tokens summed over TP
            flat = torch.cat(self._tp_sums)
            dist.all_reduce(flat, group=self.tp_group)
            torch._foreach_copy_(self._tp_sums, list(flat.split(self._tp_sizes)))
        if self._whole:  # whole on every CP rank: the DP x CP sum counts it CP times
            torch._foreach_div_(self._whole, self._cp)
        if self.dp_group is not None:
            self.buffer.div_(self.average_over)  # every bucket, padding included (zeros)
            for work in [self._reduce(b) for b in range(len(self.buckets))]:
                work.wait()
        self._settle()

    def zero(self) -> None:
        """Zero every main_grad (one kernel)."""
        self.buffer.zero_()
        self._settle()

    def close(self) -> None:
        """Unbind the parameters' `.grad` (back to autograd's own; they keep their main_grad views) and drop the DP
        group. A gloo group kept alive past `destroy_process_group` can abort the interpreter at exit."""
        for p in self.params:
            if p.grad is p.main_grad:
                p.grad = None
        self.dp_group, self.dp_size, self.tp_group, self._tp_sums = None, 1, None, []


def attach(model: torch.nn.Module, dp_group=None) -> Optional[GradBuffer]:
    """A GradBuffer over `model`'s trainable parameters, or None if it has none (a frozen role)."""
    return GradBuffer(model, dp_group) if any(p.requires_grad for p in model.parameters()) else None
