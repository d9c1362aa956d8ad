"""Actor phase: one student optimizer step with the DMD generator loss on the scored samples.

For each scored micro-batch j (gradient accumulation over j, DP all-reduce on the last):
    x0hat = x_i - sigma_i * v_student(x_i, sigma_i, cond)                 WITH grad (then `pin_given`: what the
            condition fixes, a first-frame I2V image, is put back, as in x0_real and x0_fake: no gradient there)
    norm_n = mean_{sample n} |x0hat - x0_real|,  grad = nan_to_num((x0_fake - x0_real) / norm_n)
    loss = 0.5 * mean((x0hat - stopgrad(x0hat - grad))^2),   d loss / d x0hat = grad / numel
(dmd2_kernels.dmd_loss, tianweiy/DMD2 `sd_guidance.py` semantics); with the GAN head on, + gen_weight *
softplus(-D(noised x0hat)) through the frozen critic (`gan.GANSettings.actor_term`). Then TP/DP-aware clip and step,
skipped when the loss or the gradient norm is non-finite (`optim.Optimizer`).
Shapes: x_i, x0hat, x0_real, x0_fake [B, C, H, W]; sigma_i [B] fp32.
"""
from __future__ import annotations

from typing import Optional

import dmd2_kernels
from dmd2_mega.methods.base import MicroBatch
from dmd2_mega.methods.dmd2.gan import NO_GAN, GANSettings
from dmd2_mega.methods.dmd2.records import Scores
from dmd2_mega.train.accumulate import MicroMean, per_micro
from dmd2_mega.train.optim import step_optimizer


def actor_phase(student, scores: list[Scores], gan: Optional[GANSettings] = None, critic=None,
                batches: Optional[list[MicroBatch]] = None) -> dict:
    """One optimizer step of `student` (a role) on `scores`; returns device-tensor metrics.

    With `gan` (the GAN head): + its generator term (`gan.GANSettings.actor_term`) on x0hat with draws from
    batches[j].actor_gen (micro-batch j's actor generator), through `critic` (a role whose model is a
    `GANCritic`, awake for its weights) whose parameters get no gradient."""
    dev = scores[0].x.device
    m = len(scores)
    total, objective, norm_mean, gap, rms = (MicroMean(m) for _ in range(5))
    added_stats: dict[str, MicroMean] = {}
    head = gan or NO_GAN
    # a term through another role (the GAN head's frozen critic): the student's parameters only get gradients
    inputs = [p for p in student.model.parameters() if p.requires_grad] if head.frozen_critic else None
    for j, sc in enumerate(scores):
        with student.accumulating(last=j == m - 1):
            v = student.model(sc.x, sc.sigma, sc.cond).to(sc.x.dtype)  # bf16 models: maths in the data dtype
            x0hat = student.model.pin_given(dmd2_kernels.x0_from_velocity(sc.x, v, sc.sigma), sc.cond)
            loss, stats = dmd2_kernels.dmd_loss(x0hat, sc.x0_real, sc.x0_fake)
            added, more = head.actor_term(critic, x0hat, batches[j].actor_gen if batches else None, sc.cond)
            obj = loss if added is None else loss + added
            for key, value in more.items():
                added_stats.setdefault(key, MicroMean(m)).add(value)
            per_micro(obj, m).backward(inputs=inputs)
        total.add(loss.detach())
        objective.add(obj.detach())
        norm_mean.add(stats.norm.float().mean())
        gap.add((sc.x0_fake - sc.x0_real).abs().float().mean())
        rms.add(stats.grad_rms.float())
    grad_norm = step_optimizer(student.optimizer, objective.value)  # skipped if it or the norm is non-finite
    student.optimizer.zero_grad()
    metrics = {"actor-dmd-loss": total.value, "actor-grad_norm": grad_norm.to(dev), "dmd-normaliser": norm_mean.value,
               "dmd-fake-real-gap": gap.value, "dmd-grad-rms": rms.value}
    metrics.update({key: value.value for key, value in added_stats.items()})
    return metrics
