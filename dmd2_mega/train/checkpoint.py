"""Megatron-layout checkpoints, written atomically, loadable at another TP degree (weights).

Layout:
    <save>/latest_checkpointed_iteration.txt          "100"
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt  one file per TP rank (DP rank 0 writes)
Each file holds: model (this TP rank's shard), optimizer, LR schedule, sampler position, RNG
states, iteration, args, tp_size, and the TP partition dim of every parameter.

Atomicity (a SIGKILL at any instant leaves the tracker pointing at a complete checkpoint):
  1. every rank writes its file into `iter_0000100.tmp/` (`files/atomic.atomic_write`: `*.tmp` + fsync +
     os.replace);
  2. once every rank's file is written, rank 0 renames the directory to `iter_0000100/` (`atomic.durable_replace`:
     os.replace + fsync of --save; re-saving an iteration moves the previous `iter_0000100/` to
     `iter_0000100.old/` first; a load falls back to `.old`);
  3. rank 0 replaces the tracker (`atomic_write`, then an fsync of --save): the commit point; then `.old` and
     any `iter_*.tmp/` left by a killed save go.
`save_checkpoint` is 1-3 for one directory. `write_iteration` (1-2) and `commit` (3 for several
directories, the LAST one's tracker being the commit point) let DMD2 commit the student and
<save>_critic of one cycle together: both directories are written, then the critic's tracker, then
the student's; a load reads the student's tracker and the critic at that same iteration. Older
iterations are never deleted. `resilience.kill_point` marks the stages for the crash tests.

Failure (a full disk, a read-only or vanished --save): each step is followed, in place of a barrier, by a
collective vote on whether it succeeded on every rank, whatever exception the writer raised (an OSError, or
torch's zip writer's `RuntimeError: ... unexpected pos A vs B` wrapping the ENOSPC). On a failure every rank
raises the same one-line CheckpointError naming the file, the rank and the cause; iter_N.tmp/ is removed and the
tracker still names the previous checkpoint (a failed tracker write leaves iter_N/ complete but not committed,
as a kill at before-tracker does). No rank is left waiting in a collective for one that died.

Integrity: torch.save writes a zip with a CRC-32 per member, which torch.load does not check; `_read`
verifies every CRC first, so a truncated or bit-flipped file is a CheckpointError naming it, never a
checkpoint that loads with wrong values. Cost: one extra sequential read of the file per load.

Resharding: a checkpoint saved at TP=a loads its weights at TP=b by concatenating every sharded
parameter over the a files along its partition dim and slicing b ways. Optimizer state is not
resharded: resuming it at another TP degree is an error naming both degrees.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import zipfile
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from dmd2_mega.files.atomic import atomic_write, durable_replace, fsync_path, write_error_text
from dmd2_mega.errors import CheckpointError
from dmd2_mega.distributed.megatron_compat import rng_tracker_states, set_rng_tracker_states
from dmd2_mega.distributed.parallel import ParallelState, any_rank, tp_partition_dim
from dmd2_mega.train.resilience import kill_point

@dataclass(frozen=True)
class RunState:
    """Where a run stands, besides its roles' tensors: what a save records and a resume restores.

    iteration: completed iterations (cycles); saved_iteration: the iteration --save holds from this
    process (None: nothing yet), so the final save is skipped when it is already there; sampler:
    `GlobalBatchSampler.state_dict()` (the data position, consumed_samples) of the save or resume;
    pair_token: DMD2's per-process token that, with the iteration, ties a student save to its critic save.
    """

    iteration: int = 0
    saved_iteration: Optional[int] = None
    sampler: Optional[dict] = None
    pair_token: str = ""


def resumed(state: RunState, payload: dict, root: str, save: Optional[str]) -> RunState:
    """`state` after resuming `payload` (its iteration and sampler position) from `root`; when --save is
    the --load directory, that iteration is already saved (nothing new to save until the next one)."""
    n = int(payload["iteration"])
    same = bool(save) and os.path.abspath(root) == os.path.abspath(save)
    return replace(state, iteration=n, sampler=payload["sampler"], saved_iteration=n if same else None)


TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
RESHARDED = ("model", "ema")  # payload entries keyed by parameter name, resharded on a TP change


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(iteration_dir: str, tp_rank: int) -> str:
    """The file of TP rank `tp_rank` inside an iteration directory (iter_N/, or its .tmp / .old)."""
    return os.path.join(iteration_dir, f"mp_rank_{tp_rank:02d}", FILENAME)


def partition_dims(model: torch.nn.Module) -> dict:
    return {name: tp_partition_dim(p) for name, p in model.named_parameters()}


def training_payload(model: torch.nn.Module, optimizer, schedule, state: RunState, static: dict,
                     ps: ParallelState) -> dict:
    """One rank's payload of a trained model: its shard, optimizer, LR schedule, the run state (iteration,
    sampler position), RNG states, TP / DP sizes, partition dims, and `static` (args, data_info, ...)."""
    return {**static, "iteration": state.iteration, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": schedule.state_dict(), "sampler": state.sampler, "rng": rng_state(), "tp_size": ps.tp_size,
            "dp_size": ps.dp_size, "partition_dims": partition_dims(model), "checkpoint_version": 1}


# the flags that set each LR-schedule value (a DMD2 critic's own lr / min-lr have their --critic-* flags)
SCHEDULE_FLAGS = {"lr": "--lr", "min_lr": "--min-lr", "warmup_iters": "--lr-warmup-iters",
                  "decay_iters": "--lr-decay-iters (default: --train-iters)", "style": "--lr-decay-style"}


def load_optimizer_state(optimizer, schedule, payload: dict, source: str, tp_size: int,
                         scheduler_from: Optional[str] = None, role: str = "") -> None:
    """Restore optimizer and LR schedule from `payload`; a TP change is an error naming both degrees.

    The schedule (Megatron's rule): when a value differs between the checkpoint and the flags, the resume is
    an error naming the flag and both values, unless `scheduler_from` says which side wins: "flags"
    (--override-opt-param-scheduler) or "checkpoint" (--use-checkpoint-opt-param-scheduler)."""
    if payload["saved_tp_size"] != tp_size:
        raise CheckpointError(f"{source} was saved with --tensor-model-parallel-size {payload['saved_tp_size']} "
                              f"but this run uses {tp_size}: weights reshard, optimizer state does not; pass "
                              f"--no-load-optim to continue from the weights with a fresh optimizer")
    mismatch = schedule.mismatches(payload["scheduler"])
    if mismatch and scheduler_from is None:
        key, saved, now = mismatch[0]
        flag = SCHEDULE_FLAGS[key]
        if role == "critic" and key in ("lr", "min_lr"):
            flag = f"--critic-{flag[2:]} (default {flag})"
        raise CheckpointError(f"{source}: the LR schedule differs: {flag} was {saved} when it was saved, this run "
                              f"has {now}; pass --override-opt-param-scheduler to use the flags or "
                              f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler_from != "flags":
        schedule.load_state_dict(payload["scheduler"])


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": rng_tracker_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    set_rng_tracker_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def check_writable(root: str) -> None:
    """Fail early (before training) if `--save` cannot be written."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save directory {root!r} is not writable: {e}") from e


def _first_failure(steps: Iterable[tuple[str, Callable[[], None]]]) -> Optional[tuple[str, str]]:
    """Run `steps` ((what, action) in order) until one raises: (its cause in words, its what), or None. Any
    Exception counts, whatever the writer raised; an error in producing a step (a payload) propagates as it is,
    and so does a kill or Ctrl-C (BaseException)."""
    for what, action in steps:
        try:
            action()
        except Exception as e:
            return write_error_text(e), what
    return None


def _agree(steps: Sequence[tuple[str, Callable[[], None]]], ps: ParallelState) -> Optional[str]:
    """Collective, in place of a barrier: run this rank's `steps` (none on a rank with nothing to do) and
    return, alike on every rank, None if every rank's steps succeeded, else the lowest failing rank's
    `<cause> (<what>[ on rank r])`."""
    failure = _first_failure(steps)
    reason = None
    if failure is not None:
        reason = f"{failure[0]} ({failure[1]}{f' on rank {ps.rank}' if ps.world_size > 1 else ''})"
    if not any_rank(reason is not None, ps.device):
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:  # only after a failure: every rank says the same
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)
        reason = next(r for r in reasons if r is not None)
    return reason


def _write_tracker(root: str, iteration: int) -> None:
    atomic_write(os.path.join(root, TRACKER), lambda f: f.write(str(iteration)), text=True)
    fsync_path(root)


def write_iteration(root: str, iteration: int, payload: dict, ps: ParallelState) -> str:
    """Collective: steps 1-2 of the module docstring (the tracker is untouched); returns iter_N/.

    A step that fails on any rank (a full disk, whatever exception the writer raises) fails the save on every
    rank together: iter_N.tmp/ is removed, the tracker still names the previous checkpoint, and every rank
    raises the same CheckpointError naming the file, the rank and the cause."""
    final, tmp = iter_dir(root, iteration), iter_dir(root, iteration) + ".tmp"
    path = rank_file(tmp, ps.tp_rank)

    def fresh() -> None:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def write() -> None:
        atomic_write(path, lambda f: torch.save(payload, f),
                     before_replace=lambda: kill_point("rank-file-tmp", iteration))
        kill_point("rank-file", iteration)

    stages = ([(f"creating {root}", fresh)] if ps.is_main else [],
              [(f"writing {os.path.relpath(path, root)}", write)] if ps.writes_shards else [],  # one per TP shard
              [(f"renaming {os.path.basename(tmp)}/ to {os.path.basename(final)}/",
                lambda: _rename_into_place(root, tmp, final, iteration))] if ps.is_main else [])
    for steps in stages:
        reason = _agree(steps, ps)
        if reason is not None:
            if ps.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving iteration {iteration} to {root} failed: {reason}; the partial "
                                  f"{os.path.basename(tmp)}/ was removed and the latest checkpoint is "
                                  f"{_latest_text(root)}")
    return final


def _rename_into_place(root: str, tmp: str, final: str, iteration: int) -> None:
    """iter_N.tmp/ -> iter_N/ (a previous iter_N/ moved to iter_N.old/ first, and back if the rename fails)."""
    kill_point("before-dir-rename", iteration)
    aside = os.path.exists(final)
    if aside:  # re-saving an iteration: keep the old one until the commit
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
        kill_point("old-aside", iteration)
    try:
        durable_replace(tmp, final)
    except OSError:
        if aside and not os.path.exists(final):  # the rename itself failed (not the fsync after it): put it back
            os.replace(final + ".old", final)
        raise


def _tracker_value(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _latest_text(root: str) -> str:
    latest = _tracker_value(root)
    return f"still iteration {latest}" if latest is not None else "none yet"


def commit(roots: Sequence[str], iteration: int, ps: ParallelState) -> None:
    """Collective: point each root's tracker at `iteration`, in order; the last is the commit point. A tracker
    that cannot be written (a full disk) is the same CheckpointError on every rank; iter_N/ stays, complete but
    not committed (as after a kill at before-tracker), and the last root's tracker names the latest checkpoint."""
    def point(i: int, root: str) -> None:
        kill_point("between-trackers" if i else "before-tracker", iteration)
        _write_tracker(root, iteration)

    steps = [(f"writing {os.path.join(root, TRACKER)}", lambda i=i, root=root: point(i, root))
             for i, root in enumerate(roots)]
    reason = _agree(steps if ps.is_main else [], ps)
    if reason is not None:
        raise CheckpointError(f"saving iteration {iteration} to {roots[-1]} failed: {reason}; "
                              f"{os.path.basename(iter_dir(roots[-1], iteration))}/ is complete but not committed "
                              f"and the latest checkpoint is {_latest_text(roots[-1])}")
    if ps.is_main:  # best effort, after the commit: the replaced copy, and left-overs of saves killed before a rename
        for root in roots:
            shutil.rmtree(iter_dir(root, iteration) + ".old", ignore_errors=True)
            with contextlib.suppress(OSError):
                for name in os.listdir(root):
                    if name.startswith("iter_") and name.endswith(".tmp"):
                        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_checkpoint(root: str, iteration: int, payload: dict, ps: ParallelState) -> str:
    """Collective over all ranks. `payload` is this rank's dict (model shard, optimizer, ...)."""
    final = write_iteration(root, iteration, payload, ps)
    commit([root], iteration, ps)
    return final


def save_offline(root: str, iteration: int, payloads: Iterable[dict]) -> str:
    """One process writes a whole checkpoint, one payload per TP rank in rank order (`launch/convert_checkpoint.py`;
    an iterator is consumed one payload at a time): the same iter_N.tmp/ -> iter_N/ -> tracker order as a
    training save, so a crash leaves no checkpoint that looks whole."""
    final, tmp = iter_dir(root, iteration), iter_dir(root, iteration) + ".tmp"
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; write the conversion to a new directory")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)

    def discard() -> None:  # final/ was absent before (checked above): only this call's
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)

    writes = ((os.path.relpath(rank_file(tmp, r), root), functools.partial(_save_file, rank_file(tmp, r), payload))
              for r, payload in enumerate(payloads))
    steps = itertools.chain(writes, [(f"renaming {os.path.basename(tmp)}/", lambda: durable_replace(tmp, final)),
                                     (TRACKER, lambda: _write_tracker(root, iteration))])
    try:
        failure = _first_failure(steps)
    except BaseException:  # an error making a payload, or a kill: nothing that looks like a checkpoint is left
        discard()
        raise
    if failure is not None:
        discard()
        raise CheckpointError(f"writing {root} failed: {failure[0]} ({failure[1]}); nothing was kept")
    return final


def _save_file(path: str, payload: dict) -> None:
    atomic_write(path, lambda f: torch.save(payload, f))


def latest_iteration(root: str, flag: str = "--load", missing_ok: bool = False) -> Optional[int]:
    """The iteration in the tracker file; None if `root` exists but holds no checkpoint yet, or (`missing_ok`: a
    --load that is the run's own --save) does not exist yet. `flag` names the flag that gave `root` in errors."""
    if os.path.isfile(root):
        raise CheckpointError(f"{flag} {root!r} is a file; expected a checkpoint directory (holding {TRACKER})")
    if not os.path.isdir(root):
        if missing_ok:
            return None
        raise CheckpointError(f"{flag} directory {root!r} does not exist")
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}")
    return int(text)


def _verify_zip(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt?): {e}") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its member {bad!r} fails the CRC-32 check "
                              f"(bit rot or a partial copy?)")


def _read(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    _verify_zip(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a corrupt pickle inside a zip whose CRCs match
        raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt?): {e}") from e


def load_payload(root: str, ps: ParallelState, iteration: Optional[int] = None,
                 pair_id: Optional[str] = None, flag: str = "--load", missing_ok: bool = False) -> Optional[dict]:
    """This rank's payload, with `model` resharded to the current TP degree if it differs.

    Reads iter_N/, or iter_N.old/ when iter_N/ is missing (a re-save cut between its renames). With
    `pair_id` (DMD2's critic), the first of iter_N/, iter_N.old/ whose payload carries that
    `pair_id` (the student's): a critic is never paired with a student of another save.
    Adds `saved_tp_size` to the payload. Returns None if `root` holds no checkpoint yet (or, `missing_ok`, does not
    exist: `latest_iteration`).
    """
    if iteration is None:
        iteration = latest_iteration(root, flag, missing_ok)
        if iteration is None:
            return None
    final = iter_dir(root, iteration)
    dirs = [d for d in (final, final + ".old") if os.path.isdir(d)] or [final]
    for d in dirs:
        payload = _load_dir(d, ps)
        if pair_id is None or payload.get("pair_id", pair_id) == pair_id:
            return payload
    raise CheckpointError(f"{root}: none of {dirs} was saved together with the student checkpoint being "
                          f"resumed (pair id {pair_id}, found {payload.get('pair_id')}); was --save reused by "
                          f"another run?")


REQUIRED = ("tp_size", "model", "iteration", "partition_dims")


def _load_dir(d: str, ps: ParallelState) -> dict:
    path = rank_file(d, 0 if ps.tp_size > 1 else ps.tp_rank)
    first = _read(path)
    if not isinstance(first, dict) or any(k not in first for k in REQUIRED):
        what = f"a dict without {[k for k in REQUIRED if k not in first]}" if isinstance(first, dict) else \
            f"a {type(first).__name__}"
        raise CheckpointError(f"checkpoint file {path} is not a dmd2-mega checkpoint: it holds {what}")
    saved_tp = int(first["tp_size"])
    if saved_tp == ps.tp_size:
        payload = first if ps.tp_rank == 0 else _read(rank_file(d, ps.tp_rank))
    else:
        others = [_read(rank_file(d, r)) for r in range(1, saved_tp)]
        payload = dict(first)
        for key in RESHARDED:  # the weights, and a DMD2 student's EMA of them (same names)
            if key in first:
                payload[key] = _reshard(first[key], [first[key]] + [o[key] for o in others], first["partition_dims"],
                                        ps.tp_rank, ps.tp_size, saved_tp)
    payload["saved_tp_size"] = saved_tp
    return payload


def _reshard(first: dict, models: list, dims: dict, tp_rank: int, tp_size: int, saved_tp: int) -> dict:
    out = {}
    for name, tensor in first.items():
        dim = dims.get(name)
        if dim is None:
            out[name] = tensor
            continue
        full = torch.cat([m[name] for m in models], dim=dim)
        if full.shape[dim] % tp_size:
            raise CheckpointError(f"parameter {name} (size {full.shape[dim]} along dim {dim}) cannot be split "
                                  f"for --tensor-model-parallel-size {tp_size} (saved at {saved_tp})")
        out[name] = full.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


def model_size_hint(payload: dict, size: str) -> str:
    """' (the checkpoint was saved with --model-size a; this run uses b)' when they differ, else ''."""
    saved = (payload.get("args") or {}).get("model", {}).get("size")
    if not saved or saved == size:
        return ""
    return f" (the checkpoint was saved with --model-size {saved}; this run uses {size})"


def load_model_weights(model: torch.nn.Module, state: dict, source: str, hint: str = "",
                       only: Optional[set] = None) -> None:
    """Strict load that names the first mismatching parameter (in model order) and both shapes,
    and the missing / unexpected names; `hint` (e.g. `model_size_hint`) ends the message. `only`: load these
    entries of the model's state dict only, the rest left as they are (a LoRA role's adapters)."""
    own = model.state_dict()
    if only is not None:
        own = {k: v for k, v in own.items() if k in only}
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    keys = (f"architecture mismatch: {len(missing)} missing {missing[:3]}, {len(unexpected)} unexpected "
            f"{unexpected[:3]}" if missing or unexpected else "")
    hint = hint or " (was it saved with another --model-size or data shape?)"
    for k, v in own.items():
        w = state.get(k)
        if torch.is_tensor(v) and torch.is_tensor(w) and tuple(v.shape) != tuple(w.shape):  # not _extra_state
            raise CheckpointError(f"{source}: parameter {k} has shape {tuple(w.shape)} in the checkpoint but "
                                  f"{tuple(v.shape)} in this model{'; ' + keys if keys else ''}{hint}")
    if keys:
        raise CheckpointError(f"{source}: {keys}{hint}")
    model.load_state_dict(state, strict=len(own) == len(model.state_dict()))
