"""DMD2's GAN head on the critic's intermediate features (tianweiy/DMD2's diffusion GAN).

features f = mean over tokens of the critic's block-l output [B, hidden] (l =
`--dmd2-gan-feature-layer`, default the middle block); the head is a replicated MLP
hidden -> hidden -> 1 (TP ranks hold identical features, so identical head gradients).
Non-saturating losses on logits D(.) of samples noised to a sigma in the score range:
    discriminator:  L_D = mean(softplus(D(fake))) + mean(softplus(-D(real)))   joins the critic loss
    generator:      L_G = mean(softplus(-D(fake)))                            joins the actor loss
d softplus(z) / dz = sigmoid(z).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GANHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        nn.init.normal_(self.mlp[0].weight, std=0.02)
        nn.init.zeros_(self.mlp[0].bias)
        nn.init.normal_(self.mlp[2].weight, std=0.02)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, hidden] -> logits [B] (fp32)."""
        return self.mlp(feats).squeeze(-1).float()


def discriminator_loss(logits_fake: torch.Tensor, logits_real: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()


def generator_loss(logits_fake: torch.Tensor) -> torch.Tensor:
    return F.softplus(-logits_fake).mean()
