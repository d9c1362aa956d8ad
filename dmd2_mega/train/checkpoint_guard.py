"""What a checkpoint is, and the checks that keep a run from loading it into the wrong place, writing over
what it loads, or resuming it under different settings.

Identity: every payload records `role` (teacher, student or critic) and `family` (the model family of its
--model-size). A checkpoint written before roles were recorded is a teacher's (the student and critic
payloads always carried `role`).
  `check_role`      a payload loaded into a role that does not accept it is an error naming both;
  `check_save_dirs` a directory the run writes (--save, <save>_critic) must not be, contain or lie inside
                    a directory it loads into ANOTHER role (--save = --teacher-load would overwrite the teacher);
  `check_resume`    on --load, every setting the checkpoint's state depends on (model size, batch sizes, and
                    for DMD2 K, scoring, loss space and the student's sigma grid) must equal the flags: a
                    mismatch names the flag and both values. The LR schedule has its own rule
                    (`checkpoint.load_optimizer_state`, Megatron's override flags).
"""
from __future__ import annotations

from typing import Optional, Sequence

from dmd2_mega.errors import CheckpointError
from dmd2_mega.files.path_guard import check_outputs_apart

LEGACY_ROLE = "teacher"  # the role of a payload that records none

# (flag, path in the saved `args` dict) of the settings a resume must keep
RESUME_SETTINGS = (("--model-size", ("model", "size")), ("--micro-batch-size", ("train", "micro_batch_size")),
                   ("--global-batch-size", ("train", "global_batch_size")), ("--causal", ("model", "causal")),
                   ("--causal-chunk-frames", ("model", "causal_chunk_frames")),
                   ("--causal-local-attn-chunks", ("model", "causal_local_attn_chunks")),
                   ("--causal-sink-chunks", ("model", "causal_sink_chunks")))
DMD2_RESUME_SETTINGS = RESUME_SETTINGS + (
    ("--dmd2-critic-steps-per-rollout", ("dmd2", "critic_steps_per_rollout")),
    ("--dmd2-critic-scoring", ("dmd2", "critic_scoring")),
    ("--dmd2-critic-loss-space", ("dmd2", "critic_loss_space")))


def payload_role(payload: dict) -> str:
    return payload.get("role", LEGACY_ROLE)


def check_role(payload: dict, accepted: Sequence[str], flag: str, root: str, hint: str = "") -> None:
    """CheckpointError if `payload`'s role is not one of `accepted` (`flag` gave `root`)."""
    role = payload_role(payload)
    if role not in accepted:
        raise CheckpointError(f"{flag} {root} holds a {role} checkpoint, but {flag} takes a "
                              f"{' or '.join(accepted)} checkpoint{hint}")


def check_family(payload: dict, family: str, flag: str, root: str) -> None:
    saved = payload.get("family")
    if saved is not None and saved != family:
        raise CheckpointError(f"{flag} {root} holds a {saved} model, but this run's --model-size is a {family} model")


def check_save_dirs(saves: Sequence[tuple[str, str, str]], loads: Sequence[tuple[str, Optional[str], str]]) -> None:
    """saves: (what, directory, role written there); loads: (flag, directory or None, role it is loaded into).
    ConfigError (path_guard's) when a save directory is, contains or lies inside a directory loaded into another
    role; a role may load from where it saves (a resume)."""
    for what, s_dir, s_role in saves:
        check_outputs_apart([(what, s_dir, f"where the {s_role} is saved")],
                            [(flag, l_dir, f"loaded as the {l_role}") for flag, l_dir, l_role in loads if l_role != s_role])


def _get(args: dict, path: tuple):
    for key in path:
        if not isinstance(args, dict) or key not in args:
            return None
        args = args[key]
    return args


def check_resume(payload: dict, args_now: dict, settings: Sequence[tuple[str, tuple]], root: str,
                 extra: Sequence[tuple[str, object, object]] = ()) -> None:
    """CheckpointError naming the first setting of `settings` (flag, args path) whose saved value differs from
    this run's, then of `extra` (flag, saved, now). Settings an older checkpoint lacks are not compared."""
    saved_args = payload.get("args") or {}
    pairs = [(flag, _get(saved_args, path), _get(args_now, path)) for flag, path in settings] + list(extra)
    for flag, saved, now in pairs:
        if saved is not None and saved != now:
            raise CheckpointError(f"--load {root}: {flag} was {saved} when it was saved, this run has {now}; "
                                  f"resume with the value it was saved with, or start a new --save")
