"""Critic phase: K flow-matching steps of the critic on the rollout, then the teacher's score.

Critic grid (`flow.critic_grid`): G points of unshifted sigma s_g = (G - g) / G, shifted: sigma_g = shift_k(s_g).
Step k (k = 0..K-1) trains on micro-batch k of every rollout (rows [kB, (k+1)B)), for each
micro-batch j of this rank (gradient accumulation over j, then one optimizer step):
    sigma ~ U{grid}            (last step: U{grid points with MIN <= s_g <= MAX}, the score range)
    eps ~ N(0, I) fresh;   x_s = (1 - sigma) x0hat + sigma eps          x0hat detached, positive cond
    loss = mean_n flow_matching_loss(v_critic(x_s, sigma, cond), x0hat, eps, sigma, space)
Scoring, `shared` (default): the last step's forward also yields, detached, x_s, sigma and
    x0_fake = x_s - sigma * v_critic (the critic after K-1 steps, before the step on these samples).
`original` (tianweiy/DMD2's order): before the last step, a separate draw (sigma in the score range,
    fresh eps) and a no-grad critic forward give x_s, sigma, x0_fake; the last step then trains on
    the full grid like the others.
A step whose loss or gradient norm is non-finite is skipped (`optim.Optimizer`; the trainer counts it).
After the K steps the frozen teacher scores x_s (`teacher_scores`) with CFG g over the null condition, both
conditions in one batched forward (g = 1: the positive one only):
    x0_real = x_s - sigma * (v_neg + g (v_pos - v_neg))                  dmd2_kernels.cfg_x0
Random draws of micro-batch j come, in order, from one generator keyed (seed, cycle, j, CRITIC).
Shapes: x_s, x0_fake, x0_real [B, C, H, W]; sigma [B] fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

import dmd2_kernels
from dmd2_mega import flow
from dmd2_mega.methods.base import MicroBatch
from dmd2_mega.methods.dmd2.gan import NO_GAN
from dmd2_mega.methods.dmd2.records import DMD2Settings, Scores
from dmd2_mega.methods.roles import ahead
from dmd2_mega.methods.rollout import Rollout
from dmd2_mega.train.accumulate import MicroMean, per_micro
from dmd2_mega.train.optim import step_optimizer


def critic_phase(critic, teacher, rollouts: list[Rollout], batches: list[MicroBatch],
                 settings: DMD2Settings) -> tuple[list[Scores], dict]:
    """K critic optimizer steps (`critic_steps`), then the teacher's scores (`score_kept`); returns (scores per
    micro-batch j, metrics)."""
    kept, metrics = critic_steps(critic, rollouts, batches, settings)
    return score_kept(teacher, kept, settings), metrics


def critic_steps(critic, rollouts: list[Rollout], batches: list[MicroBatch],
                 settings: DMD2Settings) -> tuple[list[tuple], dict]:
    """The K critic optimizer steps; returns (per micro-batch j what is scored: (rows, x_s, sigma, x0_fake), metrics).

    critic: a role (`.model`, `.optimizer`, `.accumulating`); rollouts[j] has
    K*B rows; batches[j].critic_gen makes every draw of micro-batch j. With the GAN head (`settings.gan`) each
    critic forward also gives the head's discriminator term (`gan.GANSettings.critic_forward`: disc_weight * L_D on
    the forward's own rows in the GAN range and r (--dmd2-gan-real-rows, default B) of batches[j].real's rows from
    kB), added to the step's objective.
    Metrics are device tensors (no host sync); critic-loss is the flow-matching part.
    """
    steps, size, head = settings.critic_steps, settings.micro_batch_size, settings.gan or NO_GAN
    full, score_choices, dev = settings.critic_grid, settings.score_choices, settings.critic_grid.device
    shared, m = settings.scoring == "shared", len(rollouts)
    kept: list = [None] * m
    losses, added_stats = [], {}
    for k in range(steps):
        last = k == steps - 1
        if last:
            ahead()  # --offload-prefetch: the actor phase's roles wake while this step computes
        if last and not shared:  # "original": a separate no-grad draw and forward before the last step
            with torch.no_grad():
                for j, (r, mb) in enumerate(zip(rollouts, batches)):
                    b = r.micro_batch(k, size)
                    x_s, sigma, _ = flow.noise_on_grid(b.x0hat, mb.critic_gen, score_choices)
                    v = critic.model(x_s, sigma, b.cond).to(x_s.dtype)  # bf16 models: maths in the data dtype
                    kept[j] = (b, x_s, sigma, dmd2_kernels.x0_from_velocity(x_s, v, sigma))
        choices = score_choices if last and shared else full
        total, objective = MicroMean(m), MicroMean(m)  # the flow-matching loss; with the GAN term
        for j, (r, mb) in enumerate(zip(rollouts, batches)):
            b = r.micro_batch(k, size)
            x_s, sigma, eps = flow.noise_on_grid(b.x0hat, mb.critic_gen, choices)
            with critic.accumulating(last=j == m - 1):
                v, added, stats = head.critic_forward(critic.model, x_s, sigma, b, mb, k, size)
                loss = dmd2_kernels.flow_matching_loss(v, b.x0hat, eps, sigma, space=settings.loss_space,
                                                       reduction="mean")
                obj = loss if added is None else loss + added
                per_micro(obj, m).backward()
            for key, value in stats.items():
                added_stats.setdefault(key, []).append(value)
            total.add(loss.detach())
            objective.add(obj.detach())
            if last and shared:
                with torch.no_grad():
                    kept[j] = (b, x_s, sigma, dmd2_kernels.x0_from_velocity(x_s, v.detach(), sigma))
        norm = step_optimizer(critic.optimizer, objective.value)  # skipped if it or the norm is non-finite
        critic.optimizer.zero_grad()
        losses.append(total.value)
    metrics = {"critic-loss": torch.stack(losses).mean(), "critic-grad_norm": norm.to(dev)}
    metrics.update({key: torch.stack(values).mean().float() for key, values in added_stats.items()})
    return kept, metrics


def score_kept(teacher, kept: list[tuple], settings: DMD2Settings) -> list[Scores]:
    """The teacher's scores (`teacher_scores`, CFG `settings.guidance`) of what `critic_steps` kept per micro-batch."""
    return [teacher_scores(teacher, *kj, guidance=settings.guidance) for kj in kept]


@torch.no_grad()
def teacher_scores(teacher, b: Rollout, x_s: Tensor, sigma: Tensor, x0_fake: Tensor, *, guidance: float) -> Scores:
    """The frozen teacher's CFG x0 at (x_s, sigma) for the scored rows `b`, with the critic's x0_fake; both with
    what the condition fixes put back (`FamilyModel.pin_given`)."""
    n = x_s.shape[0]
    if guidance == 1.0:
        x0_real = dmd2_kernels.x0_from_velocity(x_s, teacher.model(x_s, sigma, b.cond).to(x_s.dtype), sigma)
    else:
        neg = teacher.model.negative_for(b.cond)
        v = teacher.model(torch.cat([x_s, x_s]), torch.cat([sigma, sigma]), torch.cat([b.cond, neg])).to(x_s.dtype)
        x0_real = dmd2_kernels.cfg_x0(x_s, v[:n], v[n:], sigma, guidance)
    pin = teacher.model.pin_given  # what the condition fixes (a first-frame I2V image) scores no difference
    return Scores(sample_id=b.sample_id, x=b.x, sigma=b.sigma, cond=b.cond, x0_fake=pin(x0_fake, b.cond),
                  x0_real=pin(x0_real, b.cond))
