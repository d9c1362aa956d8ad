"""The training loop both trainers (`teacher_trainer.FlowTrainer`, `methods.trainer.StudentTrainer`)
run, written once: step, interval log, NaN accounting, interval save / eval, exit check, final save.
What it needs of a trainer is the `Trainer` protocol below. With --save, rank 0 records the run's curves in
<save>/curves.jsonl as it goes (`train/curves.py`) and draws them in <save>/curves.png at the end
(`train/curves_plot.py`).

Host syncs: none per iteration. The NaN accounting's counters stay on the device until a check point (an
iteration that is a multiple of --log-interval or --save-interval, or the last), where ONE read carries them and,
with several ranks, the exit flags' collective (`resilience.ExitController.check`); the log interval's metrics
are read there too (`trainer.log`). With one rank the exit flags are polled on the host after every iteration
(`ExitController.poll`), and a stop they ask for reads the counters first. So a --max-nan-iterations stop, and
with several ranks an exit request, comes at the next check point: up to --log-interval - 1 iterations after
the iteration that reached the limit or received the signal (`train/resilience.py`).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

import torch

from dmd2_mega.train.checkpoint import RunState
from dmd2_mega.train.curves import curves_path
from dmd2_mega.train.logger import TrainLogger, print_rank0, report_eval
from dmd2_mega.distributed.parallel import ParallelState
from dmd2_mega.train.resilience import ExitController, account_skips, skip_counters


class Trainer(Protocol):
    cfg: object  # .train: config.TrainConfig
    ps: ParallelState
    exit: ExitController

    @property
    def iteration(self) -> int:
        """Completed iterations (cycles)."""

    @property
    def saved_iteration(self) -> Optional[int]:
        """The iteration --save holds from this process, or None."""

    def save(self) -> None:
        """Collective checkpoint of the current iteration."""

    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        """Samples + metrics (rank 0's result; None on other ranks)."""

    def log(self, logger: TrainLogger, pending: list) -> None:
        """Log the records `step()` returned since the last log (the one host sync per interval)."""


class RunStateTrainer:
    """The protocol's `iteration` and `saved_iteration`, read from the trainer's `state` (a RunState);
    both trainers derive from it."""

    state: RunState

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def saved_iteration(self) -> Optional[int]:
        return self.state.saved_iteration


def train_loop(trainer: Trainer, step: Callable[[], tuple], unit: str, name: str) -> dict:
    """Run `step()` until --train-iters; returns the last eval result ({} if none ran).

    step() advances `trainer.iteration` by one and returns (record, optimizers, skipped): the record
    joins the pending list handed to `trainer.log`; {role: optimizer} and {role: steps skipped this
    iteration, a device tensor} feed the NaN accounting (which may stop the run, before any save), kept on the
    device until the next check point (module docstring). `unit` names an iteration in messages ("iteration",
    "cycle"); `name` the run in the closing line."""
    t, ps = trainer.cfg.train, trainer.ps
    logger = TrainLogger(ps.rank, t.train_iters, t.tensorboard_dir, t.loss_trace, trainer.iteration,
                         curves=t.save and curves_path(t.save), unit=unit)
    pending, held, result, start = [], [], {}, time.time()
    try:
        while trainer.iteration < t.train_iters:
            record, optimizers, skipped = step()
            pending.append(record)
            it = trainer.iteration
            if t.max_nan_iterations:  # device ops: read at the next check point
                held.append((it, tuple(skipped), skip_counters(optimizers, skipped)))
            if it % t.log_interval == 0 or it == t.train_iters:
                trainer.log(logger, pending)
                pending = []
            reason = trainer.exit.poll()  # host values only; None with several ranks
            if reason or is_check_point(t, it):
                reason = check_iteration(trainer, held, unit)
                held = []
            evaluated, stop = after_iteration(trainer, logger, unit, t.save or t.tensorboard_dir, reason)
            result = result if evaluated is None else evaluated
            if stop:
                break
        finish_run(trainer, logger, pending)
    finally:
        trainer.exit.close()
        logger.close()
    print_rank0(f"> {name} done: {trainer.iteration} {unit}s in {time.time() - start:.1f} s", ps.rank)
    return result


def is_check_point(t, it: int) -> bool:
    """Iteration `it` ends with the exit and NaN check (`t`: config.TrainConfig): a multiple of --log-interval or
    --save-interval (checked before the save), or the last."""
    return (it % t.log_interval == 0 or it == t.train_iters
            or bool(t.save and t.save_interval and it % t.save_interval == 0))


def check_iteration(trainer: Trainer, held: list, unit: str) -> Optional[str]:
    """A check point's one host sync: the all-rank exit flags and the skip counters `held` since the last check
    point, [(iteration, roles, device counters)] (warnings; NonFiniteError naming the first iteration at the limit).
    Returns the reason to exit after this iteration, or None."""
    if not held:
        return trainer.exit.check()
    counters = torch.stack([c for _, _, c in held])  # [iterations, 3 x roles]
    reason, values = trainer.exit.check(counters.view(-1))
    width = counters.shape[1]
    for k, (it, roles, _) in enumerate(held):
        account_skips(list(roles), values[k * width:(k + 1) * width], trainer.cfg.train.max_nan_iterations,
                      f"{unit} {it}", trainer.ps.rank)
    return reason


def after_iteration(trainer: Trainer, logger: TrainLogger, unit: str, out_dir: Optional[str],
                    reason: Optional[str]) -> tuple[Optional[dict], bool]:
    """Interval save and interval eval; then stop if the exit check gave a `reason`.

    Returns (the eval result, or None if no eval ran; True if the run must stop now)."""
    t, it, rank = trainer.cfg.train, trainer.iteration, trainer.ps.rank
    if t.save and t.save_interval and it % t.save_interval == 0:
        trainer.save()
    result = None
    if t.eval_interval and (it % t.eval_interval == 0 or it == t.train_iters):
        result = trainer.evaluate(out_dir) or {}
        report_eval(logger, result, it, unit, rank)
    if reason:
        print_rank0(f"> exiting at {unit} {it}: {reason}" + ("" if t.save else " (no --save: nothing is saved)"),
                    rank)
    return result, bool(reason)


def finish_run(trainer: Trainer, logger: TrainLogger, pending: list) -> None:
    """Log what the last interval left, save the final iteration unless it is saved already, and (rank 0) draw
    <save>/curves.png."""
    t = trainer.cfg.train
    if pending:
        trainer.log(logger, pending)
    if t.save and trainer.saved_iteration != trainer.iteration:
        trainer.save()
    if t.save and trainer.ps.rank == 0:
        from dmd2_mega.train.curves_plot import plot_run  # matplotlib is imported by the runs that draw only
        print_rank0(plot_run(t.save, t.curve_references()))
