"""DiT input embeddings; all replicated across TP ranks (small next to the blocks).

* `sincos_2d(grid, dim)` -> [grid*grid, dim]: fixed 2-D sine-cosine position table (ours: half the channels
  the row, then half the column, each [cos, sin]).
* `dit_sincos_2d(grid, dim)`: the official DiT / SiT (and diffusers PatchEmbed) table: the column first, then the
  row, each [sin, cos], computed in float64 like the official numpy code, stored float32.
* `TimestepEmbedder`: a timestep [B] (ours 1000 sigma; the model's parameterisation adapter gives it) ->
  sinusoidal features [B, freq_dim] -> MLP -> [B, H]; `freq_shift` 1 divides the exponent by half - 1 instead of
  half (diffusers' DiT: `Timesteps(downscale_freq_shift=1)`).
* `LabelEmbedder`: labels [B] in [0, K] (K = the learned null class) -> [B, H].
* `TextEmbedder`: embeddings [B, D] or [B, L, D] (mean over L) -> MLP -> [B, H]; null = zeros.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


_FREQS: dict = {}
"""(half, max_period, freq_shift, device) -> the frequencies [half] fp32 of `sincos_1d`, made once (eager mode)."""


def _frequencies(half: int, max_period: float, freq_shift: int, device: torch.device) -> torch.Tensor:
    """w_i = max_period^(-i / (half - freq_shift)), i < half, fp32. The same every call, so eager mode makes them once
    per device (4 launches fewer per timestep embedding, each forward); under torch.compile they are computed in the
    graph, which folds them (a traced function must not fill a cache)."""
    def make():
        return torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=device)
                         / (half - freq_shift))
    if torch.compiler.is_compiling():
        return make()
    key = (half, max_period, freq_shift, device)
    if key not in _FREQS:
        _FREQS[key] = make()
    return _FREQS[key]


def sincos_1d(pos: torch.Tensor, dim: int, max_period: float = 10000.0, freq_shift: int = 0) -> torch.Tensor:
    """pos [N] -> [N, dim] = [cos(pos * w_i), sin(pos * w_i)], w_i = max_period^(-i/(half - freq_shift))."""
    half = dim // 2
    freqs = _frequencies(half, max_period, freq_shift, pos.device)
    args = pos.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim - 2 * half))


def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Half the channels encode the row, half the column; [grid*grid, dim], row-major tokens."""
    coords = torch.arange(grid, dtype=torch.float32)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    return torch.cat([sincos_1d(rows.reshape(-1), dim // 2), sincos_1d(cols.reshape(-1), dim - dim // 2)], dim=1)


def dit_sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """The official DiT / SiT position table [grid*grid, dim] (module docstring), row-major tokens."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(grid, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    parts = []
    for pos in (cols.reshape(-1), rows.reshape(-1)):
        args = pos[:, None] * omega[None]
        parts += [torch.sin(args), torch.cos(args)]
    return torch.cat(parts, dim=1).float()


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int = 256, freq_shift: int = 0):
        super().__init__()
        self.freq_dim, self.freq_shift = freq_dim, freq_shift
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        for lin in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return self.mlp(sincos_1d(timestep, self.freq_dim, freq_shift=self.freq_shift).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """num_classes + 1 rows: the last is the learned null class used for CFG."""

    def __init__(self, num_classes: int, hidden: int):
        super().__init__()
        self.num_classes = num_classes
        self.table = nn.Embedding(num_classes + 1, hidden)
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.table(labels)


class TextEmbedder(nn.Module):
    """Projected precomputed text embedding; the null condition is the zero embedding."""

    def __init__(self, cond_shape: tuple, hidden: int):
        super().__init__()
        if len(cond_shape) not in (1, 2):
            raise ValueError(f"condition embeddings must be [D] or [L, D] per sample, got {tuple(cond_shape)}")
        self.cond_shape = tuple(cond_shape)
        self.mlp = nn.Sequential(nn.Linear(cond_shape[-1], hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        for lin in (self.mlp[0], self.mlp[2]):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        if cond.dim() == 3:
            cond = cond.mean(dim=1)
        return self.mlp(cond.to(self.mlp[0].weight.dtype))
