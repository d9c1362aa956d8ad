"""Failure handling shared by the training loops: preemption exits, non-finite step limits, and the
test-only kill points of the checkpoint writer.

Exit conditions (Megatron's `--exit-signal-handler`, `--exit-duration-in-mins`). `ExitController`
installs SIGTERM and SIGINT handlers that only set a flag (a host value); the deadline is rank 0's wall clock.
Both are host values, so the loop never reads the device for them:
  one rank      `poll()` after every iteration (cycle) decides from the host values alone: no collective, no
                device sync; the run stops after the iteration in which the signal came (or the deadline passed).
  several ranks every rank must stop after the same iteration, so the ranks agree through one collective,
                `check()`: an all-reduce (MAX over the world) of the int64 tensor
                    [signal number seen on this rank (0: none), rank 0's wall clock since start > limit]
                with the skip counters below appended, read in ONE host sync. The loop runs it at its check
                points only: iterations that are multiples of --log-interval or --save-interval, and the last
                (`loop.train_loop`). An exit request therefore takes effect at the next check point, up to
                --log-interval - 1 iterations after the one it came in (pick --log-interval so that many
                iterations fit the scheduler's grace period). Why not every iteration: a collective read on
                the host is a device sync per cycle (the cycle could not run ahead of the host, nor be one
                CUDA graph after another); and a check that does not block (an async all-reduce polled with
                an event) completes at different iterations on different ranks, which would then need a
                second agreement round to stop together. The log interval syncs anyway.
Either way the loop then saves and returns after a complete iteration, and the script exits 0.

The launch scripts' main is `run_main`: a user mistake (ConfigError, DataError, CheckpointError) or a
NaN stop is ONE line `<ErrorType>: <message>` on stderr and exit status 1; a Ctrl-C without
--exit-signal-handler (KeyboardInterrupt) is one line naming the last complete checkpoint in --save
and exit status 130.

Non-finite steps. `dmd2_mega.train.optim.Optimizer` skips a step whose loss or gradient norm is not
finite (weights and Adam state untouched) and counts the skips in device tensors. After every iteration the loop
keeps each trained role's [skipped this iteration, consecutive, total] on the device (`skip_counters`, no sync);
at its check points `check(counters)` carries the kept rows, after the two flags, to the host in the same sync,
and `account_skips` warns about each iteration's skips and stops the run with `NonFiniteError` (naming the
role and the iteration / cycle where the limit was reached) once a role had `--max-nan-iterations` consecutive
skips. The stop therefore comes at the next check point, up to --log-interval - 1 iterations (cycles) after
the one that reached the limit: those iterations run as usual (a non-finite step is still skipped), and no
checkpoint is written after the iteration that reached the limit (a save point is a check point, checked before
the save). Cost: ONE host sync per check point (per log interval), none per iteration.

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
    """--exit-signal-handler / --exit-duration-in-mins (see the module docstring): `poll()` after every iteration
    (host values only; decides alone in a world of one), `check()` at the loop's check points (the collective of
    several ranks, with the skip counters). An exit request takes effect after the iteration it came in with one
    rank, at the next check point (up to --log-interval - 1 iterations later) with several."""

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

    def poll(self) -> Optional[str]:
        """After every iteration, from host values only (no collective, no device sync): the reason to stop now in
        a world of one; None with several ranks, which agree at the loop's next check point (`check`)."""
        return self.check() if self.enabled and _world_size() == 1 else None

    def check(self, counters: Optional[torch.Tensor] = None):
        """The reason to stop now, or None; with several ranks a collective over the world (all ranks must call it
        at the same iteration). With `counters` (a 1-D int64 device tensor, equal on every rank) returns (reason,
        counters as host ints), read in the same sync. Without counters: no device work in a world of one (host
        values), no collective at all when no exit flag is given."""
        if not self.enabled and counters is None:
            return None
        late = (self.rank == 0 and self.duration_mins is not None
                and time.time() - self.start > 60.0 * self.duration_mins)
        values = [self.signum, int(late)]
        if _world_size() > 1:
            flags = torch.tensor(values, dtype=torch.int64, device=self.device)
            if counters is not None:
                flags = torch.cat([flags, counters.to(self.device, torch.int64)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            values = flags.tolist()  # the one host sync of a check point
        elif counters is not None:
            values += counters.tolist()  # the one host sync of a check point
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


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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
    (`skipped`: role -> device count), consecutive and total (its `optim.Optimizer`). Device ops only: the loop keeps
    one per iteration until its next check point."""
    return torch.cat([torch.cat([skipped[role].view(1), optimizers[role].skip_counters]) for role in skipped])


def account_skips(roles: list, values: list, limit: int, where: str, rank: int) -> None:
    """For one iteration: warn (rank 0) about the steps each role skipped in it, then raise NonFiniteError if a
    role is at `limit` consecutive skips. values: host ints of that iteration's `skip_counters`."""
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
