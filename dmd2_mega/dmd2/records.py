"""The plain data one DMD2 cycle passes around (DESIGN section 2): no behaviour, no shared state.

`MicroBatch`   what the trainer draws for micro-batch j of this rank before a cycle (inputs);
`CycleSettings` the frozen per-run settings every phase reads (built once from the config);
`Scores`       what the critic phase hands the actor phase for micro-batch j, keyed by sample id.
Shapes: K critic steps, B = micro-batch size, rollouts of K*B samples [K*B, *shape].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from dmd2_mega import flow
from dmd2_mega.dmd2.gan import GANSettings

# Generator streams of micro-batch j: parallel.micro_batch_generator(seed, cycle, j, device, stream);
# STOPS is a host (CPU) generator: the rollout's stop steps, known on the host without a device sync
ROLLOUT, CRITIC, ACTOR, STOPS = 0, 1, 2, 3


@dataclass(frozen=True)
class MicroBatch:
    """Micro-batch j of a cycle on this rank (global index j over all DP ranks)."""

    index: int
    cond: Tensor                 # [K*B, ...] conditions of the rollout, on the compute device
    sample_id_offset: int        # sample ids of the rollout: offset + [0, K*B)
    rollout_gen: torch.Generator  # stream ROLLOUT: the noise of the rollout
    critic_gen: torch.Generator   # stream CRITIC: every draw of the critic phase
    actor_gen: Optional[torch.Generator] = None  # stream ACTOR: the GAN's noise in the actor phase
    real: Optional[Tensor] = None  # [K*B, *shape] the dataset images of these conditions (GAN only)
    stop_gen: Optional[torch.Generator] = None  # stream STOPS on the CPU: the rollout's stop steps (None:
    #                                             rollout_gen, which must then be a CPU generator)


@dataclass(frozen=True)
class CycleSettings:
    """Everything a cycle reads besides the roles and the micro-batches."""

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

    @classmethod
    def from_config(cls, cfg, shape: tuple, device: torch.device) -> "CycleSettings":
        """From a `config.DistillConfig`: grids shifted by --timestep-shift; on a CPU the rollout runs in
        chunks of B rows (forwards of K*B rows cost 1.2-1.3x per sample there; same result)."""
        t, d, g = cfg.train, cfg.dmd2, cfg.gan
        sigmas = flow.student_sigmas(d.denoising_steps, d.student_sigmas, t.timestep_shift).to(device)
        grid, in_range = (x.to(device) for x in flow.critic_grid(d.critic_grid_size, t.timestep_shift,
                                                                 d.score_sigma_range))
        gan = None
        if g.enabled:
            gan_range = flow.critic_grid(d.critic_grid_size, t.timestep_shift, cfg.gan_sigma_range())[1]
            gan = GANSettings(g.disc_weight, g.gen_weight, g.noise, grid[gan_range.to(device)])
        return cls(critic_steps=d.critic_steps_per_rollout, micro_batch_size=t.micro_batch_size, shape=tuple(shape),
                   device=device, student_sigmas=sigmas, critic_grid=grid, score_choices=grid[in_range],
                   scoring=d.critic_scoring, loss_space=d.critic_loss_space, guidance=d.teacher_guidance_scale,
                   gan=gan, rollout_chunk=t.micro_batch_size if device.type == "cpu" else None)


@dataclass(frozen=True)
class Scores:
    """What the actor needs for micro-batch j, keyed by sample id."""

    sample_id: Tensor   # [B] int64
    x: Tensor           # [B, C, H, W] student input at the stop step
    sigma: Tensor       # [B] fp32     student sigma at the stop step
    cond: Tensor        # [B, ...]
    x0_fake: Tensor     # [B, C, H, W] critic x0 at (x_s, sigma_s), detached
    x0_real: Tensor     # [B, C, H, W] teacher CFG x0 at (x_s, sigma_s)
