"""One DMD2 cycle (DESIGN section 2), written once as three steps: the trainer's cycle runs them, the cycle
benchmarks time them alone, the tests run both.

    steps(settings) -> (PhaseStep, ...), each run(roles, batches, given) -> (handed, metrics):
        "rollout"  student: rollout of K*B samples per micro-batch (backward simulation)      -> rollouts
        "critic"   critic: K optimizer steps; teacher: CFG scores of the last step's samples  -> scores
        "actor"    student: one optimizer step on the scored samples (DMD loss [+ GAN])       -> None
    run_cycle(roles, batches, settings, hook=None): `roles.run_steps` of them
`roles`: {"student", "critic", "teacher": methods.roles.Role}; `batches`: this rank's micro-batches
(`methods.base.MicroBatch`, M of them: gradient accumulation over j, DP all-reduce on the last);
`settings`: the frozen `records.DMD2Settings`. Each step's phase is entered (`roles.enter_phase`), which sleeps
what a phase of DMD2's table (`settings.phases`: `phases.PHASES` + the GAN head's roles) does not need when the
roles have Sleepers (time-slicing) and returns the resident bytes. `hook(phase)` is called as each phase starts,
before its roles are switched ("rollout", "critic", "actor"): the phase clock.
The LR schedules, the EMA and the cycle counter are the trainer's: they are not part of a cycle.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from dmd2_mega.methods.base import CycleResult, MicroBatch, PhaseStep
from dmd2_mega.methods.dmd2.actor import actor_phase
from dmd2_mega.methods.dmd2.critic import critic_phase
from dmd2_mega.methods.dmd2.records import DMD2Settings, Scores
from dmd2_mega.methods.roles import Role, ahead, run_steps
from dmd2_mega.methods.rollout import Rollout, draw_stop_steps, rollout


def rollout_step(settings: DMD2Settings, roles: dict[str, Role], batches: list[MicroBatch],
                 given=None) -> tuple[list[Rollout], dict]:
    """K*B samples per micro-batch j: noise from its rollout generator, stop steps from its host stop generator (its
    rollout generator when it has none), every micro-batch's drawn first and copied to the device at once."""
    n = settings.critic_steps * settings.micro_batch_size
    student = roles["student"].model
    stops = draw_stop_steps([mb.rollout_gen if mb.stop_gen is None else mb.stop_gen for mb in batches], n,
                            settings.student_sigmas.numel(), settings.device)
    last = len(batches) - 1
    return [rollout(student, mb.rollout_gen, n, mb.cond, settings.student_sigmas, shape=settings.shape,
                    device=settings.device, sample_id_offset=mb.sample_id_offset, max_batch=settings.rollout_chunk,
                    stops=stop, last_step=ahead if j == last else None, pin=student.pin_given)
            for j, (mb, stop) in enumerate(zip(batches, stops))], {}


def critic_step(settings: DMD2Settings, roles: dict[str, Role], batches: list[MicroBatch],
                rollouts: list[Rollout]) -> tuple[list[Scores], dict]:
    return critic_phase(roles["critic"], roles["teacher"], rollouts, batches, settings)


def actor_step(settings: DMD2Settings, roles: dict[str, Role], batches: list[MicroBatch],
               scores: list[Scores]) -> tuple[None, dict]:
    return None, actor_phase(roles["student"], scores, settings.gan, roles["critic"], batches)


def steps(settings: DMD2Settings) -> tuple[PhaseStep, ...]:
    """DMD2's cycle as `PhaseStep`s in the order of its phase table."""
    return tuple(PhaseStep(name, partial(fn, settings)) for name, fn in
                 (("rollout", rollout_step), ("critic", critic_step), ("actor", actor_step)))


def rollout_forwards(rollouts: list[Rollout]) -> torch.Tensor:
    """Student sample-forwards of the rollouts: sum_n (i_n + 1) (device scalar, no sync)."""
    return torch.stack([r.stop_step.sum() + len(r) for r in rollouts]).sum()


def run_cycle(roles: dict[str, Role], batches: list[MicroBatch], settings: DMD2Settings,
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
    handed, metrics, resident = run_steps(steps(settings), roles, batches, settings.phases, hook)
    return CycleResult(metrics, resident, rollout_forwards(handed[0]))
