"""The training loop both trainers (teacher `training.FlowTrainer`, `dmd2.trainer.DMD2Trainer`) run,
written once: step, interval log, NaN accounting, interval save / eval, exit check, final save.

A trainer provides: `cfg.train`, `ps`, `iteration`, `saved_iteration`, `exit` (resilience's
ExitController), `save()`, `evaluate(out_dir) -> dict | None` and `_log(logger, pending)`.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from dmd2_mega.logger import TrainLogger, print_rank0, report_eval
from dmd2_mega.resilience import account_skips


def train_loop(trainer, step: Callable[[], tuple], unit: str, name: str) -> dict:
    """Run `step()` until --train-iters; returns the last eval result ({} if none ran).

    step() advances `trainer.iteration` by one and returns (record, optimizers, skipped): the record
    joins the pending list handed to `trainer._log`; {role: optimizer} and {role: steps skipped this
    iteration} feed the NaN accounting (which may stop the run, before any save). `unit` names an
    iteration in messages ("iteration", "cycle"); `name` the run in the closing line."""
    t, ps = trainer.cfg.train, trainer.ps
    logger = TrainLogger(ps.rank, t.train_iters, t.tensorboard_dir, t.loss_trace, trainer.iteration)
    pending, result, start = [], {}, time.time()
    try:
        while trainer.iteration < t.train_iters:
            record, optimizers, skipped = step()
            pending.append(record)
            if trainer.iteration % t.log_interval == 0 or trainer.iteration == t.train_iters:
                trainer._log(logger, pending)
                pending = []
            account_skips(optimizers, skipped, t.max_nan_iterations, f"{unit} {trainer.iteration}", ps.rank)
            evaluated, stop = after_iteration(trainer, logger, unit, t.save or t.tensorboard_dir)
            result = result if evaluated is None else evaluated
            if stop:
                break
        finish_run(trainer, logger, pending)
    finally:
        trainer.exit.close()
        logger.close()
    print_rank0(f"> {name} done: {trainer.iteration} {unit}s in {time.time() - start:.1f} s", ps.rank)
    return result


def after_iteration(trainer, logger: TrainLogger, unit: str, out_dir: Optional[str]) -> tuple[Optional[dict], bool]:
    """Interval save, interval eval, then the all-rank exit check.

    Returns (the eval result, or None if no eval ran; True if the run must stop now)."""
    t, it, rank = trainer.cfg.train, trainer.iteration, trainer.ps.rank
    if t.save and t.save_interval and it % t.save_interval == 0:
        trainer.save()
    result = None
    if t.eval_interval and (it % t.eval_interval == 0 or it == t.train_iters):
        result = trainer.evaluate(out_dir) or {}
        report_eval(logger, result, it, unit, rank)
    reason = trainer.exit.check()
    if reason:
        print_rank0(f"> exiting at {unit} {it}: {reason}" + ("" if t.save else " (no --save: nothing is saved)"),
                    rank)
    return result, bool(reason)


def finish_run(trainer, logger: TrainLogger, pending: list) -> None:
    """Log what the last interval left and save the final iteration unless it is saved already."""
    if pending:
        trainer._log(logger, pending)
    if trainer.cfg.train.save and trainer.saved_iteration != trainer.iteration:
        trainer.save()
