"""One table of sample quality for several sample sets (the quickstart's summary), and the main of both reports.

    python -m dmd2_mega.eval.report "teacher, 50 steps=runs/q/teacher_50/samples.npz" "student, 4 steps=..."
prints a Markdown table: Frechet distance (and its ratio to the real-vs-real floor), class accuracy
and diversity (per-class pixel std relative to real held-out digits), one row per NAME=PATH. Rows named
"LABEL @ seed S" (the quickstart's SEEDS: one model trained at several seeds) are also summarised per LABEL seen at
two seeds or more, in a second table: the mean, the sample standard deviation and each seed's Frechet distance.

`report_main` is the command line of this report and of `report_video` (moving digits): each NAME=PATH is loaded,
evaluated and one row of the table; --json FILE writes every metric; a report with a showcase also takes --gif FILE.
A malformed pair or samples file is one line `error: ...` naming it, and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional

import numpy as np

from dmd2_mega.data.digits import NUM_CLASSES
from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.digits import evaluate_digits, load_samples
from dmd2_mega.eval.grid import save_video_gif
from dmd2_mega.files.atomic import atomic_write


def parse_pairs(pairs: list[str]) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise EvalInputError(f"expected NAME=PATH, got {pair!r}")
        out.append(tuple(pair.split("=", 1)))
    return out


SEED_MARK = " @ seed "  # a row's name "LABEL @ seed S": one of LABEL's seeds


def markdown(results: list[tuple[str, dict]]) -> str:
    floor = results[0][1]["frechet_floor"] if results else float("nan")
    lines = [f"| model | Frechet distance (floor {floor:.3f}) | FD / floor | class accuracy | diversity |",
             "|---|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['frechet_distance']:.3f} | {r['fd_ratio']:.2f} | "
                     f"{100 * r['class_accuracy']:.1f}% | {r['diversity']:.2f} |")
    means = seed_means(results)
    return "\n".join(lines) + ("\n\n" + means if means else "")


def seed_means(results: list[tuple[str, dict]]) -> str:
    """The second table (module docstring), or "" when no label has two seeds."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for name, r in results:
        if SEED_MARK in name:
            label, seed = name.rsplit(SEED_MARK, 1)
            groups.setdefault(label, []).append((seed, r))
    lines = ["| model | seeds | Frechet distance, mean +- sd (per seed) | class accuracy, mean | diversity, mean |",
             "|---|---|---|---|---|"]
    for label, rows in groups.items():
        if len(rows) < 2:
            continue
        fd = np.array([r["frechet_distance"] for _, r in rows])
        per_seed = ", ".join(f"{seed}: {v:.3f}" for (seed, _), v in zip(rows, fd))
        lines.append(f"| {label} | {len(rows)} | {fd.mean():.3f} +- {fd.std(ddof=1):.3f} ({per_seed}) | "
                     f"{100 * np.mean([r['class_accuracy'] for _, r in rows]):.1f}% | "
                     f"{np.mean([r['diversity'] for _, r in rows]):.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def report_main(argv: Optional[list[str]], prog: str, doc: str, pair_help: str, load: Callable[[str], tuple],
                evaluate: Callable[..., dict], table: Callable[[list[tuple[str, dict]]], str],
                showcase: Optional[Callable[..., np.ndarray]] = None) -> int:
    """Per NAME=PATH: `load(path)` -> arrays, `evaluate(*arrays)` -> metrics, and with `showcase` (arrays -> one
    GIF row [NUM_CLASSES, 1, T, H, W], a clip per digit) a row of the --gif grid; prints `table(results)`."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("pairs", nargs="+", help=pair_help)
    p.add_argument("--json", default=None, help="also write all metrics to this JSON file")
    if showcase is not None:
        p.add_argument("--gif", default=None, help="also write a GIF grid: one row per NAME, one column per digit")
    a = p.parse_args(argv)
    try:
        results, rows = [], []
        for name, path in parse_pairs(a.pairs):
            arrays = load(path)
            try:
                results.append((name, evaluate(*arrays)))
            except EvalInputError as e:
                raise EvalInputError(f"{path}: {e}") from None
            if showcase is not None:
                rows.append(showcase(*arrays))
    except EvalInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results))
    if a.json:
        atomic_write(a.json, lambda f: json.dump(dict(results), f, indent=1), text=True)
    if showcase is not None and a.gif:
        save_video_gif(np.concatenate(rows), a.gif, cols=NUM_CLASSES)
        print(f"GIF grid (rows: {', '.join(n for n, _ in results)}; columns: digits 0-9): {a.gif}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return report_main(argv, "python -m dmd2_mega.eval.report", __doc__, "NAME=PATH to a samples.npz",
                       load_samples, evaluate_digits, markdown)


if __name__ == "__main__":
    sys.exit(main())
