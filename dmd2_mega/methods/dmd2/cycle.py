"""One DMD2 cycle (DESIGN section 2), written once: the trainer, the cycle benchmark and the tests
all run it.

    run_cycle(roles, batches, settings, hook=None):
        enter_phase("rollout")  student: rollout of K*B samples per micro-batch (backward simulation)
        enter_phase("critic")   critic: K optimizer steps; teacher: CFG scores of the last step's samples
        enter_phase("actor")    student: one optimizer step on the scored samples (DMD loss [+ GAN])
`roles`: {"student", "critic", "teacher": methods.roles.Role}; `batches`: this rank's micro-batches
(`methods.base.MicroBatch`, M of them: gradient accumulation over j, DP all-reduce on the last);
`settings`: the frozen `records.DMD2Settings`. `enter_phase` sleeps what a phase of DMD2's table
(`settings.phases`: `phases.PHASES` + the GAN head's roles) does not need when the roles have Sleepers
(time-slicing) and returns the resident bytes. `hook(phase)` is called as each
phase starts, before its roles are switched ("rollout", "critic", "actor"): the benchmark's timer.
The LR schedules, the EMA and the cycle counter are the trainer's: they are not part of a cycle.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dmd2_mega.methods.base import CycleResult, MicroBatch
from dmd2_mega.methods.dmd2.actor import actor_phase
from dmd2_mega.methods.dmd2.critic import critic_phase
from dmd2_mega.methods.dmd2.records import DMD2Settings
from dmd2_mega.methods.roles import Role, enter_phase
from dmd2_mega.methods.rollout import rollout


def run_cycle(roles: dict[str, Role], batches: list[MicroBatch], settings: DMD2Settings,
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
    hook = hook or (lambda phase: None)
    table = settings.phases
    n = settings.critic_steps * settings.micro_batch_size
    resident = {}
    hook("rollout")
    resident["rollout"] = enter_phase("rollout", roles, table)
    student = roles["student"].model
    rollouts = [rollout(student, mb.rollout_gen, n, mb.cond, settings.student_sigmas, shape=settings.shape,
                        device=settings.device, sample_id_offset=mb.sample_id_offset, max_batch=settings.rollout_chunk,
                        stop_gen=mb.stop_gen)
                for mb in batches]
    hook("critic")
    resident["critic"] = enter_phase("critic", roles, table)
    scores, metrics = critic_phase(roles["critic"], roles["teacher"], rollouts, batches, settings)
    hook("actor")
    resident["actor"] = enter_phase("actor", roles, table)
    metrics.update(actor_phase(roles["student"], scores, settings.gan, roles["critic"], batches))
    forwards = torch.stack([r.stop_step.sum() + len(r) for r in rollouts]).sum()
    return CycleResult(metrics, resident, forwards)
