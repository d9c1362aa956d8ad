"""What a distillation method is, for the shared machinery: its phase table, its micro-batch records, what a
cycle returns, and the `Method` protocol the student trainer (`methods.trainer.StudentTrainer`) runs.

A method is (DESIGN section 10):
    a phase table   the phases of one cycle, in order; each names the roles it needs resident ("all": weights and,
                    if trained, grads + optimizer state; "weights": a frozen forward) and the role its optimizer
                    step trains (or none). A role no phase of the table names is not built.
    its settings    a frozen dataclass built once from the config (DMD2: `methods.dmd2.records.DMD2Settings`)
    its steps       `method.steps()`: the cycle's phases as functions of plain data (`PhaseStep`), in table order;
                    each builds the calls of its phase from the roles, the micro-batch records and what the step
                    before handed on. Written once: the cycle runs them and the cycle benchmarks time them alone.
    its cycle       `method.cycle(roles, batches, hook)`: one iteration over the shared roles, `roles.run_steps` of
                    its steps, entering each phase through `roles.enter_phase(phase, roles, method.phases)`
                    (time-slicing).
Everything else (roles and their builders, time-slicing, rollout, the pair checkpoint, the EMA, the loop,
the eval) is shared and takes the table as an argument.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor

# Generator streams of micro-batch j: parallel.micro_batch_generator(seed, cycle, j, device, stream), one generator
# per (j, stream) for the whole run, re-seeded each cycle (`trainer.StudentTrainer.micro_batches`);
# STOPS is a host (CPU) generator: the rollout's stop steps, known on the host without a device sync
ROLLOUT, CRITIC, ACTOR, STOPS = 0, 1, 2, 3


@dataclass(frozen=True)
class Phase:
    """One phase of a cycle: `needs` {role: "all" | "weights"} (a role not named sleeps), `trains` the role whose
    optimizer steps in it (None: no optimizer step)."""

    name: str
    needs: Mapping[str, str]
    trains: Optional[str] = None


PhaseTable = tuple  # tuple[Phase, ...] in cycle order


def phase_needs(table: PhaseTable, phase: str) -> dict[str, str]:
    """{role: residency} of `phase` in `table`."""
    for p in table:
        if p.name == phase:
            return dict(p.needs)
    raise KeyError(f"no phase {phase!r} in the table {[p.name for p in table]}")


def with_needs(table: PhaseTable, more: Mapping[str, Mapping[str, str]]) -> PhaseTable:
    """`table` with the roles of `more` ({phase: {role: residency}}) added to those phases (a method's optional
    part, e.g. DMD2's GAN head, adds its roles this way)."""
    return tuple(Phase(p.name, {**p.needs, **more.get(p.name, {})}, p.trains) for p in table)


def table_roles(table: PhaseTable) -> tuple[str, ...]:
    """Every role the table names, in order of first appearance."""
    return tuple(dict.fromkeys(r for p in table for r in p.needs))


def trained_in(table: PhaseTable) -> dict[str, str]:
    """{phase: the role it trains} for the phases with an optimizer step, in cycle order."""
    return {p.name: p.trains for p in table if p.trains is not None}


@dataclass(frozen=True)
class MicroBatch:
    """Micro-batch j of a cycle on this rank (global index j over all DP ranks). The trainer's generators are the
    run's, re-seeded each cycle: a record kept past its cycle draws the next cycle's numbers (`snapshot` keeps them)."""

    index: int
    cond: Tensor                 # [F*B, ...] conditions (F = the method's `data_factor`), on the compute device
    sample_id_offset: int        # sample ids of the micro-batch: offset + [0, F*B)
    rollout_gen: torch.Generator  # stream ROLLOUT: the noise of the rollout
    critic_gen: torch.Generator   # stream CRITIC: every draw of the critic phase
    actor_gen: Optional[torch.Generator] = None  # stream ACTOR: draws of the actor phase (DMD2: the GAN head's noise)
    real: Optional[Tensor] = None  # [F*B, *shape] the dataset samples of these conditions (methods that read them)
    stop_gen: Optional[torch.Generator] = None  # stream STOPS on the CPU: the rollout's stop steps (None:
    #                                             rollout_gen, which must then be a CPU generator)

    def snapshot(self) -> "MicroBatch":
        """This record with new generators at its generators' present states: a step run on the copy draws what
        it would draw on this record, whose generators stay where they are (the cycle benchmarks' pieces)."""
        return replace(self, **{name: _copy_generator(getattr(self, name)) for name in GENERATORS})

    def generator_states(self) -> tuple:
        """The states of its generators (None for an absent one), in `GENERATORS` order."""
        return tuple(None if g is None else g.get_state() for g in (getattr(self, n) for n in GENERATORS))


GENERATORS = ("rollout_gen", "critic_gen", "actor_gen", "stop_gen")  # a micro-batch record's generator fields


def _copy_generator(gen: Optional[torch.Generator]) -> Optional[torch.Generator]:
    if gen is None:
        return None
    copy = torch.Generator(device=gen.device)
    copy.set_state(gen.get_state())
    return copy


@dataclass(frozen=True)
class PhaseStep:
    """One phase of a method's cycle as a function: `run(roles, batches, given) -> (handed, metrics)`. `given` is
    what the step before handed on (None for the first step), `handed` what this one hands to the next (plain data:
    rollouts, scores), `metrics` {name: device scalar}. The step builds every call of its phase (which generator
    feeds which draw) from these arguments alone, so whoever runs it, the cycle or a benchmark, runs the same calls."""

    name: str                                      # the phase of the method's table it runs in
    run: Callable[[dict, list, Any], tuple[Any, dict]]


@dataclass(frozen=True)
class CycleResult:
    metrics: dict   # name -> device scalar (no host sync), e.g. critic-loss, actor-dmd-loss, grad norms
    resident: dict  # phase -> device bytes of all roles after entering it
    rollout_forwards: Optional[Tensor] = None  # device scalar: student sample-forwards of the rollout (if any)


class Method(Protocol):
    """What the shared student trainer needs of a method (DMD2: `methods.dmd2.method.DMD2Method`).

    Built once per run by `build(cfg, shape, device)` (a `MethodBuilder`)."""

    name: str                 # the run's name in the start-up and closing lines ("DMD2")
    roles: tuple              # class attribute: every role, in build order (read before the method is built)
    trained: tuple            # class attribute: the roles with an optimizer, the student last (the save order)
    phases: PhaseTable        # the cycle's phases, in order, the method's optional parts merged in
    eval_phase: str           # the phase entered to sample from the student for the eval
    data_factor: int          # each micro-batch draws data_factor x B dataset rows (DMD2: K)
    reads_samples: bool       # the micro-batches carry the dataset's samples (`MicroBatch.real`), not only conditions
    student_sigmas: Tensor    # [N] fp32 shifted: the few-step student's sampler grid (eval, checkpoints)
    resume_settings: Sequence  # (flag, path in the saved args) a resume must keep (`checkpoint_guard.check_resume`)

    def steps(self) -> tuple:
        """The cycle's phases as `PhaseStep`s, in the order of `phases`: what `cycle` runs."""

    def cycle(self, roles: dict, batches: list[MicroBatch],
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
        """One iteration, `roles.run_steps(self.steps(), ...)`; `hook(phase)` is called as each phase starts (the
        phase clock)."""

    def init_model(self, name: str, model: torch.nn.Module, state: dict, load: Callable) -> torch.nn.Module:
        """Role `name`'s model with its init weights from the state dict `state`: `load(module, state)` loads a
        state dict into a module (with the flag and hint of its error); the result may wrap `model`."""

    def load_hint(self, name: str, state: dict) -> str:
        """Why the saved state dict of role `name` may not load into this run ("" when nothing to say)."""

    def describe(self, num_micro_batches: int, null_note: str) -> str:
        """The start-up line's settings after `B=...`."""

    def describe_parts(self, roles: dict) -> str:
        """The start-up line's optional parts (DMD2: the GAN head)."""

    def plan_offload(self, cfg, ps, info: dict, budget: float) -> tuple[frozenset, dict, bool]:
        """On CUDA without an offload flag (--offload-roles, --[no-]offload-inactive): (the roles that sleep, phase
        peak bytes, fits) within `budget` bytes."""

    def flops_per_iter(self, per_sample, num_micro_batches: int) -> Optional[float]:
        """Model FLOPs of one iteration on this rank (None when unknown)."""

    # Optional members (absent: the default in brackets):
    #   reads_trajectories: bool   class attribute [False]: --data is a trajectory set (`data.trajectories`), whose
    #                              samples (`MicroBatch.real`) are the teacher's paths [F*B, N + 1, *shape]
    #   check_data(dataset)        ConfigError when the data does not fit the method (e.g. another student grid)
    #   model_config(name, cfg)    the `config.ModelConfig` role `name` is built with [cfg] (Self-Forcing: a causal
    #                              student beside a bidirectional critic and teacher)


MethodBuilder = Callable[..., Method]  # (cfg: config.DistillConfig, shape, device) -> Method
