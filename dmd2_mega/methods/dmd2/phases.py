"""DMD2's phase table (DESIGN sections 2 and 3): which roles each phase of a cycle needs, in order, and the role
its optimizer step trains. The GAN head (--dmd2-gan) adds its roles to it (`gan.GANSettings.phase_needs`); the
whole table of a run is `table(gan)` (`records.DMD2Settings.phases`). The memory planner takes it from its callers
(`launch/plan_memory.py`, `methods.dmd2.method.DMD2Method.plan_offload`).
"""
from __future__ import annotations

from dmd2_mega.methods.base import Phase, PhaseTable, table_roles, with_needs
from dmd2_mega.methods.dmd2.gan import NO_GAN, GANSettings

PHASES = (
    Phase("rollout", {"student": "all"}),                               # the student's backward simulation
    Phase("critic", {"critic": "all", "teacher": "all"}, trains="critic"),  # K critic steps, the teacher's scores
    Phase("actor", {"student": "all"}, trains="student"),              # one student step on the DMD gradient
)

ROLES = frozenset(table_roles(PHASES))  # student, critic, teacher


def table(gan: bool) -> PhaseTable:
    """The phase table of a DMD2 run with (--dmd2-gan) or without the GAN head: `PHASES` with the roles the head
    adds (`gan.GANSettings.phase_needs`: the actor phase reads the critic's weights)."""
    return with_needs(PHASES, (GANSettings if gan else NO_GAN).phase_needs)
