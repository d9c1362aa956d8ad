"""One table of sample quality for several sample sets (the quickstart's summary).

    python -m dmd2_mega.eval.report "teacher, 50 steps=runs/q/teacher_50/samples.npz" "student, 4 steps=..."
prints a Markdown table: Frechet distance (and its ratio to the real-vs-real floor), class accuracy
and diversity (per-class pixel std relative to real held-out digits), one row per NAME=PATH.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from dmd2_mega.eval.digits import evaluate_digits


def rows(pairs: list[str]) -> list[tuple[str, dict]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"error: expected NAME=PATH, got {pair!r}")
        name, path = pair.split("=", 1)
        with np.load(path) as npz:
            out.append((name, evaluate_digits(npz["images"], npz["labels"])))
    return out


def markdown(results: list[tuple[str, dict]]) -> str:
    floor = results[0][1]["frechet_floor"] if results else float("nan")
    lines = [f"| model | Frechet distance (floor {floor:.3f}) | FD / floor | class accuracy | diversity |",
             "|---|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['frechet_distance']:.3f} | {r['fd_ratio']:.2f} | "
                     f"{100 * r['class_accuracy']:.1f}% | {r['diversity']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmd2_mega.eval.report", description=__doc__.split("\n")[0])
    p.add_argument("pairs", nargs="+", help="NAME=PATH to a samples.npz")
    p.add_argument("--json", default=None, help="also write all metrics to this JSON file")
    a = p.parse_args(argv)
    results = rows(a.pairs)
    print(markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({name: r for name, r in results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
