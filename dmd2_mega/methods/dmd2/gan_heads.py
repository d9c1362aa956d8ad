"""DMD2's discriminator heads: what classifies a critic block's token grid as real or generated.

Both read `FamilyModel.features`: block l's output as a grid [B, C, *grid] (C the model's hidden size; grid (H, W)
tokens for an image model, (F, H, W) for a video model), whole on every TP / SP / CP rank.

    conv (the default, tianweiy/DMD2's form: `cls_pred_branch` of main/edm/edm_guidance.py, whose 8 x 8 x 768 UNet
        bottleneck it classifies): strided convolutions over the spatial grid, each followed by GroupNorm (32 groups,
        fewer below 8 channels a group: `norm_groups`) and SiLU, then a 1 x 1 convolution to one logit per
        position, averaged:
            while max(H, W) > 4:  conv k4 s2 p1 (a side of 1 stays: k1 s1 p0)     H, W -> H // 2, W // 2
            conv k (H, W) s (H, W)                                                  -> 1 x 1
            conv 1 x 1 to one channel; mean over what is left (a video model's frames)
        On an 8 x 8 grid that is the reference's stack exactly (8 -> 4 -> 1 -> logit). A video model's frames are
        not convolved (kernels 1 along time: the 3-D convolutions act per frame), so the head's cost is that of F
        images; its logit is the frames' mean. Parameters keep PyTorch's default initialisation (as the
        reference's), drawn from a generator seeded by --seed so every rank starts identical.
    mlp (the head before issue 54, `--dmd2-gan-head mlp`): the grid's mean over positions [B, C] into a
        C -> C -> 1 MLP, init N(0, 0.02) and zero biases.

The logits are fp32 [B]; the head is built in fp32 and reads the grid cast to its parameters' dtype (the trainer casts
the critic whole, head included, under --bf16: `methods/trainer.py` `cast_model` after `init_model`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

HEADS = ("conv", "mlp")


def norm_groups(channels: int) -> int:
    """GroupNorm's group count: the reference's 32 (24 channels a group at its 768), fewer where a group would hold
    under 8 channels: after the last stage the grid is 1 x 1, and a group of one channel there normalises every
    input to the same value (the logit would not depend on the input). The largest divisor of the channels that
    is <= 32 and leaves >= 8 channels a group; one group below 8 channels."""
    return next((g for g in range(min(32, channels // 8), 0, -1) if channels % g == 0), 1)


def conv_stages(grid: tuple) -> list[tuple]:
    """The conv head's spatial stages for a token grid (the module docstring): [(kernel, stride, padding) of the
    last two dims], the halvings first, then the one that covers what is left."""
    h, w = grid[-2:]
    stages = []
    while max(h, w) > 4:
        stages.append(tuple(zip(*((4, 2, 1) if d > 1 else (1, 1, 0) for d in (h, w)))))
        h, w = (h // 2 if h > 1 else 1), (w // 2 if w > 1 else 1)
    stages.append(((h, w), (h, w), (0, 0)))
    return stages


def head_parameters(kind: str, channels: int, grid: tuple) -> int:
    """The parameters of `build_head(kind, channels, grid, seed)`, counted without building it (the memory planner
    sizes a 480p Wan 1.3B's 158M-parameter head, whose build alone takes seconds): conv, per stage of `conv_stages` a
    C -> C convolution (weight and bias; a video model's kernels are 1 along time) and a GroupNorm (weight and bias),
    then the 1 x 1 convolution to one channel; mlp, the C -> C and C -> 1 linears."""
    c = channels
    if kind == "mlp":
        return c * c + c + c + 1
    if kind != "conv":
        raise ValueError(f"--dmd2-gan-head must be one of {HEADS}, got {kind!r}")
    if len(grid) not in (2, 3):
        raise ValueError(f"the conv GAN head takes a 2-D (image) or 3-D (video) token grid, got {tuple(grid)}")
    stages = sum(c * c * kh * kw + c + 2 * c for (kh, kw), _, _ in conv_stages(tuple(grid)))
    return stages + c + 1


def head_tensors(kind: str, grid: tuple) -> int:
    """The parameter tensors of `build_head(kind, ., grid, .)`: each has its own AdamW step count (the planner's
    4 bytes a tensor); conv 4 a stage (conv and GroupNorm, weight and bias) + the last conv's 2, mlp 4."""
    if kind not in HEADS:
        raise ValueError(f"--dmd2-gan-head must be one of {HEADS}, got {kind!r}")
    return 4 if kind == "mlp" else 4 * len(conv_stages(tuple(grid))) + 2


def head_kept_elements(kind: str, channels: int, grid: tuple, n: int) -> int:
    """Elements (in the head's dtype) a training forward of `build_head(kind, channels, grid, .)` on n grids keeps
    for its backward (the memory planner's; measured with saved-tensor hooks, tests/test_plan_gan.py): conv, its
    input n C |grid| and per stage of `conv_stages` the convolution's, GroupNorm's and SiLU's outputs 3 n C |out|
    (|out| the stage's output grid, a video model's frames included) with GroupNorm's statistics 2 n groups;
    mlp, its linears' and SiLU's inputs, 3 n C."""
    c = channels
    if kind == "mlp":
        return 3 * n * c
    head_parameters(kind, c, grid)  # its errors: an unknown kind, a grid of neither 2 nor 3 dims
    frames, (h, w) = math.prod(grid[:-2]), grid[-2:]
    kept = n * c * frames * h * w
    stages = len(conv_stages(tuple(grid)))
    for stage in range(stages):  # the halvings, then the one to 1 x 1
        h, w = (1, 1) if stage == stages - 1 else ((h // 2 if h > 1 else 1), (w // 2 if w > 1 else 1))
        kept += 3 * n * c * frames * h * w + 2 * n * norm_groups(c)
    return kept


class ConvHead(nn.Module):
    """Strided convolutions + GroupNorm + SiLU over the token grid to one logit (module docstring)."""

    def __init__(self, channels: int, grid: tuple):
        super().__init__()
        if len(grid) not in (2, 3):
            raise ValueError(f"the conv GAN head takes a 2-D (image) or 3-D (video) token grid, got {tuple(grid)}")
        self.grid = tuple(grid)
        conv = nn.Conv2d if len(grid) == 2 else nn.Conv3d
        lead = () if len(grid) == 2 else (1,)  # a video model's time axis: kernel 1, stride 1, no padding
        layers = []
        for kernel, stride, pad in conv_stages(self.grid):
            layers += [conv(channels, channels, lead + kernel, lead + stride, (0,) * len(lead) + pad),
                       nn.GroupNorm(norm_groups(channels), channels), nn.SiLU()]
        layers.append(conv(channels, 1, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, grid: Tensor) -> Tensor:
        """grid [B, C, *grid] -> logits [B] fp32."""
        w = self.net[0].weight
        return self.net(grid.to(w.dtype)).flatten(1).mean(dim=1).float()


class MLPHead(nn.Module):
    """The token mean into an MLP (the head before issue 54; module docstring)."""

    def __init__(self, channels: int, generator: torch.Generator):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, 1))
        with torch.no_grad():
            for lin in (self.mlp[0], self.mlp[2]):
                nn.init.normal_(lin.weight, std=0.02, generator=generator)
                nn.init.zeros_(lin.bias)

    def forward(self, grid: Tensor) -> Tensor:
        """grid [B, C, *grid] -> logits [B] fp32 (of the mean over the grid's positions)."""
        feats = grid.flatten(2).mean(dim=2)
        return self.mlp(feats.to(self.mlp[0].weight.dtype)).squeeze(-1).float()


def build_head(kind: str, channels: int, grid: tuple, seed: int) -> nn.Module:
    """A head of `kind` ("conv" or "mlp") for a trunk of `channels` features on a token `grid`, on the CPU, its
    parameters drawn from generators seeded by `seed` alone (every TP / DP / CP rank builds the same head)."""
    if kind == "mlp":
        return MLPHead(channels, torch.Generator().manual_seed(seed))
    if kind != "conv":
        raise ValueError(f"--dmd2-gan-head must be one of {HEADS}, got {kind!r}")
    with torch.random.fork_rng(devices=[]):  # PyTorch's default init, from a seeded global generator
        torch.manual_seed(seed)
        return ConvHead(channels, grid)
