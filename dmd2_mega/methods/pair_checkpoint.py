"""Saving and resuming a method's trained roles (DMD2: student and critic) as one pair.

`trained` names them, the student last (DMD2: ("critic", "student")). Student in --save, every other one in
<save>_<role> (DMD2: the critic in <save>_critic; Megatron layout each, `checkpoint.py`), committed
together: every iteration directory is written, then the other roles' trackers, then the student's (the
commit point); the payloads carry the same `pair_id` (cycle + the run's pair token), and a load takes
the roles saved with the student. The student's payload also holds its EMA (`ema`: {parameter name:
fp32 tensor}) when --ema-decay > 0 and the student's sigma grid; a role's model state is the method's
(DMD2's critic holds its GAN head when --dmd2-gan is on: keys `trunk.*` and `head.*`); a LoRA role's holds its
adapters only, its base named by path and fingerprint (`train/lora_checkpoint.py`).
`save_pair` and `load_pair` take the roles and a `checkpoint.RunState` and return the new RunState:
they read nothing else of the trainer.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Optional, Sequence

from dmd2_mega.train.checkpoint import (RunState, commit, iter_dir, load_model_weights, load_optimizer_state, load_payload,
                                  model_size_hint, resumed, set_rng_state, training_payload, write_iteration)
from dmd2_mega.train.checkpoint_guard import MISSING, check_resume, check_role
from dmd2_mega.train.lora_checkpoint import adapter_payload, check_base
from dmd2_mega.config import DistillConfig
from dmd2_mega.methods.ema import StudentEMA
from dmd2_mega.methods.roles import Role
from dmd2_mega.errors import CheckpointError
from dmd2_mega.train.logger import print_rank0
from dmd2_mega.distributed.parallel import ParallelState

def role_dir(save: str, name: str) -> str:
    """Where role `name` is saved: the student in --save, another role in <save>_<name> (<save>_critic)."""
    return save if name == "student" else save.rstrip("/") + "_" + name


def _others(trained: Sequence[str]) -> list[str]:
    return [n for n in trained if n != "student"]


def role_payload(role: Role, state: RunState, static: dict, ps: ParallelState,
                 ema: Optional[StudentEMA]) -> dict:
    """`static`: what every payload of the run carries (args, data_info, student_sigmas)."""
    payload = training_payload(role.model, role.optimizer, role.schedule, state, static, ps)
    if role.lora is not None:  # the adapters (and the path and fingerprint of their base), not the base
        payload = adapter_payload(payload, role.model, role.lora)
    payload.update(role=role.name, pair_id=f"{state.iteration}-{state.pair_token}")
    if role.name == "student" and ema is not None:
        payload["ema"] = ema.state_dict()
    return payload


def save_pair(roles: dict[str, Role], state: RunState, static: dict, ps: ParallelState,
              ema: Optional[StudentEMA] = None, trained: Sequence[str] = ("critic", "student")) -> RunState:
    """Every trained role's iteration directory, then the other roles' trackers, then the student's (the commit).
    Collective. Returns `state` with saved_iteration = iteration."""
    for name in trained:
        role = roles[name]
        if role.sleeper is not None:
            role.sleeper.wake()
        write_iteration(role.save_dir, state.iteration, role_payload(role, state, static, ps, ema), ps)
    commit([roles[n].save_dir for n in trained], state.iteration, ps)
    others = "".join(f" and {n} to {roles[n].save_dir}" for n in _others(trained))
    print_rank0(f"> saved student{' (+ EMA)' if ema is not None else ''} to {roles['student'].save_dir}{others} "
                f"at cycle {state.iteration}", ps.rank)
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
              method, ema: Optional[StudentEMA] = None, trained: Sequence[str] = ("critic", "student")) -> RunState:
    """Resume the trained roles (and the student's EMA) from `root` and `root`_<role>; returns the resumed
    RunState (iteration, sampler position; `state` itself when `root` holds no checkpoint, and
    iteration 0 with --no-load-optim). Restores the RNG state unless --no-load-rng. A resume (not
    --no-load-optim) checks the roles and every setting the state depends on (`checkpoint_guard`: the
    method's `resume_settings`), the student's sigma grid (`method.student_sigmas`, this run's) included.
    `method.load_hint(role, state)` says why a saved role may not load (DMD2: a critic with(out) its GAN head)."""
    t = cfg.train
    student = load_payload(root, ps, missing_ok=t.load_is_save())
    if student is None:
        print_rank0(f"> WARNING: no checkpoint in --load {root}; starting from --teacher-load", ps.rank)
        return state
    n, others = int(student["iteration"]), _others(trained)
    payloads = {"student": student}
    names = " + ".join(["student", *others])
    for name in others:
        rdir = role_dir(root, name)
        if not os.path.isdir(rdir):
            raise CheckpointError(f"--load {root}: the {name} directory {rdir} is missing")
        if not any(os.path.isdir(iter_dir(rdir, n) + s_) for s_ in ("", ".old")):
            raise CheckpointError(f"--load {root}: the {name} directory {rdir} holds no checkpoint of cycle {n} "
                                  f"(expected {iter_dir(rdir, n)}/, saved with the student of cycle {n})")
        payloads[name] = load_payload(rdir, ps, iteration=n, pair_id=student.get("pair_id"))
    check_role(student, ("student",), "--load", root, f" (pretrain_dmd2.py resumes a {names} pair)")
    for name in others:
        check_role(payloads[name], (name,), "--load", role_dir(root, name))
    if not t.no_load_optim:
        sigmas = [round(s, 6) for s in student.get("student_sigmas") or []]
        now = [round(s, 6) for s in method.student_sigmas.tolist()]
        check_resume(student, asdict(cfg), method.resume_settings, root,
                     [("the method (--distill-method, or the entry point)", student.get("method", MISSING),
                       method.name),
                      ("the student's sigma grid (--dmd2-denoising-steps / --dmd2-student-sigmas, shifted)",
                       sigmas or MISSING, now)])
    for name in ("student", *others):
        role, payload = roles[name], payloads[name]
        hint = method.load_hint(name, payload["model"]) or model_size_hint(payload, cfg.model.size)
        source, saved = f"--load {root} ({name})", payload.get("lora")
        if (saved is None) != (role.lora is None):
            held = f"LoRA adapters of rank {saved['rank']}" if saved else "full weights"
            raise CheckpointError(f"{source} holds {held}, this run's {name} is "
                                  f"{'LoRA' if role.lora else 'full weights'}: give --{name}-lora-rank "
                                  f"{saved['rank'] if saved else 0}")
        only = None
        if role.lora is not None:
            check_base(saved, role.lora, source, cfg.lora.allow_other_base)
            only = {n for n, p in role.model.named_parameters() if p.requires_grad}
        load_model_weights(role.model, payload["model"], source, hint, only=only)
        role.optimizer.sync_masters()  # the fp32 masters follow the loaded weights (a fresh optimizer keeps them)
        if t.no_load_optim:
            continue
        load_optimizer_state(role.optimizer, role.schedule, payload, f"--load {root} ({name})", ps.tp_size,
                             cfg.optim.scheduler_from(), role=name)
    _load_ema(ema, student, root, ps.rank)
    who = " and ".join(["student", *others])
    if t.no_load_optim:
        print_rank0(f"> loaded {who} weights of cycle {n} from {root} (fresh optimizers, cycle 0)", ps.rank)
        return state
    if not t.no_load_rng:
        set_rng_state(student["rng"])
    print_rank0(f"> resumed {who} from {root} at cycle {n}", ps.rank)
    return resumed(state, student, root, t.save)
