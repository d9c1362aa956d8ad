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
Read back (`read_curves`: the end-of-run figure, launch/plot_curves.py), a torn last line (no newline at its end: a
crash, or a write in progress) is left out with one warning naming the file and the line; any other line that is no
record (not a JSON object with an integer "iteration") was not written by a run, and is a DataError naming the file
and its line numbers. Reopening drops such lines with a warning naming them.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

from dmd2_mega.errors import DataError
from dmd2_mega.files.atomic import atomic_write

CURVES_FILE = "curves.jsonl"
PROXIES = ("dmd-fake-real-gap", "critic-loss", "actor-dmd-loss", "gan-disc-loss", "gan-logit-gap", "actor-gan-loss",
           "init-loss", "loss")
"""The log metrics a train line keeps, those present: the proxies of a run without an eval metric."""


def curves_path(save: str) -> str:
    return os.path.join(save, CURVES_FILE)


def read_curves(path: str) -> list[dict]:
    """The records of a curves.jsonl, in order (module docstring: a torn last line is left out with a warning, any
    other line that is no record is a DataError naming the file and its lines)."""
    with open(path, encoding="utf-8", errors="replace") as f:  # bytes that are no UTF-8: no record
        lines = f.readlines()
    records, torn, bad = _scan(lines)
    if bad:
        it, are = ("it", "is") if len(bad) == 1 else ("them", "are")
        raise DataError(f"{path}: {_lines(bad)} {are} no curves record (expected a JSON object with an integer "
                        f"\"iteration\" per line, as the trainers write it; no run wrote {it}): fix or remove {it}")
    if torn:
        print(f"> WARNING: {path} line {torn}: a torn last line (a crash in mid-write, or a write in progress), "
              f"left out", flush=True)
    return [r for r in records if r is not None]


def _record(line: str) -> Optional[dict]:
    """The record of one line: a JSON object with an integer "iteration"; None for anything else."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("iteration"), int) and not isinstance(
        record["iteration"], bool)
    return record if ok else None


def _scan(lines: list) -> tuple[list, Optional[int], list]:
    """(the record or None of each line, the number of a torn last line (no newline at its end and no record) or
    None, the numbers of the other lines that are no record; blank lines are neither)."""
    records = [_record(line) for line in lines]
    last = lines[-1] if lines else "\n"
    torn = len(lines) if last.strip() and not last.endswith("\n") and records[-1] is None else None
    bad = [i + 1 for i, (line, r) in enumerate(zip(lines, records)) if r is None and line.strip() and i + 1 != torn]
    return records, torn, bad


def _lines(numbers: list) -> str:
    """"line 3" / "lines 3, 5, 9" (the first 10, then how many in all)."""
    shown = ", ".join(map(str, numbers[:10])) + (f", ... ({len(numbers)} in all)" if len(numbers) > 10 else "")
    return f"line{'s' if len(numbers) > 1 else ''} {shown}"


def numbers(values: dict) -> dict:
    """The int and float entries of `values` (no bool, None or string)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class CurveRecord:
    """The append-only record of one run, opened at `start_iteration` (0, or the iteration a resume starts at)."""

    def __init__(self, path: str, unit: str, start_iteration: int):
        self.path, self.unit, self.file = path, unit, None
        try:
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:  # bytes that are no UTF-8: no record
                    lines = f.readlines()
                records, _, bad = _scan(lines)
                if bad:
                    print(f"> WARNING: the curves record {path}: {_lines(bad)} {'is' if len(bad) == 1 else 'are'} "
                          f"no record (not a JSON object with an integer \"iteration\"), dropped as the record is "
                          f"reopened at iteration {start_iteration}", flush=True)
                kept = [line.rstrip("\n") + "\n" for line, r in zip(lines, records)
                        if r is not None and r["iteration"] <= start_iteration]  # a whole last line: its newline
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

