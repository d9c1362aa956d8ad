"""fp32 gradient buffers and the data-parallel gradient reduction (Megatron's `main_grad`), in place of torch DDP.

Every trainable parameter p gets `p.main_grad`, an fp32 view into ONE persistent flat buffer per model,
whatever p's dtype. A hook after autograd has accumulated p's gradient of one backward adds it into
main_grad and drops `p.grad`, so with M micro-batches

    main_grad = sum_j fp32(g_j)           (g_j: micro-batch j's gradient, in p's dtype: bf16 under --bf16)

is accumulated in fp32: a bf16 run's accumulated gradient is M bf16 roundings of the g_j summed
exactly, not M roundings of a running bf16 sum (torch DDP on a bf16 model accumulates and all-reduces in
bf16). For an fp32 model the add is the same fp32 add autograd would have made.

DP reduction: the buffer is cut into buckets of whole parameters, in reverse registration order (roughly
the order backward produces them). Outside `no_sync()` (the last micro-batch), the hook counts a bucket's
parameters as they arrive and, once all have, scales the bucket by 1 / DP and launches an asynchronous
SUM all-reduce of it over the DP group, in fp32, so the reduction overlaps the rest of the backward.
`finish()` launches what never completed (a parameter without a gradient in this backward keeps a zero
main_grad, as DDP would) and waits; `optim.Optimizer.step` calls it. No host sync anywhere: the counts
are Python integers on the host.

Sharded (`shard=True`, the distributed optimizer `dist_optim.DistributedOptimizer`): each bucket is padded
with zeros to a multiple of DP and cut into DP equal shards; the bucket's reduction is a reduce-scatter in
place (Megatron's), after which rank r's shard `shard_range(b)` holds the DP mean of its elements and the
rest of the bucket holds this rank's own, unreduced values. Only the shard's owner reads it.

Context parallelism: the weights are replicated over DP x CP, and each CP rank's gradient is the part from its
own tokens, so the group is DP x CP and the SUM is divided by DP only (`average_over`); a parameter tagged
`whole_over_cp` (`parallel.mark_whole_over_cp`: the GAN head) has the whole gradient on each CP rank and is
divided by CP first. Sequence parallelism: a parameter tagged `sequence_parallel` (`parallel.mark_sequence_parallel`)
holds the part from this TP rank's tokens (and a LoRA adapter's replicated factor, tagged `tp_partial_grad`, the part
from this rank's slice of its other factor: `parallel.sums_over_tp`); the synchronising backward all-reduces its
main_grad over the TP group as it arrives, before its bucket's DP reduction (TP sum and DP mean commute, and earlier
no_sync micro-batches are in main_grad already).

Memory: one fp32 copy of the trainable parameters (4 bytes each), in place of DDP's grads + buckets in
the model dtype; `p.grad` lives only between autograd's accumulation and the hook.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_mega.distributed.parallel import sums_over_tp

# elements per DP bucket (fp32): Megatron's default size, 40 M
BUCKET_ELEMENTS = 40_000_000


class GradBuffer:
    """fp32 `main_grad` of every trainable parameter of `model`, reduced over `dp_group` (see module docstring).

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
        self._sp = {i for i, p in enumerate(self.params) if sums_over_tp(p)} if self.tp_group else set()
        cp = self.dp_size // self.average_over  # the group is DP x CP
        self._whole = {i for i, p in enumerate(self.params) if getattr(p, "whole_over_cp", False)} if cp > 1 else set()
        self._cp = cp
        device = self.params[0].device
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
                self.offsets[i] = offset
                offset += p.numel()
            end = start
        self._views = [self.buffer.narrow(0, start, size) for start, size in self.regions]
        self._syncing = True
        self._ready = [0] * len(self.buckets)
        self._seen = [False] * len(self.params)
        self._work: list = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def shard_range(self, b: int) -> tuple[int, int]:
        """(start, end) in `buffer` of this DP rank's shard of bucket b (`shard`: the elements whose reduced
        gradient this rank receives and whose optimizer state it owns); the whole bucket without sharding."""
        start, size = self.regions[b]
        if not self.shard:
            return start, start + size
        n = size // self.dp_size
        return start + self.dp_rank * n, start + (self.dp_rank + 1) * n

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            p.main_grad.add_(p.grad)
            p.grad = None
            if self._syncing and i in self._sp:  # the part from this TP rank's tokens (module docstring)
                dist.all_reduce(p.main_grad, group=self.tp_group)
            if self._syncing and i in self._whole:  # whole on every CP rank: the DP x CP sum counts it CP times
                p.main_grad.div_(self._cp)
            if self._syncing and self.dp_size > 1:
                if self._seen[i]:
                    raise RuntimeError(f"GradBuffer: parameter {i} {tuple(p.shape)} got two gradients in one "
                                       f"synchronising backward; run the earlier ones under no_sync()")
                self._seen[i] = True
                b = self.bucket_of[i]
                self._ready[b] += 1
                if self._ready[b] == len(self.buckets[b]):
                    self._launch(b)
        return hook

    def _launch(self, b: int) -> None:
        view = self._views[b]
        view.div_(self.average_over)
        if self.shard:  # in place: this rank's shard of the bucket receives the reduced sum; the rest is stale
            start, end = self.shard_range(b)
            self._work[b] = dist.reduce_scatter_single(self.buffer[start:end], view, group=self.dp_group,
                                                       async_op=True)
        else:
            self._work[b] = dist.all_reduce(view, group=self.dp_group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate (the micro-batches before the last)."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def finish(self) -> None:
        """Complete the DP reduction of the last backward (a no-op without DP or after `no_sync` backwards only)."""
        if self.dp_size == 1 or not any(self._seen):
            return
        for b in range(len(self.buckets)):
            if self._work[b] is None:
                self._launch(b)
        for w in self._work:
            w.wait()
        self._ready = [0] * len(self.buckets)
        self._seen = [False] * len(self.params)
        self._work = [None] * len(self.buckets)

    def zero(self) -> None:
        """Zero every main_grad (one kernel)."""
        self.buffer.zero_()

    def close(self) -> None:
        """Remove the hooks and drop the DP group (the parameters keep their main_grad views). A gloo group
        kept alive past `destroy_process_group` can abort the interpreter at exit."""
        for h in self._handles:
            h.remove()
        self._handles, self.dp_group, self.dp_size = [], None, 1


def attach(model: torch.nn.Module, dp_group=None) -> Optional[GradBuffer]:
    """A GradBuffer over `model`'s trainable parameters, or None if it has none (a frozen role)."""
    return GradBuffer(model, dp_group) if any(p.requires_grad for p in model.parameters()) else None
