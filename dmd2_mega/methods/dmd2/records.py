"""The plain data one DMD2 cycle passes around (DESIGN section 2): no behaviour, no shared state.

`DMD2Settings` the method's frozen per-run settings every phase reads (built once from the config);
`Scores`       what the critic phase hands the actor phase for micro-batch j, keyed by sample id.
The micro-batch records the trainer draws before a cycle are the shared `methods.base.MicroBatch`.
Shapes: K critic steps, B = micro-batch size, rollouts of K*B samples [K*B, *shape].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from dmd2_mega import flow
from dmd2_mega.methods.base import PhaseTable
from dmd2_mega.methods.dmd2.gan import GANSettings, gan_part
from dmd2_mega.methods.dmd2.phases import table

@dataclass(frozen=True)
class DMD2Settings:
    """Everything a DMD2 cycle reads besides the roles and the micro-batches; `gan` is the GAN head (the
    method's optional part, `gan.GANSettings`), None without --dmd2-gan."""

    critic_steps: int            # K (--dmd2-critic-steps-per-rollout)
    micro_batch_size: int        # B (--micro-batch-size)
    shape: tuple                 # sample shape (C, H, W)
    device: torch.device
    student_sigmas: Tensor       # [N] fp32 shifted student grid (flow.student_sigmas)
    critic_grid: Tensor          # [G] fp32 shifted critic grid (flow.critic_grid)
    score_choices: Tensor        # the grid points in the score range (the last critic step's sigmas)
    scoring: str = "shared"      # --dmd2-critic-scoring shared | original
    loss_space: str = "velocity"  # --dmd2-critic-loss-space velocity | x0
    guidance: float = 1.0        # --dmd2-teacher-guidance-scale
    gan: Optional[GANSettings] = None
    rollout_chunk: Optional[int] = None  # rollout forwards in chunks of this many rows (None: one forward)

    @property
    def phases(self) -> PhaseTable:
        """DMD2's phase table with the roles the GAN head adds (`phases.table`)."""
        return table(self.gan is not None)

    @classmethod
    def from_config(cls, cfg, shape: tuple, device: torch.device) -> "DMD2Settings":
        """From a `config.DistillConfig`: grids shifted by --timestep-shift; on a CPU the rollout runs in
        chunks of B rows (forwards of K*B rows cost 1.2-1.3x per sample there; same result)."""
        t, d = cfg.train, cfg.dmd2
        sigmas = flow.student_sigmas(d.denoising_steps, d.student_sigmas, t.timestep_shift).to(device)
        grid, in_range = (x.to(device) for x in flow.critic_grid(d.critic_grid_size, t.timestep_shift,
                                                                 d.score_sigma_range))
        return cls(critic_steps=d.critic_steps_per_rollout, micro_batch_size=t.micro_batch_size, shape=tuple(shape),
                   device=device, student_sigmas=sigmas, critic_grid=grid, score_choices=grid[in_range],
                   scoring=d.critic_scoring, loss_space=d.critic_loss_space, guidance=d.teacher_guidance_scale,
                   gan=gan_part(cfg, grid), rollout_chunk=t.micro_batch_size if device.type == "cpu" else None)


@dataclass(frozen=True)
class Scores:
    """What the actor needs for micro-batch j, keyed by sample id."""

    sample_id: Tensor   # [B] int64
    x: Tensor           # [B, C, H, W] student input at the stop step
    sigma: Tensor       # [B] fp32     student sigma at the stop step
    cond: Tensor        # [B, ...]
    x0_fake: Tensor     # [B, C, H, W] critic x0 at (x_s, sigma_s), detached
    x0_real: Tensor     # [B, C, H, W] teacher CFG x0 at (x_s, sigma_s)
