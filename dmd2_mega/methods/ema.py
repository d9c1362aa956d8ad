"""Exponential moving average of the student's weights (FastVideo 0.98, Self-Forcing 0.99).

    it <  start:  ema <- theta                       (track the weights until the EMA starts)
    it >= start:  ema <- decay * ema + (1 - decay) * theta
kept in fp32 beside the student (one tensor per trainable parameter: a LoRA student's adapters only, the frozen
base being its own average; same TP shard, same device), updated
after each actor step, saved in the student's checkpoint under "ema" as {parameter name: tensor}
(resharded across TP degrees like the weights) and restored exactly. It sleeps with the student (its
tensors join the student's Sleeper). `swapped_in(model)` temporarily loads the EMA weights into the
model for evaluation; `launch/sample.py` loads them in place of the weights unless --no-ema.
"""
from __future__ import annotations

import contextlib

import torch

from dmd2_mega.errors import CheckpointError


class StudentEMA:
    def __init__(self, model: torch.nn.Module, decay: float, start_iter: int = 0):
        """decay in (0, 1), start_iter >= 0: validated with the flags (`config.EMAConfig`)."""
        self.decay, self.start_iter = decay, start_iter
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a LoRA student: its adapters
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, iteration: int) -> None:
        """Call after the optimizer step that produced `iteration` (1-based cycle count)."""
        current = [p.detach().float() for p in self.params]
        if iteration < self.start_iter:
            torch._foreach_copy_(self.shadow, current)
        else:
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
