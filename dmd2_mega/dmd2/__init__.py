"""DMD2 distillation (DESIGN section 2): the student's backward-simulation rollout (`rollout`).

Time-slicing of the roles lives in `dmd2_mega.offload`.
"""
from dmd2_mega.dmd2.rollout import Rollout, RolloutError, rollout, student_sigmas

__all__ = ["Rollout", "RolloutError", "rollout", "student_sigmas"]
