"""One table of moving-digits sample quality for several sample sets (launch/quickstart_video.sh's summary).

    python -m dmd2_mega.eval.report_video "teacher, 50 steps=runs/qv/samples/teacher_50step/samples.npz" \
        "student, 1 step=..." [--json metrics.json] [--gif grid.gif]
reads each samples.npz (`images` [N, 1, T, H, W], `digits`, `directions`: launch/sample.py on a --data
moving-digits[:T] model) and prints a Markdown table, one row per NAME=PATH: the per-frame Frechet distance (and
its ratio to the real-clips floor), digit accuracy, direction accuracy, mean speed, consistency (the digit
kept from frame to frame) and warp error (`eval.moving_digits` defines each). Every sample set must have the
T frames of the first (the floor and the held-out reference are per T; a one-line error names the file that
differs). --gif writes one looping GIF of T frames whose row r shows sample set r, column j a sample of digit j
moving in direction j mod 4 (right, left, down, up; the first sample of digit j if that pair was not sampled;
black if neither).
A sample set whose folder holds launch/sample.py's timing.json beside its samples.npz also gets its time to the
first output (a streamed clip's first chunk; a bidirectional model's first batch of whole clips) and its total
sampling time, in seconds on the machine that sampled it (columns only when some row has them; '-' elsewhere).
Image-to-video sample sets (samples.npz with `first_frames`: --data moving-digits-i2v[:T]) also get the first-frame
error (mean |generated frame 0 - given frame 0| in [-1, 1] pixels) and the first-frame digit match (the classifier
reads the given frame's digit in frame 0), columns likewise only when some row has them.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from dmd2_mega.data.digits import NUM_CLASSES
from dmd2_mega.data.moving_digits import DIRECTIONS
from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.moving_digits import evaluate_moving_digits, load_first_frames, load_samples as load_clips
from dmd2_mega.eval.report import report_main


TIMING = (("first_output_s", "first chunk s"), ("total_s", "sampling s"))
"""timing.json keys (launch/sample.py's `SampleTimer`) -> table columns."""
FIRST_FRAME = (("first_frame_error", "first-frame error", "{:.3f}", 1),
               ("first_frame_match", "first-frame digit", "{:.1f}%", 100))
"""Image-to-video metrics (`eval.moving_digits`) -> (table column, format, scale)."""


def load_samples(path: str) -> tuple:
    """(images, digits, directions, timing, first_frames): the samples.npz and the timing.json beside it ({} when
    absent); first_frames [N, 1, H, W] of image-to-video samples, else None."""
    timing_path = os.path.join(os.path.dirname(path), "timing.json")
    timing = {}
    if os.path.isfile(timing_path):
        try:
            with open(timing_path) as f:
                timing = json.load(f)
            timing = {k: float(timing[k]) for k, _ in TIMING}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EvalInputError(f"{timing_path}: not launch/sample.py's timing.json ({type(e).__name__}: {e}); "
                                 f"remove it or sample again") from None
    return (*load_clips(path), timing, load_first_frames(path))


def showcase(images: np.ndarray, digits: np.ndarray, directions: np.ndarray, timing: dict = None,
             first_frames: np.ndarray = None) -> np.ndarray:
    """[10, 1, T, H, W]: for digit j the first clip of (j, direction j mod 4), else the first of digit j, else
    black (-1)."""
    j = np.arange(NUM_CLASSES)[:, None]
    exact = (digits[None] == j) & (directions[None] == j % len(DIRECTIONS))   # [10, N]
    loose = digits[None] == j
    pick = np.where(exact.any(1), exact.argmax(1), loose.argmax(1))
    return np.where(loose.any(1)[:, None, None, None, None], images[pick], -1.0)


def markdown(results: list[tuple[str, dict]]) -> str:
    floor = results[0][1]["frechet_floor"] if results else float("nan")
    frames = results[0][1]["num_frames"] if results else "?"
    given = [col for col in FIRST_FRAME if any(col[0] in r for _, r in results)]
    timed = [(k, col) for k, col in TIMING if any(k in r for _, r in results)]
    lines = [f"| model ({frames} frames) | FD per frame (floor {floor:.3f}) | FD / floor | digit acc | direction acc "
             f"| speed px/frame | consistency | warp error |" + "".join(f" {col} |" for _, col, _, _ in given)
             + "".join(f" {col} |" for _, col in timed),
             "|---|---|---|---|---|---|---|---|" + "---|" * (len(given) + len(timed))]
    for name, r in results:
        lines.append(f"| {name} | {r['frechet_distance']:.3f} | {r['fd_ratio']:.2f} | {100 * r['digit_accuracy']:.1f}% "
                     f"| {100 * r['direction_accuracy']:.1f}% | {r['mean_speed']:.2f} | "
                     f"{100 * r['consistency']:.1f}% | {r['warp_error']:.3f} |"
                     + "".join(f" {fmt.format(scale * r[k])} |" if k in r else " - |" for k, _, fmt, scale in given)
                     + "".join(f" {r[k]:.2f} |" if k in r else " - |" for k, _ in timed))
    return "\n".join(lines)


def main(argv=None) -> int:
    frames = None  # the first sample set's T: every other must have it

    def evaluate(images, digits, directions, timing: dict, first_frames=None) -> dict:
        nonlocal frames
        if frames is not None and np.ndim(images) == 5 and np.shape(images)[2] != frames:
            raise EvalInputError(f"clips of {np.shape(images)[2]} frames, but the first sample set's have {frames}: "
                                 f"one report compares sample sets of one length")
        result = evaluate_moving_digits(images, digits, directions, first_frames=first_frames)
        frames = result["num_frames"]
        return {**result, **timing}

    return report_main(argv, "python -m dmd2_mega.eval.report_video", __doc__,
                       "NAME=PATH to a samples.npz of a --data moving-digits[:T] model", load_samples,
                       evaluate, markdown, showcase)


if __name__ == "__main__":
    sys.exit(main())
