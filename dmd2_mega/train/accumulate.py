"""Gradient accumulation's arithmetic over a step's m micro-batches, shared by every trainer (the flow teacher's
step, the methods' phases): each micro-batch's backward takes its share value / m of the step's objective, and the
step's loss and metrics are the sum of those shares, in micro-batch order. With one micro-batch (the common case)
neither costs a launch: a launch-bound step spends nothing on its bookkeeping."""
from __future__ import annotations

import torch
from torch import Tensor


def per_micro(value: Tensor, m: int) -> Tensor:
    """`value` / m, a micro-batch's share of a step over m micro-batches (what its backward and its metrics take);
    with one micro-batch the value itself, no launch (the division by 1 would change no bit)."""
    return value if m == 1 else value / m


class MicroMean:
    """The mean of device scalars over a step's m micro-batches, summed as value / m (in the value's dtype) in
    micro-batch order, in fp32 or the values' wider dtype: bit for bit the sum started at an fp32 zero; with one
    micro-batch of that dtype the value itself, no launch. `value`: the mean so far (None before the first `add`)."""

    def __init__(self, m: int):
        self.m, self.value = m, None

    def add(self, value: Tensor) -> None:
        share = per_micro(value, self.m)
        share = share.to(torch.promote_types(share.dtype, torch.float32))
        self.value = share if self.value is None else self.value + share
