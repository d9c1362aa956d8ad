"""Training curves as one PNG: each run's curves.jsonl (`train/curves.py`), value vs iteration (cycle), per panel.

Panels, left to right, each drawn when some run recorded one of its keys (one colour per run, one line style per
key; eval points marked):
    the eval metric     `metric` (default frechet_distance: lower is better), titled with the evals' sample count
                        (a Frechet distance has a positive bias that shrinks with it); the reference lines (NAME,
                        VALUE), e.g. the teacher's Frechet distance, are dashed horizontal lines on it
    accuracy, diversity the eval's *_accuracy (but the classifier's own held-out accuracy), diversity, consistency,
                        first_frame_match (1 = real data; diversity -> 0 under mode collapse)
    score gap           dmd-fake-real-gap = mean |x0_fake - x0_real|: DMD2's critic-teacher score gap, the proxy of a
                        run without an eval metric; it shrinks as the student's distribution nears the teacher's
    losses              critic-loss, actor-dmd-loss, the GAN head's, the teacher's flow-matching loss (log scale
                        when every value is > 0)
A NaN / inf value is a gap in its line. Each panel is PANEL_INCHES at DPI (400 x 320 px); the file is written
whole or not at all (`files/atomic.py`). `plot_run` is the end-of-run plot of one run (`train/loop.finish_run`);
launch/plot_curves.py draws several runs in one figure. Neither replaces a file that is not a PNG (`is_png`, checked
before drawing); plot_curves.py's --out also keeps out of the runs' folders (`check_figure_out`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

from dmd2_mega.errors import ConfigError, DataError
from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.train.curves import CURVES_FILE, PROXIES, curves_path, read_curves

MAIN_METRIC = "frechet_distance"
PANEL_INCHES = (4.0, 3.2)
MARGINS = (0.62, 0.12, 0.48, 0.3)
"""Inches of each panel outside its axes: left, right, bottom, top."""
DPI = 100
CURVES_PNG = "curves.png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SOURCE = ("Source", "dmd2_mega curves")
"""The PNG text entry draw_curves writes: a figure it drew, which plot_curves.py may draw again."""
GAP = "dmd-fake-real-gap"
FRACTIONS = ("diversity", "consistency", "first_frame_match")
"""Eval keys drawn with the accuracies: fractions where real data scores ~1."""
TITLES = {"frechet_distance": "Frechet distance (lower is better)",
          GAP: "critic-teacher score gap, mean |x0_fake - x0_real|"}
KEY_STYLES = ("-", "--", ":", "-.")
REFERENCE_STYLES = ("--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str            # the records it reads: "eval" or "train"
    keys: tuple          # the keys it draws, in legend order
    log_scale: bool = False


def recorded(runs: Sequence[tuple[str, list]], kind: str) -> list[str]:
    """Every key of `kind` records over the runs, in order of first appearance."""
    keys = {}
    for _, records in runs:
        for r in records:
            if r.get("kind") == kind:
                keys.update(dict.fromkeys(k for k in r if k not in ("kind", "unit", "iteration")))
    return list(keys)


def _is_fraction(key: str) -> bool:
    return (key.endswith("accuracy") and key != "classifier_heldout_accuracy") or key in FRACTIONS


def panels(runs: Sequence[tuple[str, list]], metric: str = MAIN_METRIC) -> list[Panel]:
    """The panels the runs' records fill (module docstring), in drawing order."""
    evals, trains = recorded(runs, "eval"), recorded(runs, "train")
    out = []
    if metric in evals:  # FD falls with the sample count: the title says the count the evals used
        counts = {r.get("num_samples") for _, records in runs for r in records if r.get("kind") == "eval"}
        count = f", {counts.pop()} samples" if len(counts) == 1 and None not in counts else ""
        out.append(Panel(TITLES.get(metric, metric) + count, "eval", (metric,)))
    fractions = tuple(k for k in evals if _is_fraction(k) and k != metric)
    if fractions:
        out.append(Panel("accuracy, diversity (real data ~1)", "eval", fractions))
    if GAP in trains:
        out.append(Panel(TITLES[GAP], "train", (GAP,)))
    losses = tuple(k for k in PROXIES if k not in (GAP, "gan-logit-gap") and k in trains)  # the gap: the record's
    if losses:
        positive = all(v > 0 for _, records in runs for r in records if r.get("kind") == "train"
                       for k in losses if isinstance(v := r.get(k), float) and math.isfinite(v))
        out.append(Panel("losses", "train", losses, log_scale=positive))
    return out


def series(records: list, kind: str, key: str) -> tuple[list, list]:
    """(iterations, values) of `key` in the `kind` records; a non-finite value is NaN (a gap in the line)."""
    xs, ys = [], []
    for r in records:
        if r.get("kind") == kind and key in r:
            v = float(r[key])
            xs.append(r["iteration"])
            ys.append(v if math.isfinite(v) else math.nan)
    return xs, ys


def draw_curves(runs: Sequence[tuple[str, list]], out: str, references: Sequence[tuple[str, float]] = (),
                metric: str = MAIN_METRIC, title: str = "") -> list[str]:
    """Draw the runs [(name, records)] to the PNG `out`: the `panels` side by side, `references` [(NAME, VALUE)]
    on the metric's panel. Returns the titles of the panels drawn; [] and no file when nothing was recorded."""
    chosen = panels(runs, metric)
    if not chosen:
        return []
    units = sorted({r.get("unit", "iteration") for _, records in runs for r in records})
    fig = Figure(figsize=(PANEL_INCHES[0] * len(chosen), PANEL_INCHES[1]), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(chosen), squeeze=False)[0]
    _place(fig, len(chosen), bool(title))
    for ax, panel in zip(axes, chosen):
        for i, (name, records) in enumerate(runs):
            for j, key in enumerate(panel.keys):
                xs, ys = series(records, panel.kind, key)
                if not xs:
                    continue
                label = " ".join(p for p in (name, key if len(panel.keys) > 1 else "") if p) or key
                ax.plot(xs, ys, color=f"C{i % 10}", linestyle=KEY_STYLES[j % len(KEY_STYLES)], linewidth=1.2,
                        marker="o" if panel.kind == "eval" else None, markersize=3, label=label)
        if panel.keys == (metric,):
            for k, (ref_name, value) in enumerate(references):
                ax.axhline(value, color="0.25", linestyle=REFERENCE_STYLES[k % len(REFERENCE_STYLES)],
                           linewidth=1.0, label=f"{ref_name} ({value:.4g})")
        if panel.log_scale:  # plain numbers on the ticks, minor ones labelled when the range is under a decade
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.4)))
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(" / ".join(units))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.06 / PANEL_INCHES[1], va="top")
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=DPI, metadata=dict([SOURCE])))
    return [p.title for p in chosen]


def _place(fig: Figure, n: int, title: bool) -> None:
    """Fixed margins in inches (a layout engine would cost as much as the drawing): each panel keeps MARGINS' left
    inches for its tick labels and right inches of air, below for the x label, above for its title (and the
    figure's)."""
    (left, right, bottom, top), (w, h) = MARGINS, PANEL_INCHES
    top += 0.25 if title else 0.0
    fig.subplots_adjust(left=left / (n * w), right=1 - right / (n * w), bottom=bottom / h, top=1 - top / h,
                        wspace=(left + right) / (w - left - right))


def is_png(path: str) -> bool:
    """Whether the file `path` starts with PNG's signature (False for one that cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(PNG_MAGIC)) == PNG_MAGIC
    except OSError:
        return False


def check_png_out(out: str, flag: str) -> None:
    """ConfigError unless `out` is a PNG file name this figure may take: named *.png, not a folder nor an existing
    file of another kind (its first bytes are not PNG's), not under a file (its nearest existing folder a folder)."""
    if not out.lower().endswith(".png"):
        raise ConfigError(f"{flag} {out}: expected a file name ending in .png (the figure is a PNG)")
    if os.path.isdir(out):
        raise ConfigError(f"{flag} {out} is a folder; expected the .png file to write")
    if os.path.lexists(out) and not is_png(out):
        raise ConfigError(f"{flag} {out} is an existing file that is not a PNG; it is not replaced: choose "
                          f"another {flag} (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {out}: {parent} is a file, not a folder")


def check_figure_out(out: str, flag: str = "--out") -> None:
    """`check_png_out`; `out` must not be a run's end-of-run figure (curves.png beside a curves.jsonl), nor an
    existing file in a run's --save folder (one holding curves.jsonl, at any depth above it) that `draw_curves` did
    not draw (no SOURCE mark): that folder's files are its run's (its eval grids, its samples)."""
    check_png_out(out, flag)
    folder = os.path.dirname(os.path.realpath(out))
    if os.path.basename(out) == CURVES_PNG and os.path.isfile(curves_path(folder)):
        raise ConfigError(f"{flag} {out} is the end-of-run figure of the run in {folder} (its trainer draws it from "
                          f"the {CURVES_FILE} beside it); choose another {flag} (nothing was written)")
    if not os.path.exists(out) or _marked(out):
        return
    while True:
        if os.path.isfile(curves_path(folder)):
            raise ConfigError(f"{flag} {out} is a file of the run in {folder} (a --save folder: it holds "
                              f"{CURVES_FILE}) that no plot of curves drew; it is not replaced: choose a new file or "
                              f"one outside the run (nothing was written)")
        up = os.path.dirname(folder)
        if up == folder:
            return
        folder = up


def _marked(path: str) -> bool:
    """Whether the PNG `path` carries draw_curves' SOURCE mark."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            return getattr(im, "text", {}).get(SOURCE[0]) == SOURCE[1]
    except Exception:  # a PNG Pillow cannot read (truncated, corrupt) is no figure of ours
        return False


def plot_run(save: str, references: Sequence[tuple[str, float]] = ()) -> str:
    """<save>/curves.png of the run's <save>/curves.jsonl (rank 0, at the end of a run); returns the line to log.
    A figure that cannot be drawn (the record changed by hand, a curves.png that is no PNG, a full disk) is a
    warning: the checkpoint is saved, the run does not fail."""
    path, out = curves_path(save), os.path.join(save, CURVES_PNG)
    if os.path.lexists(out) and not is_png(out):
        return f"> WARNING: curves not drawn: {out} is an existing file that is not a PNG; it is not replaced"
    try:
        records = read_curves(path) if os.path.exists(path) else []
    except DataError as e:
        return f"> WARNING: curves not drawn: {e}"
    except OSError as e:
        return f"> WARNING: curves not drawn: cannot read {path} ({e.strerror or e})"
    try:
        drawn = draw_curves([("", records)], out, references, title=save)
    except OSError as e:
        return f"> WARNING: curves not drawn: cannot write {out} ({e.strerror or e})"
    if not drawn:
        return f"> curves: {path} holds no record; no {out}"
    missed = " (--curves-reference not drawn: no eval recorded a Frechet distance)" if (
        references and MAIN_METRIC not in recorded([("", records)], "eval")) else ""
    return f"> curves: {out} ({'; '.join(drawn)}){missed}"
