"""Saving and resuming DMD2's trained roles (student, critic) as one pair.

Student in --save, critic in <save>_critic (Megatron layout each, `checkpoint.py`), committed
together: both iteration directories are written, then the critic's tracker, then the student's (the
commit point); both payloads carry the same `pair_id` (cycle + the run's pair token), and a load takes
the critic saved with the student. The student's payload also holds its EMA (`ema`: {parameter name:
fp32 tensor}) when --ema-decay > 0 and the student's sigma grid; the critic's holds its GAN head when
--dmd2-gan is on (a `GANCritic`: keys `trunk.*` and `head.*`).
`save_pair` and `load_pair` take the roles and a `checkpoint.RunState` and return the new RunState:
they read nothing else of the trainer.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Optional, Sequence

from dmd2_mega.train.checkpoint import (RunState, commit, iter_dir, load_model_weights, load_optimizer_state, load_payload,
                                  model_size_hint, resumed, set_rng_state, training_payload, write_iteration)
from dmd2_mega.train.checkpoint_guard import DMD2_RESUME_SETTINGS, check_resume, check_role
from dmd2_mega.config import DistillConfig
from dmd2_mega.dmd2.ema import StudentEMA
from dmd2_mega.dmd2.gan import holds_head
from dmd2_mega.dmd2.roles import Role
from dmd2_mega.errors import CheckpointError
from dmd2_mega.train.logger import print_rank0
from dmd2_mega.distributed.parallel import ParallelState

TRAINED = ("critic", "student")  # save order: the student's tracker is the commit point


def critic_dir(save: str) -> str:
    return save.rstrip("/") + "_critic"


def role_payload(role: Role, state: RunState, static: dict, ps: ParallelState,
                 ema: Optional[StudentEMA]) -> dict:
    """`static`: what every payload of the run carries (args, data_info, student_sigmas)."""
    payload = training_payload(role.model, role.optimizer, role.schedule, state, static, ps)
    payload.update(role=role.name, pair_id=f"{state.iteration}-{state.pair_token}")
    if role.name == "student" and ema is not None:
        payload["ema"] = ema.state_dict()
    return payload


def save_pair(roles: dict[str, Role], state: RunState, static: dict, ps: ParallelState,
              ema: Optional[StudentEMA] = None) -> RunState:
    """Both roles' iteration directories, then the critic's tracker, then the student's (the commit).
    Collective. Returns `state` with saved_iteration = iteration."""
    for name in TRAINED:
        role = roles[name]
        if role.sleeper is not None:
            role.sleeper.wake()
        write_iteration(role.save_dir, state.iteration, role_payload(role, state, static, ps, ema), ps)
    commit([roles[n].save_dir for n in TRAINED], state.iteration, ps)
    print_rank0(f"> saved student{' (+ EMA)' if ema is not None else ''} to {roles['student'].save_dir} and "
                f"critic to {roles['critic'].save_dir} at cycle {state.iteration}", ps.rank)
    return replace(state, saved_iteration=state.iteration)


def _load_ema(ema: Optional[StudentEMA], student: dict, root: str, rank: int) -> None:
    if ema is None:
        if "ema" in student:
            print_rank0(f"> WARNING: --load {root} holds a student EMA but --ema-decay is 0: it is dropped", rank)
        return
    if "ema" not in student:
        print_rank0(f"> WARNING: --load {root} holds no student EMA (saved without --ema-decay): the EMA "
                    f"starts from the loaded weights", rank)
        ema.load_state_dict({n: p.detach().float() for n, p in zip(ema.names, ema.params)})
        return
    ema.load_state_dict(student["ema"], f"--load {root} (student EMA)")


def load_pair(roles: dict[str, Role], root: str, state: RunState, cfg: DistillConfig, ps: ParallelState,
              ema: Optional[StudentEMA] = None, static_sigmas: Sequence[float] = ()) -> RunState:
    """Resume student, critic (and the student's EMA) from `root` and `root`_critic; returns the resumed
    RunState (iteration, sampler position; `state` itself when `root` holds no checkpoint, and
    iteration 0 with --no-load-optim). Restores the RNG state unless --no-load-rng. A resume (not
    --no-load-optim) checks the roles and every setting the state depends on (`checkpoint_guard`), the
    student's sigma grid (`static_sigmas`, this run's) included."""
    t = cfg.train
    student = load_payload(root, ps)
    if student is None:
        print_rank0(f"> WARNING: no checkpoint in --load {root}; starting from --teacher-load", ps.rank)
        return state
    cdir, n = critic_dir(root), int(student["iteration"])
    if not os.path.isdir(cdir):
        raise CheckpointError(f"--load {root}: the critic directory {cdir} is missing")
    if not any(os.path.isdir(iter_dir(cdir, n) + s_) for s_ in ("", ".old")):
        raise CheckpointError(f"--load {root}: the critic directory {cdir} holds no checkpoint of cycle {n} "
                              f"(expected {iter_dir(cdir, n)}/, saved with the student of cycle {n})")
    critic = load_payload(cdir, ps, iteration=n, pair_id=student.get("pair_id"))
    gan = cfg.gan.enabled
    check_role(student, ("student",), "--load", root, " (pretrain_dmd2.py resumes a student + critic pair)")
    check_role(critic, ("critic",), "--load", cdir)
    if not t.no_load_optim:
        sigmas = [round(s, 6) for s in student.get("student_sigmas") or []]
        now = [round(s, 6) for s in static_sigmas]
        check_resume(student, asdict(cfg), DMD2_RESUME_SETTINGS, root,
                     [("the student's sigma grid (--dmd2-denoising-steps / --dmd2-student-sigmas, shifted)", sigmas or None,
                       now)])
    for name, payload in (("student", student), ("critic", critic)):
        role = roles[name]
        hint = model_size_hint(payload, cfg.model.size)
        if name == "critic" and gan != holds_head(payload["model"]):
            hint = (f" (the critic was saved {'without' if gan else 'with'} the GAN head; this run "
                    f"{'has' if gan else 'has no'} --dmd2-gan)")
        load_model_weights(role.model, payload["model"], f"--load {root} ({name})", hint)
        role.optimizer.sync_masters()  # the fp32 masters follow the loaded weights (a fresh optimizer keeps them)
        if t.no_load_optim:
            continue
        load_optimizer_state(role.optimizer, role.schedule, payload, f"--load {root} ({name})", ps.tp_size,
                             cfg.optim.scheduler_from(), role=name)
    _load_ema(ema, student, root, ps.rank)
    if t.no_load_optim:
        print_rank0(f"> loaded student and critic weights of cycle {n} from {root} (fresh optimizers, cycle 0)",
                    ps.rank)
        return state
    if not t.no_load_rng:
        set_rng_state(student["rng"])
    print_rank0(f"> resumed student and critic from {root} at cycle {n}", ps.rank)
    return resumed(state, student, root, t.save)
