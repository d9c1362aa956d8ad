"""One DMD2 cycle (DESIGN section 2), written once: the trainer, the cycle benchmark and the tests
all run it.

    run_cycle(roles, batches, settings, hook=None):
        enter_phase("rollout")  student: rollout of K*B samples per micro-batch (backward simulation)
        enter_phase("critic")   critic: K optimizer steps; teacher: CFG scores of the last step's samples
        enter_phase("actor")    student: one optimizer step on the scored samples (DMD loss [+ GAN])
`roles`: {"student", "critic", "teacher": dmd2.roles.Role}; `batches`: this rank's micro-batches
(`records.MicroBatch`, M of them: gradient accumulation over j, DP all-reduce on the last);
`settings`: the frozen `records.CycleSettings`. `enter_phase` sleeps what a phase does not need when
the roles have Sleepers (time-slicing) and returns the resident bytes. `hook(phase)` is called as each
phase starts, before its roles are switched ("rollout", "critic", "actor"): the benchmark's timer.
The LR schedules, the EMA and the cycle counter are the trainer's: they are not part of a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from dmd2_mega.dmd2.actor import actor_phase
from dmd2_mega.dmd2.critic import critic_phase
from dmd2_mega.dmd2.records import CycleSettings, MicroBatch
from dmd2_mega.dmd2.roles import Role, enter_phase
from dmd2_mega.dmd2.rollout import rollout


@dataclass(frozen=True)
class CycleResult:
    metrics: dict   # name -> device scalar (no host sync): critic-loss, actor-dmd-loss, grad norms, ...
    resident: dict  # phase -> device bytes of all roles after entering it
    rollout_forwards: Tensor  # device scalar: student sample-forwards of the rollout, sum_n (i_n + 1)


def run_cycle(roles: dict[str, Role], batches: list[MicroBatch], settings: CycleSettings,
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
    hook = hook or (lambda phase: None)
    gan = settings.gan is not None
    n = settings.critic_steps * settings.micro_batch_size
    resident = {}
    hook("rollout")
    resident["rollout"] = enter_phase("rollout", roles, gan)
    student = roles["student"].model
    rollouts = [rollout(student, mb.rollout_gen, n, mb.cond, settings.student_sigmas, shape=settings.shape,
                        device=settings.device, sample_id_offset=mb.sample_id_offset, max_batch=settings.rollout_chunk,
                        stop_gen=mb.stop_gen)
                for mb in batches]
    hook("critic")
    resident["critic"] = enter_phase("critic", roles, gan)
    scores, metrics = critic_phase(roles["critic"], roles["teacher"], rollouts, batches, settings)
    hook("actor")
    resident["actor"] = enter_phase("actor", roles, gan)
    metrics.update(actor_phase(roles["student"], scores, settings.gan, roles["critic"], batches))
    forwards = torch.stack([r.stop_step.sum() + len(r) for r in rollouts]).sum()
    return CycleResult(metrics, resident, forwards)
