"""Many tensors in one storage: the optimizer's fp32 masters, its Adam state and the student's EMA, each role's.

A tensor per parameter is a storage per parameter: Wan 1.3B has 825 parameter tensors, so its Adam moments alone
were 1,650 storages, and time-slicing (`offload.Sleeper`, which moves storages) made one copy per storage each way.
Here each kind is one buffer and the tensors are views of it, made once and kept: every in-place update (the fused
AdamW step, the EMA's lerp, a loaded state copied in) writes the buffer, so a role's state is a handful of storages
whatever its parameter count (`offload.Sleeper.counters`). The arithmetic is unchanged: the same values in other
memory.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def flat_copies(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Copies of `tensors` in `dtype` (all on one device), each a view of one new buffer, shaped like its source."""
    if not tensors:
        return []
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    out, at = [], 0
    for t in tensors:
        view = flat[at:at + t.numel()].view(t.shape)
        view.copy_(t.detach())
        out.append(view)
        at += t.numel()
    return out


class FlatAdamState:
    """The state of every parameter of a torch AdamW (fused: its step a float32 device scalar) as views of two
    buffers, made before its first step: moments [2, N] (exp_avg, exp_avg_sq) in the parameters' dtype and steps [P]
    float32, zero as AdamW's own initialisation makes them. `repack` puts the views back after
    `load_state_dict` (which installs the loaded tensors), the loaded values copied in."""

    KEYS = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, inner: torch.optim.Optimizer):
        params = [p for g in inner.param_groups for p in g["params"]]
        self.views: dict = {}
        if not params or len({(p.dtype, p.device) for p in params}) != 1:
            return  # mixed dtypes or devices: AdamW's own per-parameter state
        dev, dtype = params[0].device, params[0].dtype
        self.moments = torch.zeros(2, sum(p.numel() for p in params), dtype=dtype, device=dev)
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=dev)
        at = 0
        for i, p in enumerate(params):
            n = p.numel()
            self.views[p] = {"step": self.steps[i], "exp_avg": self.moments[0, at:at + n].view(p.shape),
                             "exp_avg_sq": self.moments[1, at:at + n].view(p.shape)}
            at += n
        self.repack(inner)

    @torch.no_grad()
    def repack(self, inner: torch.optim.Optimizer) -> None:
        """Each parameter's state as its views again, holding what the state held (a loaded checkpoint's values)."""
        for p, views in self.views.items():
            state = inner.state[p]
            for key, view in views.items():
                held = state.get(key)
                if held is not None and held is not view:
                    view.copy_(held.reshape(view.shape))
                state[key] = view


@torch.no_grad()
def flatten_parameters(module: torch.nn.Module) -> int:
    """Move `module`'s parameters into one buffer per (dtype, device, trained or frozen): each parameter's data
    becomes a view of its group's buffer, holding its values (the Parameter objects stay, so optimizers, hooks and
    other modules that hold them see the move). A parameter already in such a buffer (another role's, e.g. a shared
    LoRA base) stays where it is; trained and frozen ones never share a buffer (a LoRA checkpoint writes the trained
    ones' storage alone). Returns the buffers made. For time-slicing: a sleeping role's weights are then a few
    storages, one copy each (`offload.Sleeper`)."""
    groups: dict = {}
    for p in module.parameters():
        if not getattr(p, "_flat_buffer", False):
            groups.setdefault((p.dtype, p.device, p.requires_grad), []).append(p)
    for (dtype, _, _), params in groups.items():
        for p, view in zip(params, flat_copies(params, dtype)):
            p.data = view
            p._flat_buffer = True
    return len(groups)
