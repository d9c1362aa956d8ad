"""DMD2 as a method of the shared student trainer (`methods.base.Method`, `methods.trainer.StudentTrainer`).

Phase table `phases.PHASES` (rollout -> critic -> actor) with the GAN head's roles added (`gan.GANSettings`),
settings `records.DMD2Settings`, steps `cycle.steps`, cycle `cycle.run_cycle`. Each micro-batch draws K*B conditions
(one rollout feeds K critic steps) and, with the GAN head, their dataset samples. `DMD2Trainer` is the trainer behind
`launch/pretrain_dmd2.py`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dmd2_mega.methods.base import CycleResult, MicroBatch, table_roles, trained_in
from dmd2_mega.methods.dmd2.cycle import run_cycle, steps
from dmd2_mega.methods.dmd2.gan import NO_GAN, gan_passes, head_plan
from dmd2_mega.methods.dmd2.phases import PHASES
from dmd2_mega.methods.dmd2.records import DMD2Settings
from dmd2_mega.methods.trainer import StudentTrainer
from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.plan.throughput import dmd2_cycle_flops
from dmd2_mega.train.checkpoint_guard import DMD2_RESUME_SETTINGS


class DMD2Method:
    """DMD2 (DESIGN section 2) with its optional GAN head; see `base.Method` for the members."""

    name = "DMD2"
    roles = table_roles(PHASES)                   # student, critic, teacher
    trained = tuple(trained_in(PHASES).values())  # critic, student: the save order
    eval_phase = "rollout"
    resume_settings = DMD2_RESUME_SETTINGS

    def __init__(self, cfg, shape: tuple, device: torch.device):
        self.cfg = cfg
        self.settings = DMD2Settings.from_config(cfg, shape, device)
        self.head = self.settings.gan or NO_GAN  # the GAN head, or what it adds as nothing
        self.phases = self.settings.phases
        self.data_factor = self.settings.critic_steps
        self.reads_samples = self.head.reads_samples  # only the GAN head reads the dataset's samples
        self.student_sigmas = self.settings.student_sigmas

    def steps(self) -> tuple:
        return steps(self.settings)

    def cycle(self, roles: dict, batches: list[MicroBatch], hook: Optional[Callable[[str], None]] = None) -> CycleResult:
        return run_cycle(roles, batches, self.settings, hook=hook)

    def init_model(self, name: str, model: torch.nn.Module, state: dict, load: Callable) -> torch.nn.Module:
        return self.head.init_model(name, model, state, load)

    def load_hint(self, name: str, state: dict) -> str:
        return self.head.load_hint(name, state)

    def describe(self, num_micro_batches: int, null_note: str) -> str:
        d = self.cfg.dmd2
        g = d.teacher_guidance_scale
        negative = f" (negative: {null_note})" if g != 1 else " (no negative forward)"
        return (f"K={d.critic_steps_per_rollout} M={num_micro_batches}; student sigmas "
                f"{[round(s, 4) for s in self.student_sigmas.tolist()]}; scoring {d.critic_scoring}; "
                f"teacher guidance {g}{negative}")

    def describe_parts(self, roles: dict) -> str:
        return self.head.describe(roles)

    def plan_offload(self, cfg, ps, info: dict, budget: float) -> tuple[frozenset, dict, bool]:
        d = cfg.dmd2
        ms = mp.model_shape_from_info(cfg.model.size, info)
        plan = mp.plan_cycle(ms, self.phases, tp=ps.tp_size, dp=ps.dp_size, micro=cfg.train.micro_batch_size,
                             steps=d.critic_steps_per_rollout, denoise=len(self.student_sigmas),
                             bf16=cfg.optim.bf16, recompute=cfg.model.recompute_granularity,
                             guidance=d.teacher_guidance_scale, dist_opt=cfg.optim.use_distributed_optimizer,
                             cp=ps.cp_size, sp=ps.sequence_parallel,
                             lora={r: cfg.lora.rank(r) for r in ("student", "critic")},
                             shared_base=not cfg.lora.no_shared_base,
                             added=head_plan(cfg.gan, ms),  # the GAN head's parameters on the critic
                             passes=gan_passes(cfg.gan, ms, cfg.train.micro_batch_size))  # and its forwards
        return mp.choose_offload(plan, budget)  # the run's table: with the GAN head, the actor needs critic weights

    def flops_per_iter(self, per_sample, num_micro_batches: int) -> Optional[float]:
        d = self.cfg.dmd2
        return (dmd2_cycle_flops(per_sample, self.cfg.train.micro_batch_size, num_micro_batches,
                                 d.critic_steps_per_rollout, len(self.student_sigmas), d.teacher_guidance_scale,
                                 d.critic_scoring) if per_sample else None)


class DMD2Trainer(StudentTrainer):
    """The shared student trainer running DMD2 (`launch/pretrain_dmd2.py`)."""

    def __init__(self, cfg):
        super().__init__(cfg, DMD2Method)
