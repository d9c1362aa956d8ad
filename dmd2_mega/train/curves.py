"""A run's training curves as JSON lines in `<save>/curves.jsonl` (rank 0), drawn by `train/curves_plot.py`.

One line per eval and one per log interval, in the order they happen:
    {"kind": "train", "unit": "cycle", "iteration": 25, "dmd-fake-real-gap": 0.031, "critic-loss": 0.12, ...}
    {"kind": "eval", "unit": "cycle", "iteration": 40, "frechet_distance": 2.1, "class_accuracy": 0.97, ...}
train: the `PROXIES` among the interval's averaged log metrics (DMD2: dmd-fake-real-gap = mean |x0_fake - x0_real|,
the critic-teacher score gap, and the critic / actor losses; the teacher trainer: its flow-matching loss); eval: the
numbers of the eval result (`trainer.evaluate`; strings and None left out). A non-finite value is written as NaN /
Infinity, which Python's json reads back. Each line is flushed as it is written, so a crash loses none.
Opened at the run's first iteration i (a resume's): lines past i are dropped first (the file rewritten atomically),
so a resumed run's curve has no line twice; a torn last line (a crash mid-write) is dropped too. A record that cannot
be written (a full disk) is one warning and the end of the record, never the end of the run: the checkpoint save
is what reports a full disk (`train/checkpoint.py`).
"""
from __future__ import annotations

import contextlib
import json
import os

from dmd2_mega.files.atomic import atomic_write

CURVES_FILE = "curves.jsonl"
PROXIES = ("dmd-fake-real-gap", "critic-loss", "actor-dmd-loss", "gan-disc-loss", "gan-logit-gap", "actor-gan-loss",
           "init-loss", "loss")
"""The log metrics a train line keeps, those present: the proxies of a run without an eval metric."""


def curves_path(save: str) -> str:
    return os.path.join(save, CURVES_FILE)


def read_curves(path: str) -> list[dict]:
    """The records of a curves.jsonl, in order; a line that is no JSON object (a torn last line) is left out."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("iteration"), int):
                records.append(record)
    return records


def numbers(values: dict) -> dict:
    """The int and float entries of `values` (no bool, None or string)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class CurveRecord:
    """The append-only record of one run, opened at `start_iteration` (0, or the iteration a resume starts at)."""

    def __init__(self, path: str, unit: str, start_iteration: int):
        self.path, self.unit, self.file = path, unit, None
        try:
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    lines = f.readlines()
                kept = [line for line in lines if line.endswith("\n") and _before(line, start_iteration)]
                if kept != lines:
                    atomic_write(path, lambda f: f.writelines(kept), text=True)
            self.file = open(path, "a", encoding="utf-8")
        except OSError as e:
            self._stop(e)

    def append(self, kind: str, iteration: int, values: dict) -> None:
        """One line {kind, unit, iteration, **values}; nothing for empty `values`."""
        if not values or self.file is None:
            return
        record = {"kind": kind, "unit": self.unit, "iteration": int(iteration), **values}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            self._stop(e)

    def _stop(self, e: OSError) -> None:
        print(f"> WARNING: cannot write the curves record {self.path} ({e.strerror or e}); it stops here, the run "
              f"goes on", flush=True)
        self.close()

    def train(self, iteration: int, metrics: dict) -> None:
        self.append("train", iteration, {k: float(metrics[k]) for k in PROXIES if k in metrics})

    def eval(self, iteration: int, result: dict) -> None:
        self.append("eval", iteration, numbers(result))

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # a flush that fails here was warned of by `append`
                self.file.close()
            self.file = None


def _before(line: str, iteration: int) -> bool:
    """A whole JSON record of an iteration <= `iteration`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    it = record.get("iteration") if isinstance(record, dict) else None
    return isinstance(it, int) and it <= iteration
