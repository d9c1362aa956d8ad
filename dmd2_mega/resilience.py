"""Failure handling shared by the training loops: preemption exits, non-finite step limits, and the
test-only kill points of the checkpoint writer.

Exit conditions (Megatron's `--exit-signal-handler`, `--exit-duration-in-mins`). `ExitController`
installs a SIGTERM handler that only sets a flag; at the end of every iteration (cycle) the loop
calls `check()`, which all-reduces (MAX over the world) the int32 tensor
    [SIGTERM seen on this rank, rank 0's wall clock since start > limit (rank 0's entry only)]
so every rank takes the same decision at the same iteration, after a complete iteration: the loop
then saves and returns, and the script exits 0.

Non-finite steps. `dmd2_mega.optim.Optimizer` skips a step whose loss or gradient norm is not
finite (weights and Adam state untouched) and counts the skips in device tensors. The same check
(`check(counters)`) carries, after the two flags, each trained role's [skipped this iteration,
consecutive, total] to the host; `account_skips` warns about them and stops the run with
`NonFiniteError` (naming the role and the iteration / cycle) once a role has `--max-nan-iterations`
consecutive skips. Cost: one small collective and ONE host sync per iteration, when an exit flag or
--max-nan-iterations is given (none otherwise: the log interval then reports the skips).

Test hook (tests only; never set it in a real job): `DMD2_MEGA_TEST_KILL_AT=<stage>[@<iteration>]`
makes the process SIGKILL itself at the named stage of a checkpoint save (of that iteration, or
of any iteration without `@`). Stages, in the order a save passes them:
    rank-file-tmp       this rank's model_optim_rng.pt.tmp written, not yet renamed
    rank-file           model_optim_rng.pt complete inside iter_N.tmp/
    before-dir-rename   all ranks written; iter_N.tmp/ not yet renamed to iter_N/
    old-aside           re-saving iteration N: the previous iter_N/ moved to iter_N.old/
    before-tracker      iter_N/ in place; latest_checkpointed_iteration.txt not yet replaced
    between-trackers    DMD2: <save>_critic's tracker replaced, the student's (the commit) not yet
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_mega.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from dmd2_mega.logger import print_rank0

KILL_ENV = "DMD2_MEGA_TEST_KILL_AT"
KILL_STAGES = ("rank-file-tmp", "rank-file", "before-dir-rename", "old-aside", "before-tracker",
               "between-trackers")


def kill_point(stage: str, iteration: int) -> None:
    """Test hook: SIGKILL this process at `stage` if DMD2_MEGA_TEST_KILL_AT asks for it."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    want, _, it = spec.partition("@")
    if want not in KILL_STAGES:
        raise ValueError(f"{KILL_ENV}={spec!r}: unknown stage {want!r}; one of {KILL_STAGES}")
    if want == stage and (not it or int(it) == iteration):
        os.kill(os.getpid(), signal.SIGKILL)


class ExitController:
    """--exit-signal-handler / --exit-duration-in-mins (see the module docstring)."""

    def __init__(self, signal_handler: bool, duration_mins: Optional[float], rank: int,
                 device: torch.device, start_time: Optional[float] = None):
        self.signal_handler, self.duration_mins = signal_handler, duration_mins
        self.rank, self.device = rank, device
        self.start = time.time() if start_time is None else start_time
        self.received = False
        self._previous = None
        if signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    @property
    def enabled(self) -> bool:
        return self.signal_handler or self.duration_mins is not None

    def check(self, counters: Optional[torch.Tensor] = None):
        """Collective over the world: the reason to stop now, or None. With `counters` (a 1-D int64 device
        tensor, equal on every rank) returns (reason, counters as host ints), read in the same sync; without,
        no collective at all unless an exit flag is given."""
        if not self.enabled and counters is None:
            return None
        late = (self.rank == 0 and self.duration_mins is not None
                and time.time() - self.start > 60.0 * self.duration_mins)
        flags = torch.tensor([int(self.received), int(late)], dtype=torch.int64, device=self.device)
        if counters is not None:
            flags = torch.cat([flags, counters.to(self.device, torch.int64)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()  # the one host sync of an iteration
        reason = None
        if values[0]:
            reason = "SIGTERM received (--exit-signal-handler)"
        elif values[1]:
            reason = f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return reason if counters is None else (reason, values[2:])

    def close(self) -> None:
        """Restore the SIGTERM handler that was in place before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def check_nan_limit(role: str, n: int, limit: int, where: str) -> None:
    """Raise NonFiniteError once a role has skipped `n` >= `limit` consecutive steps; `where` is e.g.
    'cycle 12'. limit 0 disables the stop."""
    if limit and n >= limit:
        raise NonFiniteError(
            f"{role}: {n} consecutive optimizer steps with a non-finite loss or gradient norm, the last at "
            f"{where} (--max-nan-iterations {limit}); stopping. Those steps were skipped, so no weights or "
            f"optimizer state were changed by them and no checkpoint was written; resume from the last "
            f"checkpoint with a lower --lr or check the data")


def skip_counters(optimizers: dict, skipped: dict) -> torch.Tensor:
    """[3 * roles] int64 on the device: per role (in `skipped`'s order) the steps skipped this iteration
    (`skipped`: role -> device count), consecutive and total (its `optim.Optimizer`)."""
    return torch.cat([torch.cat([skipped[role].view(1), optimizers[role].skip_counters]) for role in skipped])


def account_skips(roles: list, values: list, limit: int, where: str, rank: int) -> None:
    """After an iteration: warn (rank 0) about the steps each role skipped in it, then raise
    NonFiniteError if a role is at `limit` consecutive skips. values: host ints from `skip_counters`."""
    per_role = [values[3 * i:3 * i + 3] for i in range(len(roles))]
    for role, (n, consecutive, total) in zip(roles, per_role):
        if n:
            print_rank0(f"> WARNING: {where}: skipped {n} {role} optimizer step(s): non-finite loss or gradient "
                        f"norm ({consecutive} consecutive, {total} in total)", rank)
    for role, (_, consecutive, _) in zip(roles, per_role):
        check_nan_limit(role, consecutive, limit, where)


def run_main(train, teardown) -> int:
    """The launch scripts' main: `train()`, then `teardown()`. 0 on success or a preemption exit; a
    bad flag, file or value (ConfigError, DataError, CheckpointError) or a NaN stop prints ONE line
    `<ErrorType>: <message>` to stderr (prefixed by the rank in a multi-rank job) and returns 1."""
    try:
        train()
        return 0
    except (ConfigError, DataError, CheckpointError, NonFiniteError) as e:
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{rank}{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        teardown()
