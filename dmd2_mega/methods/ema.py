"""Exponential moving average of the student's weights (FastVideo 0.98, Self-Forcing 0.99).

    it <  start:  ema <- theta                       (track the weights until the EMA starts)
    it >= start:  ema <- decay * ema + (1 - decay) * theta
kept in fp32 beside the student (one tensor per trainable parameter: a LoRA student's adapters only, the frozen
base being its own average; same TP shard, same device), updated
after each actor step, saved in the student's checkpoint under "ema" as {parameter name: tensor}
(resharded across TP degrees like the weights) and restored exactly. It sleeps with the student (its
tensors join the student's Sleeper). `swapped_in(model)` temporarily loads the EMA weights into the
model for evaluation; `launch/sample.py` loads them in place of the weights unless --no-ema.

An update is one foreach op over all the tensors (`_foreach_lerp_`, or `_foreach_copy_` before start_iter), reading
the parameters themselves: no per-parameter copy or launch. For the lerp a bf16 student's weights are first upcast
into fp32 scratch tensors with one `_foreach_copy_` (lerp wants one dtype); the scratch's storage exists only during
the update (allocated, then freed, as `train/offload.py` frees a sleeping role's: the tensors survive), so the memory
is transient as before. The same lerp of the same fp32 values as a per-tensor `.float()` copy's: bit-exact.
"""
from __future__ import annotations

import contextlib

import torch

from dmd2_mega.errors import CheckpointError
from dmd2_mega.train.flat import flat_copies


class Scratch:
    """fp32 tensors shaped like `like`, views of one flat buffer whose storage is allocated only inside `holding`."""

    def __init__(self, like: list[torch.Tensor]):
        flat = torch.empty(sum(t.numel() for t in like), dtype=torch.float32, device=like[0].device)
        self.tensors = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]
        self._storage, self._nbytes = flat.untyped_storage(), flat.untyped_storage().nbytes()
        self._storage.resize_(0)

    @contextlib.contextmanager
    def holding(self, values: list[torch.Tensor]):
        """The scratch tensors holding `values` (any dtype), one foreach copy; freed on exit."""
        self._storage.resize_(self._nbytes)
        try:
            torch._foreach_copy_(self.tensors, values)
            yield self.tensors
        finally:
            self._storage.resize_(0)


class StudentEMA:
    def __init__(self, model: torch.nn.Module, decay: float, start_iter: int = 0):
        """decay in (0, 1), start_iter >= 0: validated with the flags (`config.EMAConfig`)."""
        self.decay, self.start_iter = decay, start_iter
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a LoRA student: its adapters
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = flat_copies(self.params, torch.float32)  # views of one buffer (`train/flat.py`)
        self._scratch = None if all(p.dtype == torch.float32 for p in self.params) else Scratch(self.shadow)

    @torch.no_grad()
    def update(self, iteration: int) -> None:
        """Call after the optimizer step that produced `iteration` (1-based cycle count)."""
        if iteration < self.start_iter:
            torch._foreach_copy_(self.shadow, self.params)  # a bf16 weight's fp32 value is exact
        elif self._scratch is None:  # fp32: the parameters themselves
            torch._foreach_lerp_(self.shadow, self.params, 1.0 - self.decay)
        else:
            with self._scratch.holding(self.params) as current:
                torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shadow)

    def state_dict(self) -> dict:
        """{parameter name: fp32 tensor} (copies)."""
        return {n: t.clone() for n, t in zip(self.names, self.shadow)}

    def load_state_dict(self, state: dict, source: str = "EMA state") -> None:
        if sorted(state) != sorted(self.names):
            missing = [n for n in self.names if n not in state]
            raise CheckpointError(f"{source} does not match the student: missing {missing[:3]}, "
                             f"unexpected {[n for n in state if n not in self.names][:3]}")
        with torch.no_grad():
            for n, t in zip(self.names, self.shadow):
                if tuple(state[n].shape) != tuple(t.shape):
                    raise CheckpointError(f"{source}: {n} has shape {tuple(state[n].shape)}, the student {tuple(t.shape)}")
                t.copy_(state[n])

    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module):
        """Run with the EMA weights in `model` (whose parameters are self.params); restores after."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)
