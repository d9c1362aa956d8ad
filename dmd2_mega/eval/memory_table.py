"""One table of what several distillation runs held in memory (the quickstarts' full vs LoRA students).

    python -m dmd2_mega.eval.memory_table "DMD2 student=runs/q/student_4step" "LoRA student=runs/q/student_4step_lora"
reads each run's <save>/memory.json (`train/memory_record.py`, written at the end of pretrain_dmd2.py) and prints a
Markdown row per NAME=DIR: trainable parameters, the peak resident bytes of every role (weights, grads, optimizer
state, EMA; shared storages once) and its phase, the ratio to the first row, and the process's peak RSS. A missing
or malformed file is one line `error: ...` naming it, exit status 2 (`report.report_main`).
"""
from __future__ import annotations

import os
import sys

from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.report import report_main
from dmd2_mega.files.json_file import read_json
from dmd2_mega.train.memory_record import MEMORY_FILE

KEYS = ("peak_resident_bytes", "peak_phase", "process_peak_rss_bytes", "trainable_parameters")


def load(run_dir: str) -> tuple:
    path = os.path.join(run_dir, MEMORY_FILE)
    if not os.path.isfile(path):
        raise EvalInputError(f"{path}: no such file (pretrain_dmd2.py writes it into --save at the end of a run)")
    summary = read_json(path, error=EvalInputError)
    missing = [k for k in KEYS if k not in summary]
    if missing:
        raise EvalInputError(f"{path}: lacks {', '.join(missing)}")
    return (summary,)


def markdown(results: list[tuple[str, dict]]) -> str:
    mib = 2 ** 20
    first = results[0][1]["peak_resident_bytes"] if results else 1
    lines = ["| run | trainable parameters | peak resident MiB (all roles) | phase | vs first row "
             "| process peak RSS MiB |", "|---|---|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['trainable_parameters']:,} | {r['peak_resident_bytes'] / mib:.2f} | "
                     f"{r['peak_phase']} | {r['peak_resident_bytes'] / first:.2f}x | "
                     f"{r['process_peak_rss_bytes'] / mib:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return report_main(argv, "python -m dmd2_mega.eval.memory_table", __doc__,
                       "NAME=DIR: a pretrain_dmd2.py --save directory", load, lambda s: s, markdown)


if __name__ == "__main__":
    sys.exit(main())
