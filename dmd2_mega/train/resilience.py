"""Failure handling shared by the training loops: preemption exits, non-finite step limits, and the
test-only kill points of the checkpoint writer.

Exit conditions (Megatron's `--exit-signal-handler`, `--exit-duration-in-mins`). `ExitController`
installs SIGTERM and SIGINT handlers that only set a flag; at the end of every iteration (cycle) the
loop calls `check()`, which all-reduces (MAX over the world) the int64 tensor
    [signal number seen on this rank (0: none), rank 0's wall clock since start > limit (rank 0's entry only)]
so every rank takes the same decision at the same iteration, after a complete iteration: the loop
then saves and returns, and the script exits 0.

The launch scripts' main is `run_main`: a user mistake (ConfigError, DataError, CheckpointError) or a
NaN stop is ONE line `<ErrorType>: <message>` on stderr and exit status 1; a Ctrl-C without
--exit-signal-handler (KeyboardInterrupt) is one line naming the last complete checkpoint in --save
and exit status 130.

Non-finite steps. `dmd2_mega.train.optim.Optimizer` skips a step whose loss or gradient norm is not
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
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from dmd2_mega.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from dmd2_mega.train.logger import print_rank0
from dmd2_mega.distributed.parallel import destroy_distributed

KILL_ENV = "DMD2_MEGA_TEST_KILL_AT"
KILL_STAGES = ("rank-file-tmp", "rank-file", "before-dir-rename", "old-aside", "before-tracker",
               "between-trackers")
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TRACKER = "latest_checkpointed_iteration.txt"  # = checkpoint.TRACKER (checkpoint imports this module)


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
        self.signum = 0  # the signal received (SIGTERM wins over SIGINT), 0: none
        self._previous = {}
        if signal_handler:
            self._previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        self.signum = max(self.signum, int(signum))

    @property
    def received(self) -> bool:
        return self.signum != 0

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
        flags = torch.tensor([self.signum, int(late)], dtype=torch.int64, device=self.device)
        if counters is not None:
            flags = torch.cat([flags, counters.to(self.device, torch.int64)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()  # the one host sync of an iteration
        reason = None
        if values[0]:
            reason = f"{signal.Signals(values[0]).name} received (--exit-signal-handler)"
        elif values[1]:
            reason = f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return reason if counters is None else (reason, values[2:])

    def close(self) -> None:
        """Restore the SIGTERM and SIGINT handlers that were in place before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}


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


def interrupted_message(save: Optional[str]) -> str:
    """The line printed on Ctrl-C (KeyboardInterrupt): where the last complete checkpoint of `save` is.
    Reads the tracker file directly: a save cut short by the interrupt never replaced it."""
    if not save:
        return "Interrupted (SIGINT): no checkpoint was saved (no --save)"
    try:
        text = open(os.path.join(save, TRACKER)).read().strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return f"Interrupted (SIGINT): --save {save} holds no checkpoint yet"
    return (f"Interrupted (SIGINT): the last complete checkpoint is {os.path.join(save, f'iter_{int(text):07d}')} "
            f"(resume with --load {save})")


def run_main(train: Callable[[], object], teardown: Optional[Callable[[], None]] = None,
             save_dir: Union[None, str, Callable[[], Optional[str]]] = None) -> int:
    """The launch scripts' main: `train()`, then `teardown()`. Returns the exit status:
    0 on success or a preemption exit; 1 for a bad flag, file or value (ConfigError, DataError,
    CheckpointError) or a NaN stop, printed as ONE line `<ErrorType>: <message>` on stderr; 130 on
    Ctrl-C (KeyboardInterrupt), printed as one line `Interrupted (SIGINT): ...`. Lines are prefixed by
    the rank in a multi-rank job. `save_dir` (the --save directory, or a zero-argument callable giving
    it, None when the run has no --save) is what a training script passes so the Ctrl-C line names the
    last complete checkpoint; scripts that save nothing leave it None."""
    try:
        train()
        return 0
    except (ConfigError, DataError, CheckpointError, NonFiniteError) as e:
        _print_one_line(f"{type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        if save_dir is None:
            _print_one_line("Interrupted (SIGINT)")
        else:
            _print_one_line(interrupted_message(save_dir() if callable(save_dir) else save_dir))
        return 130
    finally:
        if teardown is not None:
            teardown()


def run_training(parse: Callable[[], object], trainer: Callable[[object], object]) -> int:
    """The training scripts' main: `trainer(parse()).train()` under `run_main`, with the process group torn down
    after, and Ctrl-C naming the last complete checkpoint of the parsed --save (None until the flags parse)."""
    cfg = None

    def train() -> None:
        nonlocal cfg
        cfg = parse()
        trainer(cfg).train()

    return run_main(train, destroy_distributed, save_dir=lambda: cfg.train.save if cfg else None)


def _print_one_line(message: str) -> None:
    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{rank}{' '.join(message.splitlines())}", file=sys.stderr, flush=True)
