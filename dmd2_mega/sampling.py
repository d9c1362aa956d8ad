"""Sampling a trained velocity model across DP ranks (eval during training and launch/sample.py).

`generate` draws the full noise [N, C, H, W] from one seeded generator on every rank (so the
result does not depend on the DP size), each DP rank integrates its contiguous slice with the
Euler sampler of `flow.py` (CFG batched), and the slices are all-gathered over the DP group.
TP ranks of a group run the same slice together (their layers are sharded).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dmd2_mega import flow


def eval_conditions(dataset, n: int) -> torch.Tensor:
    """Class-balanced labels 0..K-1 repeated, or the first n condition embeddings of the data."""
    if dataset.num_classes is not None:
        return torch.arange(n) % dataset.num_classes
    idx = torch.arange(n) % len(dataset)
    return dataset.get_batch(idx)[1]


@torch.no_grad()
def generate(model, cond: torch.Tensor, *, shape: tuple, steps: int, guidance: float, shift: float,
             seed: int, device: torch.device, dp_rank: int = 0, dp_size: int = 1, dp_group=None,
             null_cond: torch.Tensor = None) -> torch.Tensor:
    """Samples for `cond` [N, ...]; returns images [N, *shape] float32 on the CPU, on every rank,
    clamped to the data range [-1, 1]."""
    n = cond.shape[0]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, *shape), generator=gen)
    per = -(-n // dp_size)
    lo, hi = min(dp_rank * per, n), min((dp_rank + 1) * per, n)
    was_training = model.training
    model.eval()
    out = torch.zeros((per, *shape), dtype=torch.float32)
    if hi > lo:
        c = cond[lo:hi].to(device)
        nc = null_cond[lo:hi].to(device) if null_cond is not None else model.null_cond(hi - lo, device)
        x = flow.euler_sampler(model, noise[lo:hi].to(device), c, nc if guidance != 1.0 else None,
                               steps=steps, guidance=guidance, shift=shift)
        out[: hi - lo] = x.float().clamp_(-1, 1).cpu()
    model.train(was_training)
    if dp_size > 1:
        gathered = [torch.empty_like(out) for _ in range(dp_size)]
        if dist.get_backend(dp_group) == "nccl":
            dev_g = [g.to(device) for g in gathered]
            dist.all_gather(dev_g, out.to(device), group=dp_group)
            gathered = [g.cpu() for g in dev_g]
        else:
            dist.all_gather(gathered, out, group=dp_group)
        out = torch.cat(gathered)
    return out[:n]
