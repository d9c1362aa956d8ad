"""Self-Forcing DMD as a method of the shared student trainer (`methods.base.Method`; --distill-method
self-forcing, launch/pretrain_dmd2.py).

DMD2's phase table, settings, critic phase (K flow-matching steps of a bidirectional critic on the generated
videos, the bidirectional teacher's CFG score) and GAN head, with two parts of its own:
    rollout  the causal student generates each sample's whole video chunk by chunk with its KV cache, each chunk
             to its exit step (`rollout.causal_rollout`; exits per chunk, or per sample: --self-forcing-exit)
    actor    the DMD gradient on the whole video reaches each chunk's exit-step output, the earlier chunks read
             through the detached cache (`rollout.replay`, chunk by chunk; only the last --causal-grad-chunks M)
    length   --self-forcing-rollout-frames F > T: rollouts of F frames, one window of the data's T frames scored
             per micro-batch (Self-Forcing++; `rollout.draw_window`), so the student trains on its own frames past T
Only the student is causal: the critic and the teacher are built bidirectional from the same --model-size
(`model_config`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

import dmd2_kernels
from dmd2_mega.distributed.parallel import to_device
from dmd2_mega.errors import ConfigError, RolloutError
from dmd2_mega.methods.base import CycleResult, MicroBatch, PhaseStep
from dmd2_mega.methods.dmd2.critic import critic_phase
from dmd2_mega.methods.dmd2.gan import NO_GAN
from dmd2_mega.methods.dmd2.method import DMD2Method
from dmd2_mega.methods.roles import run_steps
from dmd2_mega.methods.self_forcing.rollout import causal_rollout, draw_exits, draw_window, replay, window_starts
from dmd2_mega.train.checkpoint_guard import DMD2_RESUME_SETTINGS
from dmd2_mega.train.accumulate import MicroMean, per_micro
from dmd2_mega.train.optim import step_optimizer


class SelfForcingMethod(DMD2Method):
    """Self-Forcing DMD (module docstring); the members are `base.Method`'s, DMD2's where not overridden."""

    name = "Self-Forcing"
    resume_settings = DMD2_RESUME_SETTINGS + (
        ("--self-forcing-exit", ("dmd2", "self_forcing_exit")),
        ("--self-forcing-rollout-frames", ("dmd2", "self_forcing_rollout_frames")),
        ("--causal-grad-chunks", ("dmd2", "causal_grad_chunks")))

    def __init__(self, cfg, shape: tuple, device: torch.device):
        if not cfg.model.causal:
            raise ConfigError("--distill-method self-forcing trains a causal student: give --causal (and "
                              "--causal-chunk-frames; --student-load the causal init, launch/pretrain_causal_init.py)")
        super().__init__(cfg, shape, device)
        self.context_noise = cfg.model.causal_context_noise
        self.per_chunk = cfg.dmd2.self_forcing_exit == "chunk"
        self.grad_chunks = cfg.dmd2.causal_grad_chunks
        frames = shape[1]
        self.rollout_frames = cfg.dmd2.self_forcing_rollout_frames or frames
        if self.rollout_frames < frames:
            raise ConfigError(f"--self-forcing-rollout-frames {self.rollout_frames} is shorter than the data's "
                              f"{frames} frames (the length the critic and the teacher score)")
        self.spans = cfg.model.causal_layout().chunks(self.rollout_frames)
        self.levels = self.student_sigmas.float().cpu().tolist()  # the rollout's host floats, read once at start
        try:
            window_starts(self.spans, frames)
        except RolloutError as e:
            raise ConfigError(f"--self-forcing-rollout-frames {self.rollout_frames}: {e}; pick a length whose chunk "
                              f"boundaries hold windows of the data's {frames} frames") from None

    def check_data(self, dataset) -> None:
        """A condition with parts (an image-to-video clip's image, which fixes the clip's first frame) cannot score a
        window that starts later: rollouts past the data's length are refused for it."""
        if getattr(dataset, "cond_parts", None) and self.rollout_frames > self.settings.shape[1]:
            raise ConfigError(f"--self-forcing-rollout-frames {self.rollout_frames} past the data's "
                              f"{self.settings.shape[1]} frames on a condition of parts "
                              f"{[name for name, _ in dataset.cond_parts]}: an image-to-video window that does not "
                              f"start the clip has no condition to score it with; leave the flag out")

    def model_config(self, name: str, model_cfg):
        """The student is causal; the critic and the teacher see whole videos."""
        return model_cfg if name == "student" else replace(model_cfg, causal=False)

    def steps(self) -> tuple:
        """DMD2's steps with the causal rollout (and its windows) and the replaying actor (module docstring)."""
        return (PhaseStep("rollout", self.rollout_step), PhaseStep("critic", self.critic_step),
                PhaseStep("actor", self.actor_step))

    def rollout_step(self, roles: dict, batches: list[MicroBatch], given=None) -> tuple[tuple, dict]:
        """Each micro-batch's causal rollout (exits from its stop generator, noise from its rollout generator) and the
        window it scores (from its stop generator, after the exits). Every micro-batch's exits and window are drawn
        first, on the host, and the exits reach the device in one non-blocking copy."""
        st = self.settings
        shape = (st.shape[0], self.rollout_frames, *st.shape[2:])
        host, windows = [], []
        for mb in batches:  # per stop generator: its exits, then its window (the order of one rollout at a time)
            host.append(draw_exits(mb.stop_gen, len(mb.cond), len(self.spans), len(self.levels), self.per_chunk))
            windows.append(draw_window(self.spans, st.shape[1], mb.stop_gen))
        dev = to_device(torch.stack(host), batches[0].cond.device)  # [M, n, chunks]
        rollouts = [causal_rollout(roles["student"].model, mb.rollout_gen, mb.stop_gen, mb.cond, st.student_sigmas,
                                   shape=shape, context_noise=self.context_noise, per_chunk=self.per_chunk,
                                   sample_id_offset=mb.sample_id_offset, levels=self.levels, exits=(h, dev[k]))
                    for k, (mb, h) in enumerate(zip(batches, host))]
        return (rollouts, windows), {}

    def critic_step(self, roles: dict, batches: list[MicroBatch], given: tuple) -> tuple[tuple, dict]:
        """DMD2's critic phase on each rollout's window."""
        rollouts, windows = given
        scores, metrics = critic_phase(roles["critic"], roles["teacher"],
                                       [r.window(w, self.spans) for r, w in zip(rollouts, windows)], batches,
                                       self.settings)
        return (rollouts, windows, scores), metrics

    def actor_step(self, roles: dict, batches: list[MicroBatch], given: tuple) -> tuple[None, dict]:
        rollouts, windows, scores = given
        st = self.settings
        scored = [r.micro_batch(st.critic_steps - 1, st.micro_batch_size) for r in rollouts]
        return None, self.actor(roles["student"], scored, scores, roles["critic"], batches, windows)

    def cycle(self, roles: dict, batches: list[MicroBatch],
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
        handed, metrics, resident = run_steps(self.steps(), roles, batches, self.phases, hook)
        forwards = torch.stack([(r.exit_step.float().mean(1) + 1).sum() for r in handed[0][0]]).sum()
        return CycleResult(metrics, resident, forwards)

    def actor(self, student, scored: list, scores: list, critic, batches: list[MicroBatch], windows: list) -> dict:
        """One student step: the DMD loss (`dmd2_kernels.dmd_loss`) on each scored video's window replayed with grad
        (plus the GAN head's generator term), gradients accumulated over the micro-batches."""
        dev, m, head = scores[0].x.device, len(scores), self.settings.gan or NO_GAN
        inputs = [p for p in student.model.parameters() if p.requires_grad] if head.frozen_critic else None
        total, objective = MicroMean(m), MicroMean(m)
        for j, (b, sc) in enumerate(zip(scored, scores)):
            with student.accumulating(last=j == m - 1):
                x0hat = replay(student.model, b, self.context_noise, self.grad_chunks, windows[j])
                loss, _ = dmd2_kernels.dmd_loss(x0hat, sc.x0_real, sc.x0_fake)
                added, _ = head.actor_term(critic, x0hat, batches[j].actor_gen, sc.cond)
                obj = loss if added is None else loss + added
                per_micro(obj, m).backward(inputs=inputs)
            total.add(loss.detach())
            objective.add(obj.detach())
        norm = step_optimizer(student.optimizer, objective.value)
        student.optimizer.zero_grad()
        return {"actor-dmd-loss": total.value, "actor-grad_norm": norm.to(dev)}

    def describe(self, num_micro_batches: int, null_note: str) -> str:
        grad = "every chunk" if self.grad_chunks is None else f"the last {self.grad_chunks} chunks"
        frames = self.settings.shape[1]
        length = (f"; rollouts of {self.rollout_frames} frames, one window of {frames} scored per micro-batch "
                  f"(starts drawn from {len(window_starts(self.spans, frames))})"
                  if self.rollout_frames > frames else "")
        return (f"{super().describe(num_micro_batches, null_note)}; exit steps per "
                f"{'chunk' if self.per_chunk else 'sample'}, cache at level {self.context_noise:g}, gradient to "
                f"{grad}{length}")

    def flops_per_iter(self, per_sample, num_micro_batches: int) -> Optional[float]:
        return None  # the rollout's chunked cost is not in the throughput model yet
