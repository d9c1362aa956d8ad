"""What a checkpoint is, and the checks that keep a run from loading it into the wrong place, writing over
what it loads, or resuming it under different settings.

Identity: every payload records `role` (teacher, student or critic) and `family` (the model family of its
--model-size). A checkpoint written before roles were recorded is a teacher's (the student and critic
payloads always carried `role`).
  `check_role`      a payload loaded into a role that does not accept it is an error naming both;
  `check_save_dirs` a directory the run writes (--save, <save>_critic) must not be, contain or lie inside
                    a directory it loads into ANOTHER role (--save = --teacher-load would overwrite the teacher);
  `check_fresh_save` a directory the run writes checkpoints into must not hold another run's: only a resume (--load
                    names it, or names the run whose <save>_<role> it is) or --overwrite-save writes there;
  `check_resume`    on --load, every setting the checkpoint's state depends on (model size, batch sizes, and
                    for DMD2 K, scoring, loss space and the student's sigma grid) must equal the flags: a
                    mismatch names the flag and both values. The LR schedule has its own rule
                    (`checkpoint.load_optimizer_state`, Megatron's override flags).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dmd2_mega.errors import CheckpointError
from dmd2_mega.files.path_guard import check_outputs_apart
from dmd2_mega.train.checkpoint import TRACKER

LEGACY_ROLE = "teacher"  # the role of a payload that records none

# (flag, path in the saved `args` dict[, the path of the switch in this run's args without which it is not compared])
# of the settings a resume must keep: what the saved state depends on and what changes the maths of the steps to come
# (the LR schedule has its own rule: `checkpoint.load_optimizer_state`)
RESUME_SETTINGS = (("--model-size", ("model", "size")), ("--micro-batch-size", ("train", "micro_batch_size")),
                   ("--global-batch-size", ("train", "global_batch_size")),
                   ("--timestep-shift", ("train", "timestep_shift")), ("--causal", ("model", "causal")),
                   ("--causal-chunk-frames", ("model", "causal_chunk_frames")),
                   ("--causal-local-attn-chunks", ("model", "causal_local_attn_chunks")),
                   ("--causal-sink-chunks", ("model", "causal_sink_chunks")),
                   ("--causal-context-noise", ("model", "causal_context_noise")))
DMD2_RESUME_SETTINGS = RESUME_SETTINGS + (
    ("--distill-method", ("dmd2", "distill_method")),
    ("--dmd2-critic-steps-per-rollout", ("dmd2", "critic_steps_per_rollout")),
    ("--dmd2-critic-scoring", ("dmd2", "critic_scoring")),
    ("--dmd2-critic-loss-space", ("dmd2", "critic_loss_space")),
    ("--dmd2-teacher-guidance-scale", ("dmd2", "teacher_guidance_scale")),
    ("--dmd2-score-sigma-range", ("dmd2", "score_sigma_range")),
    ("--dmd2-critic-grid-size", ("dmd2", "critic_grid_size")),
    # the GAN head's settings, where this run has the head (--dmd2-gan itself: the critic's saved state says
    # whether it has one, `GANSettings.load_hint`)
    *((flag, ("gan", key), ("gan", "enabled")) for flag, key in (
        ("--dmd2-gan-feature-layer", "feature_layer"), ("--dmd2-gan-noise / --no-dmd2-gan-noise", "noise"),
        ("--dmd2-gan-sigma-range", "sigma_range"), ("--dmd2-gan-disc-weight", "disc_weight"),
        ("--dmd2-gan-gen-weight", "gen_weight"))))
MISSING = object()  # a setting an older checkpoint does not record: not compared


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


def holds_checkpoints(directory: Optional[str]) -> Optional[str]:
    """What of a checkpoint `directory` holds (its tracker, or its iteration folders), or None: nothing, or no
    such directory."""
    if not directory or not os.path.isdir(directory):
        return None
    names = os.listdir(directory)
    if TRACKER in names:
        with open(os.path.join(directory, TRACKER)) as f:
            return f"checkpoints up to iteration {f.read().strip() or '?'}"
    iters = sorted(n for n in names if n.startswith("iter_"))
    return f"{len(iters)} iteration folder(s) ({', '.join(iters[:3])}{', ...' if len(iters) > 3 else ''})" if iters \
        else None


def check_fresh_save(saves: Sequence[tuple[str, Optional[str]]], resumed: Sequence[Optional[str]],
                     overwrite: bool) -> list[str]:
    """saves: (what, directory) the run writes checkpoints into; resumed: the directories it resumes from (--load
    and, for a pair, its <load>_<role> folders). CheckpointError naming the first save directory that holds
    checkpoints and is not resumed from (a fresh run would replace them and move the tracker), unless `overwrite`
    (--overwrite-save): then the start-up notes to log, one per such directory."""
    resumed_real = {os.path.realpath(d) for d in resumed if d}
    notes = []
    for what, directory in saves:
        held = holds_checkpoints(directory)
        if held is None or os.path.realpath(directory) in resumed_real:
            continue
        if not overwrite:
            raise CheckpointError(f"{what} {directory} holds {held} of another run; this run would write over them. "
                                  f"Resume it with --load {directory}, choose another --save, or give "
                                  f"--overwrite-save to write there anyway")
        notes.append(f"> --overwrite-save: {what} {directory} holds {held} of another run; this run writes over them")
    return notes


def _get(args: dict, path: tuple):
    for key in path:
        if not isinstance(args, dict) or key not in args:
            return MISSING
        args = args[key]
    return args


def _same(saved, now) -> bool:
    """Equal, a saved tuple and the same list (or the reverse) included."""
    seq = (list, tuple)
    return list(saved) == list(now) if isinstance(saved, seq) and isinstance(now, seq) else saved == now


def check_resume(payload: dict, args_now: dict, settings: Sequence[tuple[str, tuple]], root: str,
                 extra: Sequence[tuple[str, object, object]] = ()) -> None:
    """CheckpointError naming the first setting of `settings` (flag, args path[, switch path]) whose saved value
    differs from this run's, None (a default such as "all chunks") being a value like any other, then of `extra`
    (flag, saved, now). A setting an older checkpoint does not record (`MISSING`), or whose switch is off in this run,
    is not compared."""
    saved_args = payload.get("args") or {}
    pairs = [(flag, _get(saved_args, path), _get(args_now, path)) for flag, path, *when in settings
             if not when or _get(args_now, when[0]) is True] + list(extra)
    for flag, saved, now in pairs:
        if saved is not MISSING and now is not MISSING and not _same(saved, now):
            raise CheckpointError(f"--load {root}: {flag} was {_shown(saved)} when it was saved, this run has "
                                  f"{_shown(now)}; resume with the value it was saved with, or start a new --save")


def _shown(value) -> str:
    return "not given (None)" if value is None else str(value)
