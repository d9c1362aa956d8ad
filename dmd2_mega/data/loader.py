"""`MicroBatchLoader`: this rank's micro-batches of each iteration, in `GlobalBatchSampler`'s order, on the device.

The sampler stays the one authority on what is read (its `consumed_samples` is what checkpoints save and
resume). For a streaming `ShardDataset` with `num_workers > 0`, a `torch.utils.data.DataLoader` reads ahead:
its batch sampler is a copy of the sampler started at the current position, so the workers produce exactly the
micro-batches the sampler will hand out next (`prefetch_factor` per worker in flight, pinned on CUDA). Each
iteration the loader checks that the read-ahead batches are the sampler's (index for index) and restarts the
read-ahead at the sampler's position when they are not (after a resume, or anything else that moved the
sampler). Host memory is O(micro-batch x workers x prefetch), independent of the data set's size.

A DataError in a worker (a bad value, a shard changed since start-up) comes back as the batch's result, not as
a worker exception (which torch would re-raise wrapped in the worker's traceback): the loader stops the workers
and raises it in the training process, once, before the batch's step.

In-memory sets (the embedded digits), and shard sets with `num_workers=0`, are read in the training process.
Batches reach the device in their stored dtype and are cast to float32 there; labels stay int64.
"""
from __future__ import annotations

import copy
from typing import Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from dmd2_mega.errors import DataError
from dmd2_mega.distributed.parallel import to_device
from .sampler import GlobalBatchSampler
from .shards import ShardDataset


def device_batch(x: Optional[torch.Tensor], cond: torch.Tensor, device: torch.device) -> tuple:
    """Host batch -> device; floating tensors become float32 on the device (after the smaller copy)."""
    cond = to_device(cond, device)
    cond = cond.float() if cond.is_floating_point() else cond
    return (to_device(x, device).float() if x is not None else None), cond


class _ReadAhead(torch.utils.data.Sampler):
    """The index lists the sampler will produce from `consumed_samples` on, this rank's micro-batches in order."""

    def __init__(self, sampler: GlobalBatchSampler):
        self.sampler = copy.copy(sampler)  # shares nothing mutable that the original changes in place

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            for _, idx in self.sampler.next_iteration():
                yield idx.tolist()


def _identity(batch):
    return batch


class _Fetch:
    """The DataLoader's dataset: a batched fetch (`__getitems__`) of (indices, x or None, cond), or the DataError
    to raise in the training process (a worker's exception would come back wrapped in its traceback)."""

    def __init__(self, dataset: ShardDataset, latents: bool):
        self.dataset, self.latents = dataset, latents

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: List[int]):
        idx = torch.tensor(indices, dtype=torch.int64)
        try:
            return (idx, *read(self.dataset, idx, self.latents))
        except DataError as e:
            return e


def read(dataset, idx: torch.Tensor, latents: bool) -> tuple:
    """(x or None, cond) of the samples idx; the latents are not read when not wanted."""
    if latents:
        return dataset.get_batch(idx)
    return None, (dataset.get_cond(idx) if isinstance(dataset, ShardDataset) else dataset.get_batch(idx)[1])


class MicroBatchLoader:
    """`next_iteration()` -> [(global micro-batch index j, x, cond)] on `device` for this rank; advances the sampler.
    With `latents=False` only the conditions are read and x is None."""

    def __init__(self, dataset, sampler: GlobalBatchSampler, device: torch.device, num_workers: int = 2,
                 prefetch_factor: int = 2, latents: bool = True):
        self.dataset, self.sampler, self.device, self.latents = dataset, sampler, device, latents
        self.num_workers = num_workers if isinstance(dataset, ShardDataset) else 0
        self.prefetch_factor = prefetch_factor
        self._it: Optional[Iterator] = None
        self._position = None  # consumed_samples the read-ahead iterator will produce next

    def _start(self) -> None:
        self.close()
        loader = DataLoader(_Fetch(self.dataset, self.latents), batch_sampler=_ReadAhead(self.sampler), collate_fn=_identity,
                            num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                            pin_memory=self.device.type == "cuda", persistent_workers=False)
        self._it, self._position = iter(loader), self.sampler.consumed_samples

    def next_iteration(self) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
        if self.num_workers == 0:
            return [(j, *device_batch(*read(self.dataset, idx, self.latents), self.device))
                    for j, idx in self.sampler.next_iteration()]
        if self._it is None or self._position != self.sampler.consumed_samples:
            self._start()  # the read-ahead begins where the sampler is
        micro = self.sampler.next_iteration()
        out = []
        for j, idx in micro:
            got = next(self._it)
            if isinstance(got, DataError):  # a worker's: raised here, once, with the workers stopped
                self.close()
                raise DataError(str(got))
            read_idx, x, cond = got
            if not torch.equal(read_idx, idx):  # cannot happen unless the read-ahead lost step with the sampler
                self.close()
                raise DataError(f"{self.dataset.source}: the data loader read samples {read_idx.tolist()[:4]}... "
                                f"where the sampler expects {idx.tolist()[:4]}...")
            out.append((j, *device_batch(x, cond, self.device)))
        self._position = self.sampler.consumed_samples
        return out

    def close(self) -> None:
        """Stop the workers (the next `next_iteration` starts new ones where the sampler is)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
