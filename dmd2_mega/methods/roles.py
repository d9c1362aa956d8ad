"""Roles as objects, and time-slicing between the phases of a method's table (`base.PhaseTable`).

DMD2's roles: student (trained by the actor phase, runs the rollout), critic (trained by the critic phase,
the "fake score"), teacher (frozen, the "real score"); another method names its own in its table. Each
role owns its model, optimizer, LR schedule, fp32 gradient buffer (`grad_buffer.GradBuffer`: accumulation and
DP reduction), checkpoint directory, further tensors (`extra`: the student's EMA) and, with
--offload-inactive, a `Sleeper` that frees its device storage while a phase does not need it
(DESIGN section 3). A Role is built whole and never mutated (`with_offload` returns a copy).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from dmd2_mega.methods.base import MicroBatch, PhaseStep, PhaseTable, phase_needs
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.train.offload import LEVELS, ExpertSleeper, Sleeper, resident_bytes, state_tensors, weight_tensors
from dmd2_mega.train.optim import LRSchedule, Optimizer


@dataclass(frozen=True)
class Role:
    name: str
    model: torch.nn.Module
    optimizer: Optional[Optimizer] = None
    schedule: Optional[LRSchedule] = None
    grads: Optional[GradBuffer] = None
    save_dir: Optional[str] = None
    extra: tuple = ()  # further tensors of the role (the student's EMA)
    sleeper: Optional[Sleeper] = None
    lora: Optional[dict] = None  # a LoRA role's adapters and base (`train/lora_checkpoint.py`); None: full weights

    def with_offload(self, device: torch.device, table: Optional[PhaseTable] = None) -> "Role":
        """This role with a Sleeper over its model, optimizer and extra tensors (time-slicing); a role without
        an optimizer (the teacher) is frozen: its host copy is made once, and a model of experts (Wan 2.2) gets
        an ExpertSleeper that keeps only the expert a forward runs resident. A trained role's main_grad buffer is
        never copied (all zero when it sleeps: the trainers zero it after each step) and, under --bf16, neither are
        its weights, rebuilt from the fp32 masters on a wake, unless a phase of `table` (the method's; None: not
        known) needs its weights without its state (`offload.Sleeper`: zeroed, derived)."""
        experts = self.model.expert_modules() if hasattr(self.model, "expert_modules") else ()
        if experts and not self.trainable:
            return replace(self, sleeper=ExpertSleeper(self.name, experts, device=device))
        opt = self.optimizer
        alone = table is None or any(phase_needs(table, p.name).get(self.name) == "weights" for p in table)
        derived = (list(opt.model_params) if opt is not None and opt.mixed and opt.rebuilds_model and not alone
                   else [])
        return replace(self, sleeper=Sleeper(
            self.name, [self.model], [opt] if opt else [], list(self.extra), device=device, frozen=not self.trainable,
            zeroed=[self.grads.buffer] if self.grads is not None else [], derived=derived,
            derive=opt.copy_to_model if derived else None))

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    def accumulating(self, last: bool):
        """Context of one micro-batch's backward: gradients only accumulate unless `last` (the one whose
        backward starts the DP reduction)."""
        return contextlib.nullcontext() if last or self.grads is None else self.grads.no_sync()

    def tensors(self) -> list:
        """The role's weights, grads, optimizer state and extra tensors on its device (a slept storage has 0 bytes)."""
        if self.sleeper is not None:
            return self.sleeper.held()
        modules, optimizers = [self.model], [self.optimizer] if self.optimizer else []
        return weight_tensors(modules) + state_tensors(modules, optimizers, self.extra)

    def resident_bytes(self) -> int:
        """Device bytes of the role's weights, grads, optimizer state and extra tensors."""
        if self.sleeper is not None:
            return self.sleeper.resident_bytes()
        return resident_bytes(self.tensors())


def enter_phase(phase: str, roles: dict[str, Role], table: PhaseTable) -> int:
    """Sleep what `phase` of the method's `table` does not need, then wake what it does (sleeping first keeps
    the peak at the larger phase, not the sum); returns the resident bytes of all roles, each storage counted once
    (LoRA roles hold the teacher's very weights: `models/lora.share_base`)."""
    needed = phase_needs(table, phase)
    for name, role in roles.items():
        if role.sleeper is not None and name not in needed:
            role.sleeper.set_resident("none")
    for name, role in roles.items():
        if role.sleeper is not None and name in needed:
            role.sleeper.set_resident(needed[name])
    return resident_bytes([t for r in roles.values() for t in r.tensors()])


PREFETCH = {"on": False}
"""--offload-prefetch (`set_prefetch`): `ahead()` wakes the next phase's roles during the current phase's last step."""
_AHEAD: list = []  # the pending wake of the next phase's roles, set by `run_steps` for the phase that runs


def set_prefetch(on: bool) -> None:
    PREFETCH["on"] = bool(on)


def wake_ahead(phase: str, roles: dict[str, Role], table: PhaseTable) -> None:
    """Wake, without putting anything to sleep, what `phase` of `table` needs of the sleeping roles: their
    host-to-device copies are queued now, on the side stream, and run while the current phase's last step computes;
    `enter_phase` then finds them awake. The roles of both phases are resident meanwhile."""
    for name, level in phase_needs(table, phase).items():
        sleeper = roles[name].sleeper if name in roles else None
        if sleeper is not None and len(LEVELS[sleeper.level]) < len(LEVELS[level]):  # the parts resident
            sleeper.set_resident(level)


def ahead() -> None:
    """Called by a method's step as its phase's last step starts (DMD2: the last critic step, the last micro-batch's
    last rollout step): with --offload-prefetch, the next phase's roles wake now (`wake_ahead`); else, and on a
    second call, nothing."""
    if _AHEAD:
        _AHEAD.pop()()


def run_steps(steps: Sequence[PhaseStep], roles: dict[str, Role], batches: list[MicroBatch], table: PhaseTable,
              hook: Optional[Callable[[str], None]] = None) -> tuple[list, dict, dict]:
    """A method's cycle: for each step, in order, hook(its phase), `enter_phase`, then the step on what the step
    before handed on. Returns (what each step handed on, the steps' metrics merged, {phase: resident bytes}).
    With --offload-prefetch a step's `ahead()` wakes the next step's roles (after the last step: the first's, the
    next cycle's)."""
    hook = hook or (lambda phase: None)
    given, handed, metrics, resident = None, [], {}, {}
    for i, step in enumerate(steps):
        hook(step.name)
        resident[step.name] = enter_phase(step.name, roles, table)
        _AHEAD.clear()
        if PREFETCH["on"]:
            nxt = steps[(i + 1) % len(steps)].name
            _AHEAD.append(lambda nxt=nxt: wake_ahead(nxt, roles, table))
        try:
            given, more = step.run(roles, batches, given)
        finally:
            _AHEAD.clear()
        handed.append(given)
        metrics.update(more)
    return handed, metrics, resident
