#!/usr/bin/env python
"""Several runs' training curves in one figure: each run's <save>/curves.jsonl, written by the trainers.

    python launch/plot_curves.py --out runs/quickstart/curves.png \
        --run "4-step=runs/quickstart/student_4step" --run "1-step=runs/quickstart/student_1step" \
        [--reference "teacher 50 steps=1.319"] [--reference-json "runs/quickstart/metrics.json:ROW"] [--metric NAME]

--run NAME=DIR (repeatable): a run's --save directory, drawn in its own colour. --reference NAME=VALUE (repeatable):
a dashed horizontal line on the eval metric's panel. --reference-json FILE:ROW (repeatable): the same line at the
--metric of row ROW of a report's --json file (`python -m dmd2_mega.eval.report` / `report_video`, the quickstarts'
metrics.json), named ROW and the row's sample count. --metric: the eval metric of the first panel (default
frechet_distance). The panels and what they show: dmd2_mega/train/curves_plot.py. The figure can be drawn at any
time, also while the runs train or after one crashed: a torn last line of a curves.jsonl (a crash in mid-write, a
write in progress) is left out with one warning naming the file and the line.
--out must name a .png; an existing --out is replaced only when it is a PNG that lies in no run's --save folder (a
folder holding curves.jsonl: its curves.png and grids are that run's). A run without curves.jsonl, a malformed pair,
two runs of one NAME, an --out that is not such a PNG, a row or metric that is not there is one line
`ConfigError: ...` naming it, a curves.jsonl line that no run wrote (not a JSON record) one line `DataError: ...`
naming the file and its lines, each with exit status 1, before anything is written.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.config import name_value  # noqa: E402
from dmd2_mega.errors import ConfigError, DataError  # noqa: E402
from dmd2_mega.files.json_file import read_json  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.train.curves import CURVES_FILE, curves_path, read_curves  # noqa: E402
from dmd2_mega.train.curves_plot import MAIN_METRIC, check_figure_out, draw_curves, recorded  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="FILE.png", help="the figure (PNG)")
    p.add_argument("--run", action="append", required=True, metavar="NAME=DIR",
                   help="a run's --save directory, holding its curves.jsonl (repeatable)")
    p.add_argument("--reference", action="append", default=[], metavar="NAME=VALUE",
                   help="a reference line on the eval metric's panel (repeatable)")
    p.add_argument("--reference-json", action="append", default=[], metavar="FILE:ROW",
                   help="a reference line at the --metric of row ROW of a report's --json file (repeatable)")
    p.add_argument("--metric", default=MAIN_METRIC, help=f"the eval metric of the first panel (default {MAIN_METRIC})")
    return p.parse_args(argv)


def run_dirs(pairs: list) -> list[tuple[str, str]]:
    """[(NAME, DIR)] of --run NAME=DIR; a ConfigError naming a pair without "=", a NAME given before (the legend
    tells the runs apart by it) or a DIR without curves.jsonl."""
    runs = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name.strip() or not path:
            raise ConfigError(f"--run {pair!r}: expected NAME=DIR, e.g. --run \"4-step=runs/quickstart/student_4step\"")
        if name.strip() in runs:
            raise ConfigError(f"--run {pair}: the name {name.strip()!r} is given twice (also --run "
                              f"{name.strip()}={runs[name.strip()]}); each run needs its own NAME, the legend tells "
                              f"the runs apart by it")
        if not os.path.isfile(curves_path(path)):
            raise ConfigError(f"--run {pair}: {path} holds no {CURVES_FILE} (a run writes it to its --save directory "
                              f"as it trains; is {path} a --save directory?)")
        runs[name.strip()] = path
    return list(runs.items())


def read_run(name: str, path: str) -> list[dict]:
    """The records of --run NAME=DIR's curves.jsonl; its DataError (a line that is no record) names the flag too."""
    try:
        return read_curves(curves_path(path))
    except DataError as e:
        raise DataError(f"--run {name}={path}: {e}") from e


def json_reference(text: str, metric: str) -> tuple[str, float]:
    """(ROW, the row's `metric`) of --reference-json FILE:ROW; FILE is the longest prefix before a ":" that is a
    file (a row name may hold ":" too)."""
    cuts = [i for i, ch in enumerate(text) if ch == ":" and os.path.isfile(text[:i])]
    if not cuts:
        raise ConfigError(f"--reference-json {text!r}: expected FILE:ROW with FILE an existing report --json file, "
                          f"e.g. \"runs/quickstart/metrics.json:teacher, 50 Euler steps, CFG 1.25\"")
    path, row = text[:cuts[-1]], text[cuts[-1] + 1:]
    rows = read_json(path, "--reference-json")
    if row not in rows or not isinstance(rows[row], dict):
        raise ConfigError(f"--reference-json {path}: no row {row!r}; its rows: {', '.join(map(repr, rows))}")
    value = rows[row].get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"--reference-json {path}: row {row!r} has no number {metric!r} (--metric); its numbers: "
                          f"{', '.join(k for k, v in rows[row].items() if isinstance(v, (int, float)))}")
    count = rows[row].get("num_samples")  # the report's sample count: a Frechet distance depends on it
    return row + (f" ({count} samples)" if isinstance(count, int) else ""), float(value)


def main(argv=None) -> int:
    def plot():
        a = parse(argv)
        check_figure_out(a.out)
        dirs = run_dirs(a.run)
        references = [name_value(text, "--reference") for text in a.reference]
        references += [json_reference(text, a.metric) for text in a.reference_json]
        check_outputs_apart([("--out", a.out)], [(f"--run {name}", curves_path(path)) for name, path in dirs])
        runs = [(name, read_run(name, path)) for name, path in dirs]
        metrics = recorded(runs, "eval")
        if (references or a.metric != MAIN_METRIC) and a.metric not in metrics:
            raise ConfigError(f"--metric {a.metric}: no run's eval recorded it (their eval metrics: "
                              f"{', '.join(metrics) or 'none: a run records them with --eval-interval'})")
        drawn = draw_curves(runs, a.out, references, a.metric)
        if not drawn:
            raise ConfigError(f"no record in the runs' {CURVES_FILE} ({', '.join(p for _, p in dirs)}): "
                              f"nothing to draw")
        lines = "; ".join(f"{name} {value:.4g}" for name, value in references)
        print(f"> curves of {', '.join(name for name, _ in dirs)}: {a.out} ({'; '.join(drawn)})"
              + (f"; reference {lines}" if lines else ""))
    return run_main(plot)


if __name__ == "__main__":
    sys.exit(main())
