"""Saving and resuming DMD2's trained roles (student, critic) as one pair.

Student in --save, critic in <save>_critic (Megatron layout each), committed together: both
iteration directories are written, then the critic's tracker, then the student's (the commit
point); both payloads carry the same `pair_id`, and a load takes the critic saved with the student.
The student's payload also holds its EMA (`ema`: {parameter name: fp32 tensor}) when --ema-decay > 0
and the student's sigma grid; the critic's holds its GAN head when --dmd2-gan is on (its weights
include `gan_head.*`).
"""
from __future__ import annotations

import os
from dataclasses import asdict

from dmd2_mega.checkpoint import (CheckpointError, commit, iter_dir, load_model_weights, load_payload,
                                  model_size_hint, partition_dims, rng_state, set_rng_state, write_iteration)
from dmd2_mega.dmd2.roles import Role
from dmd2_mega.logger import print_rank0


def critic_dir(save: str) -> str:
    return save.rstrip("/") + "_critic"


def role_payload(tr, role: Role) -> dict:
    """`tr`: the DMD2Trainer (iteration, sampler, cfg, ps, info, sigmas, pair_token, ema)."""
    payload = {"iteration": tr.iteration, "model": role.model.state_dict(),
               "optimizer": role.optimizer.state_dict(), "scheduler": role.schedule.state_dict(),
               "sampler": tr.sampler.state_dict(), "rng": rng_state(), "args": asdict(tr.cfg),
               "data_info": tr.info, "tp_size": tr.ps.tp_size, "dp_size": tr.ps.dp_size,
               "partition_dims": partition_dims(role.model), "role": role.name,
               "student_sigmas": tr.sigmas.tolist(), "pair_id": f"{tr.iteration}-{tr.pair_token}",
               "checkpoint_version": 1}
    if role.name == "student" and tr.ema is not None:
        payload["ema"] = tr.ema.state_dict()
    return payload


def save_pair(tr) -> None:
    """Both roles' iteration directories, then the critic's tracker, then the student's (the commit)."""
    for name in ("critic", "student"):
        role = tr.roles[name]
        if role.sleeper is not None:
            role.sleeper.wake()
        write_iteration(role.save_dir, tr.iteration, role_payload(tr, role), tr.ps)
    commit([tr.roles["critic"].save_dir, tr.roles["student"].save_dir], tr.iteration, tr.ps)
    tr.saved_iteration = tr.iteration
    print_rank0(f"> saved student{' (+ EMA)' if tr.ema is not None else ''} to {tr.cfg.train.save} and "
                f"critic to {critic_dir(tr.cfg.train.save)} at cycle {tr.iteration}", tr.ps.rank)


def _load_ema(tr, student: dict, root: str) -> None:
    if tr.ema is None:
        if "ema" in student:
            print_rank0(f"> WARNING: --load {root} holds a student EMA but --ema-decay is 0: it is dropped",
                        tr.ps.rank)
        return
    if "ema" not in student:
        print_rank0(f"> WARNING: --load {root} holds no student EMA (saved without --ema-decay): the EMA "
                    f"starts from the loaded weights", tr.ps.rank)
        tr.ema.load_state_dict({n: p.detach().float() for n, p in zip(tr.ema.names, tr.ema.params)})
        return
    tr.ema.load_state_dict(student["ema"], f"--load {root} (student EMA)")


def load_pair(tr, root: str) -> None:
    """Resume student, critic (and the student's EMA) from `root` and `root`_critic."""
    ps, t = tr.ps, tr.cfg.train
    student = load_payload(root, ps)
    if student is None:
        print_rank0(f"> WARNING: no checkpoint in --load {root}; starting from --teacher-load", ps.rank)
        return
    cdir, n = critic_dir(root), int(student["iteration"])
    if not os.path.isdir(cdir):
        raise CheckpointError(f"--load {root}: the critic directory {cdir} is missing")
    if not any(os.path.isdir(iter_dir(cdir, n) + s_) for s_ in ("", ".old")):
        raise CheckpointError(f"--load {root}: the critic directory {cdir} holds no checkpoint of cycle {n} "
                              f"(expected {iter_dir(cdir, n)}/, saved with the student of cycle {n})")
    critic = load_payload(cdir, ps, iteration=n, pair_id=student.get("pair_id"))
    for name, payload in (("student", student), ("critic", critic)):
        role = tr.roles[name]
        hint = model_size_hint(payload, tr.cfg.model.size)
        if name == "critic" and tr.cfg.dmd2.gan != any(k.startswith("gan_head.") for k in payload["model"]):
            hint = (f" (the critic was saved {'without' if tr.cfg.dmd2.gan else 'with'} the GAN head; this run "
                    f"{'has' if tr.cfg.dmd2.gan else 'has no'} --dmd2-gan)")
        load_model_weights(role.model, payload["model"], f"--load {root} ({name})", hint)
        if t.no_load_optim:
            continue
        if payload["saved_tp_size"] != ps.tp_size:
            raise CheckpointError(f"--load {root} ({name}) was saved with --tensor-model-parallel-size "
                                  f"{payload['saved_tp_size']} but this run uses {ps.tp_size}: weights "
                                  f"reshard, optimizer state does not; pass --no-load-optim to continue from "
                                  f"the weights with fresh optimizers")
        role.optimizer.load_state_dict(payload["optimizer"])
        role.schedule.load_state_dict(payload["scheduler"])
    _load_ema(tr, student, root)
    if t.no_load_optim:
        print_rank0(f"> loaded student and critic weights of cycle {student['iteration']} from {root} "
                    f"(fresh optimizers, cycle 0)", ps.rank)
        return
    tr.sampler.load_state_dict(student["sampler"])
    if not t.no_load_rng:
        set_rng_state(student["rng"])
    tr.iteration = int(student["iteration"])
    if t.save and os.path.abspath(root) == os.path.abspath(t.save):
        tr.saved_iteration = tr.iteration  # nothing new to save until the next cycle
    print_rank0(f"> resumed student and critic from {root} at cycle {tr.iteration}", ps.rank)
