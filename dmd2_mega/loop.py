"""The steps both training loops (teacher `training.FlowTrainer`, `dmd2.trainer.DMD2Trainer`) take
after an iteration and at the end of a run, written once.

A trainer provides: `cfg.train`, `ps`, `iteration`, `saved_iteration`, `exit` (resilience's
ExitController), `save()`, `evaluate(out_dir) -> dict | None` and `_log(logger, pending)`.
"""
from __future__ import annotations

from typing import Optional

from dmd2_mega.logger import TrainLogger, print_rank0, report_eval


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
