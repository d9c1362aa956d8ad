"""DMD2's GAN head on the critic's intermediate features (tianweiy/DMD2's diffusion GAN).

features f = mean over tokens of the critic's block-l output [B, hidden] (l =
`--dmd2-gan-feature-layer`, default the middle block; the blocks after l are not run); the head
is a replicated MLP hidden -> hidden -> 1 on the critic (`critic.gan_head`), initialised from a
generator keyed by --seed, so every TP and DP rank starts identical (TP ranks hold identical
features, hence identical head gradients). It is a submodule of the critic: trained by the
critic's optimizer, saved in the critic's checkpoint, asleep with the critic.
Inputs, noised to a sigma drawn from the critic grid's score range (`--dmd2-gan-noise`, default;
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

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dmd2_mega import flow
from dmd2_mega.config import ConfigError


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


def discriminator_loss(logits_fake: Tensor, logits_real: Tensor) -> Tensor:
    return F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()


def generator_loss(logits_fake: Tensor) -> Tensor:
    return F.softplus(-logits_fake).mean()


@dataclass
class GANSettings:
    """What the critic and actor phases need; `choices` [n] fp32 are the score-range sigmas."""

    disc_weight: float
    gen_weight: float
    noise: bool
    choices: Tensor


def resolve_layer(layer: int | None, num_layers: int) -> int:
    """--dmd2-gan-feature-layer (default the middle block, num_layers // 2), checked."""
    layer = num_layers // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ConfigError(f"--dmd2-gan-feature-layer must be in [0, {num_layers - 1}] (the critic has "
                          f"{num_layers} blocks), got {layer}")
    return layer


def attach_head(model: nn.Module, layer: int, seed: int) -> GANHead:
    """Give the critic DiT its GAN head (a submodule, so optimizer, DDP and checkpoints see it)."""
    gen = torch.Generator().manual_seed(seed + 9173)
    head = GANHead(model.spec.hidden_size, generator=gen).to(next(model.parameters()).device)
    model.gan_head, model.gan_layer = head, layer
    return head


def gan_logits(model: nn.Module, x: Tensor, sigma: Tensor, cond) -> Tensor:
    """The head's logits [B] for inputs x (a forward outside DDP: the actor's frozen critic)."""
    return model.gan_head(model.features(x, sigma, cond, model.gan_layer))


def gan_inputs(x0: Tensor, gen: torch.Generator, gan: GANSettings) -> tuple[Tensor, Tensor]:
    """(x, sigma [B] fp32): x0 noised to sigma ~ U{choices} with eps drawn from `gen` (in that order),
    or x0 itself at sigma 0 with --no-dmd2-gan-noise (nothing drawn)."""
    n = x0.shape[0]
    if not gan.noise:
        return x0, torch.zeros(n, device=x0.device)
    x, sigma, _ = flow.noise_on_grid(x0, gen, gan.choices)
    return x, sigma
