"""DMD2's phase table (DESIGN sections 2 and 3): which roles each phase of a cycle needs, in order, and the role
its optimizer step trains. The GAN head (--dmd2-gan) adds its roles to it (`gan.GANSettings.phase_needs`; the
whole table of a run is `records.DMD2Settings.phases`). Read by the memory planner's callers
(`launch/plan_memory.py`, `methods.dmd2.method.DMD2Method.plan_offload`).
"""
from __future__ import annotations

from dmd2_mega.methods.base import Phase, table_roles

PHASES = (
    Phase("rollout", {"student": "all"}),                               # the student's backward simulation
    Phase("critic", {"critic": "all", "teacher": "all"}, trains="critic"),  # K critic steps, the teacher's scores
    Phase("actor", {"student": "all"}, trains="student"),              # one student step on the DMD gradient
)

ROLES = frozenset(table_roles(PHASES))  # student, critic, teacher
