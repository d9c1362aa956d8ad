"""DMD2's GAN head on the critic's intermediate features (tianweiy/DMD2's diffusion GAN).

`GANCritic` is the critic role's model when `--dmd2-gan` is on: it owns the critic's trunk (any
family model, `models.family`) and the head, so the critic's optimizer, DDP, Sleeper and checkpoint
see both (state-dict keys `trunk.*` and `head.*`).
    features f = trunk.features(x, sigma, cond, l): mean over tokens of block l's output [B, hidden]
        (l = `--dmd2-gan-feature-layer`, default the middle block; the blocks after l are not run);
    head: a replicated MLP hidden -> hidden -> 1, initialised from a generator keyed by --seed, so every
        TP and DP rank starts identical (TP ranks hold identical features, hence identical head grads).
`GANCritic.forward(x, sigma, cond)` is the trunk's velocity; with `gan_inputs=(x', sigma', cond')` it
also returns the head's logits on x' from the same call, so that DDP sees the flow-matching and GAN
terms of a critic step together. `logits(x, sigma, cond)` is the head alone (the actor's frozen critic).
Inputs, noised to a sigma drawn from the critic grid's GAN range (`--dmd2-gan-noise`, default;
`--no-dmd2-gan-noise` feeds clean samples at sigma 0):
    x = (1 - sigma) x0 + sigma eps,  eps ~ N(0, I)
Non-saturating losses on the logits D(.):
    discriminator (critic phase, every critic step, real = dataset images, fake = x0hat detached):
        L_D = mean(softplus(D(fake))) + mean(softplus(-D(real)))     critic loss += disc_weight * L_D
    generator (actor phase, on the student's x0hat WITH grad, critic frozen: only the student's
    parameters receive gradients):
        L_G = mean(softplus(-D(fake)))                                actor loss += gen_weight * L_G
d softplus(z) / dz = sigmoid(z).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dmd2_mega import flow
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import FamilyModel
from dmd2_mega.distributed.parallel import mark_whole_over_cp

HEAD_SEED_OFFSET = 9173  # the head's init generator is seeded with --seed + this


class GANHead(nn.Module):
    def __init__(self, hidden: int, generator: torch.Generator | None = None):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        with torch.no_grad():
            nn.init.normal_(self.mlp[0].weight, std=0.02, generator=generator)
            nn.init.zeros_(self.mlp[0].bias)
            nn.init.normal_(self.mlp[2].weight, std=0.02, generator=generator)
            nn.init.zeros_(self.mlp[2].bias)

    def forward(self, feats: Tensor) -> Tensor:
        """feats [B, hidden] -> logits [B] (fp32)."""
        return self.mlp(feats.to(self.mlp[0].weight.dtype)).squeeze(-1).float()


class GANCritic(FamilyModel):
    """The critic's trunk and its GAN head as one module (see the module docstring)."""

    def __init__(self, trunk: FamilyModel, layer: int, seed: int):
        super().__init__()
        if not 0 <= layer < trunk.num_feature_layers:
            raise IndexError(f"GAN feature layer {layer} is outside the trunk's [0, {trunk.num_feature_layers - 1}]")
        self.trunk, self.layer = trunk, layer
        self.spec, self.num_feature_layers, self.feature_dim = trunk.spec, trunk.num_feature_layers, trunk.feature_dim
        gen = torch.Generator().manual_seed(seed + HEAD_SEED_OFFSET)
        self.head = GANHead(trunk.feature_dim, generator=gen).to(next(trunk.parameters()).device)
        # the head reads token-mean features that every CP rank holds whole, so each CP rank's head gradient is the
        # whole gradient, not a part of it as for the trunk (models/token_parallel.py)
        mark_whole_over_cp(self.head.parameters(), getattr(getattr(trunk, "options", None), "context_parallel", 1) > 1)

    def forward(self, x: Tensor, sigma: Tensor, cond: Tensor, gan_inputs: Optional[tuple] = None):
        """v [B, *shape]; with gan_inputs = (x', sigma', cond'): (v, logits [B'] on x')."""
        v = self.trunk(x, sigma, cond)
        return v if gan_inputs is None else (v, self.logits(*gan_inputs))

    def logits(self, x: Tensor, sigma: Tensor, cond: Tensor) -> Tensor:
        return self.head(self.trunk.features(x, sigma, cond, self.layer))

    def features(self, x: Tensor, sigma: Tensor, cond: Tensor, layer: int) -> Tensor:
        return self.trunk.features(x, sigma, cond, layer)

    def null_cond(self, n: int, device) -> Tensor:
        return self.trunk.null_cond(n, device)


def holds_head(state: dict) -> bool:
    """Whether a critic state dict was saved with its GAN head (a `GANCritic`)."""
    return any(k.startswith("head.") for k in state)


def discriminator_loss(logits_fake: Tensor, logits_real: Tensor) -> Tensor:
    return F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()


def generator_loss(logits_fake: Tensor) -> Tensor:
    return F.softplus(-logits_fake).mean()


@dataclass(frozen=True)
class GANSettings:
    """What the critic and actor phases need; `choices` [n] fp32 are the GAN range's grid sigmas."""

    disc_weight: float
    gen_weight: float
    noise: bool
    choices: Tensor


def resolve_layer(layer: int | None, num_layers: int) -> int:
    """--dmd2-gan-feature-layer (default the middle block, num_layers // 2), checked against the model."""
    layer = num_layers // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ConfigError(f"--dmd2-gan-feature-layer must be in [0, {num_layers - 1}] (the critic has "
                          f"{num_layers} blocks), got {layer}")
    return layer


def gan_inputs(x0: Tensor, gen: torch.Generator, gan: GANSettings) -> tuple[Tensor, Tensor]:
    """(x, sigma [B] fp32): x0 noised to sigma ~ U{choices} with eps drawn from `gen` (in that order),
    or x0 itself at sigma 0 with --no-dmd2-gan-noise (nothing drawn)."""
    n = x0.shape[0]
    if not gan.noise:
        return x0, torch.zeros(n, device=x0.device)
    x, sigma, _ = flow.noise_on_grid(x0, gen, gan.choices)
    return x, sigma
