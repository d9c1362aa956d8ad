"""Sample quality on moving digits: per-frame Frechet distance, digit, motion direction, consistency.

Clips x [N, 1, T, H, W] in [-1, 1], any T >= 2 (`data/moving_digits.py` geometry: a digit moving on a torus,
leaving one edge and re-entering at the opposite one) conditioned on (digit k_n, direction d_n). Every metric
reads a frame as a picture on the torus, so a digit split by an edge scores as a whole one:
    u(x_t)            = x_t rolled by H / 2 rows where that lowers the spread of its row mass profile (a digit
                        split by the top / bottom edge, 8 px on a 16 px torus, is whole after the roll), and
                        likewise by W / 2 columns (`unwrap_frames`); a digit inside the canvas is left as it is
    phi, p_t          = the features [., 64] and argmax logits of the cached `FrameClassifier`
                        (frame_classifier.py; why not the 8x8 classifier on a crop: see there) of u(x_t)
    frechet_distance  = mean_t FD(phi(samples[:, t]), phi(held-out clips[:, t]))   (FD per frame index, against
                        the held-out clips of the same T)
    frechet_floor     = the same for R = min(N, |train|) train clips drawn by a fixed seed: what real
                        clips of the same number score (FD's finite-sample bias); fd_ratio = FD / floor
    digit_accuracy    = mean over n, t of [p_t(x_n) == k_n]
    direction_accuracy= mean over n of [dir(v_n) == d_n], v_n [2] (rows, cols per frame) = the least-squares
                        slope over t of the centroid track c_t: per frame and axis the circular mean of the mass
                        profile with weights w = (x + 1) / 2 (background -1 weighs 0), angle
                        atan2(sum_i w_i sin(2 pi i / H), sum_i w_i cos(2 pi i / H)) as a position in [0, H), then
                        unwrapped over t (each step c_{t+1} - c_t taken mod H in [-H/2, H/2)); a frame whose mass
                        is diffuse (concentration |sum_i w_i exp(2 pi i sqrt(-1) / H)| / sum_i w_i below
                        MIN_CONCENTRATION = 0.25, e.g. noise) has no position: steps to and from it are 0;
                        dir(v) = argmax_d <v, step_d> over the 4 unit steps, and "no motion" (always wrong) when
                        |v| < MIN_SPEED = 0.5 px / frame (real speeds: 1, 2; steps of H / 2 = 8 px / frame or more
                        are aliased)
    mean_speed        = mean |v_n| px / frame (real clips: 1.5; a frozen clip: 0)
    consistency       = mean over n and t < T-1 of [p_t(x_n) == p_{t+1}(x_n)]: a clip whose digit
                        flickers between frames scores low, a steady one 1
    warp_error        = mean over n, t < T-1 of min over circular shifts (dy, dx) in [-2, 2]^2 of
                        mean |roll(x_t, (dy, dx)) - x_{t+1}|: the frame-to-frame change left after motion
                        compensation, 0 for real clips (exact circular translations of a digit), large for flicker
                        or for a shape that changes
Image-to-video samples (`--data moving-digits-i2v`: each clip was given its first frame g_n [1, H, W]) also score
    first_frame_error = mean over n of mean |x_n[:, 0] - g_n| over the frame's pixels (in [-1, 1]; 0 when the clip
                        starts with the given frame, 2 at most)
    first_frame_match = mean over n of [p_0(x_n) == p(g_n)]: the classifier reads the given frame's digit in the
                        generated first frame
Real held-out clips score digit accuracy = the classifier's held-out frame accuracy (~98%), direction
accuracy 1, consistency ~0.99, warp_error 0, for every T; a clip repeating its first frame has mean_speed 0 and
direction accuracy 0; a clip played backwards has direction accuracy 0; uniform noise has no position (speed 0).
Real clips that never touch an edge (all of `--data moving-digits`, T = 4) are never rolled and their circular
centroid moves exactly with them, so they score what the metric scored before clips wrapped (linear centroids,
shifts padded with -1); other clips (generated, flickering) can differ from it slightly.
Memory: O(N T H W) for the samples; cached per T: the held-out reference (features [T, 1,436, 64]) and, per N,
the floor.

CLI: `python -m dmd2_mega.eval.moving_digits samples.npz` with keys `images` float [N, 1, T, H, W] in
[-1, 1], `digits` and `directions` int [N] (launch/sample.py writes them for --data moving-digits[:T]) and, when
present, `first_frames` float [N, 1, H, W] (--data moving-digits-i2v[:T]); prints the dict as JSON on stdout.
`report_video` prints several as one table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from dmd2_mega.data.digits import NUM_CLASSES
from dmd2_mega.data.moving_digits import (DIRECTIONS, HEIGHT, MIN_FRAMES, STEPS, WIDTH, clip_geometry, make_clips,
                                          render)
from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.classifier import cache_dir
from dmd2_mega.eval.digits import check_ids, check_pixels, load_npz
from dmd2_mega.eval.frame_classifier import load_or_train_frame_classifier
from dmd2_mega.eval.frechet import frechet_distance

FLOOR_SEED = 0
MIN_SPEED = 0.5
MAX_SHIFT = 2
MIN_CONCENTRATION = 0.25
"""|sum_i w_i exp(2 pi i sqrt(-1) / L)| / sum_i w_i below which a frame has no position along that axis (real
digits: >= 0.49; uniform noise: <= 0.15)."""
UNWRAP_MARGIN = 1e-6
"""A frame is rolled only when that lowers its spread by more than this fraction (not on float ties)."""


def frames_of(clips: torch.Tensor) -> torch.Tensor:
    """[N, 1, T, H, W] -> [N * T, 1, H, W], clip-major."""
    n, c, t, h, w = clips.shape
    return clips.transpose(1, 2).reshape(n * t, c, h, w)


def _weights(clips: torch.Tensor) -> torch.Tensor:
    """Mass w = (x + 1) / 2 >= 0 (background -1 weighs 0), float64 [N, T, H, W]."""
    return ((clips[:, 0].double() + 1) / 2).clamp(min=0)


def _spread(profile: torch.Tensor) -> torch.Tensor:
    """Mass profiles [..., L] -> their variance about the (linear) mean position [...]; 0 for no mass."""
    i = torch.arange(profile.shape[-1], dtype=profile.dtype)
    mass = profile.sum(-1).clamp(min=1e-12)
    mean = (profile * i).sum(-1) / mass
    return (profile * (i - mean[..., None]) ** 2).sum(-1) / mass


def unwrap_frames(clips: torch.Tensor) -> torch.Tensor:
    """clips [N, 1, T, H, W] -> the same with each frame rolled by H / 2 rows where that lowers the spread of its
    row profile (by more than UNWRAP_MARGIN), then likewise by W / 2 columns: a digit split by an edge of the
    torus is whole again, one inside the canvas is untouched (module docstring)."""
    x = clips
    for dim, half in ((-2, HEIGHT // 2), (-1, WIDTH // 2)):
        profile = _weights(x).sum(-1 if dim == -2 else -2)                         # [N, T, L]
        roll = _spread(profile.roll(half, -1)) < (1 - UNWRAP_MARGIN) * _spread(profile)
        x = torch.where(roll[:, None, :, None, None], x.roll(half, dim), x)
    return x


def centroid_tracks(clips: torch.Tensor) -> torch.Tensor:
    """The circular centroid (row, col) per frame, unwrapped over time, float64 [N, T, 2] (module docstring): a
    step from or to a frame whose mass is diffuse along that axis (concentration < MIN_CONCENTRATION: noise, a
    blank frame, which sits at the canvas centre) is 0."""
    w = _weights(clips)
    pos = []
    for profile, size in ((w.sum(3), HEIGHT), (w.sum(2), WIDTH)):                  # [N, T, L] per axis
        angle = torch.arange(size, dtype=torch.float64) * (2 * math.pi / size)
        cos, sin = (profile * angle.cos()).sum(-1), (profile * angle.sin()).sum(-1)
        focused = torch.hypot(cos, sin) >= MIN_CONCENTRATION * profile.sum(-1).clamp(min=1e-12)
        c = torch.where(focused, (torch.atan2(sin, cos) * (size / (2 * math.pi))) % size, (size - 1) / 2)
        step = torch.remainder(c.diff(dim=1) + size / 2, size) - size / 2          # [N, T-1] in [-L/2, L/2)
        step = torch.where(focused[:, 1:] & focused[:, :-1], step, 0.0)
        pos.append(torch.cat([c[:, :1], c[:, :1] + step.cumsum(1)], dim=1))
    return torch.stack(pos, dim=-1)


def fit_velocity(tracks: torch.Tensor) -> torch.Tensor:
    """Least-squares slope over t of tracks [N, T, 2] -> velocity [N, 2] (px / frame)."""
    t = torch.arange(tracks.shape[1], dtype=tracks.dtype)
    t = t - t.mean()
    return ((tracks - tracks[:, :1]) * t[None, :, None]).sum(1) / (t * t).sum()


def predict_direction(velocity: torch.Tensor) -> torch.Tensor:
    """velocity [N, 2] -> direction id int64 [N] (index into DIRECTIONS), -1 where |v| < MIN_SPEED."""
    d = (velocity @ STEPS.to(velocity.dtype).T).argmax(1)
    return torch.where(velocity.norm(dim=1) >= MIN_SPEED, d, -1)


def warp_error(clips: torch.Tensor) -> torch.Tensor:
    """Per clip [N]: mean over consecutive frames of the least mean |roll(x_t, (dy, dx)) - x_{t+1}| over circular
    shifts (dy, dx) in [-MAX_SHIFT, MAX_SHIFT]^2 (each a view of x_t padded circularly once)."""
    x = clips[:, 0].float()
    prev, nxt = x[:, :-1], x[:, 1:]
    m = MAX_SHIFT
    padded = F.pad(prev, (m, m, m, m), mode="circular")   # padded[.., m + i, m + j] = prev[.., i mod H, j mod W]
    best = torch.full(prev.shape[:2], float("inf"))
    for dy in range(-m, m + 1):  # 25 shifts, each over the whole batch
        for dx in range(-m, m + 1):
            moved = padded[..., m - dy:m - dy + HEIGHT, m - dx:m - dx + WIDTH]    # roll(prev, (dy, dx))
            best = torch.minimum(best, (moved - nxt).abs().mean((2, 3)))
    return best.mean(1)


def first_frame_error(clips: torch.Tensor, first_frames: torch.Tensor) -> torch.Tensor:
    """Per clip [N]: mean |clips[n, :, 0] - first_frames[n]| over the frame's pixels (clips [N, 1, T, H, W], given
    first frames [N, 1, H, W])."""
    return (clips[:, :, 0].float() - first_frames.float()).abs().flatten(1).mean(1)


def _features_and_predictions(clf, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """clips [N, 1, T, H, W] -> (features of the unwrapped frames float32 [N, T, 64], predicted digit int64
    [N, T])."""
    n, t = len(clips), clips.shape[2]
    feats = clf.features(frames_of(unwrap_frames(clips)))
    with torch.no_grad():
        pred = clf.head(feats).argmax(1)
    return feats.view(n, t, -1), pred.view(n, t)


@lru_cache(maxsize=4)
def _reference(cache: str, frames: int):
    """(classifier, held-out features per frame index [T, M, 64], held-out frame accuracy) at T = `frames`."""
    clf = load_or_train_frame_classifier(cache)
    held, digit = make_clips("heldout", frames)[:2]
    feats, pred = _features_and_predictions(clf, held)
    return clf, feats.transpose(0, 1), (pred == digit[:, None]).double().mean().item()


def _per_frame_fd(feats: torch.Tensor, held_feats: torch.Tensor) -> float:
    return float(np.mean([frechet_distance(feats[:, t], held_feats[t]) for t in range(feats.shape[1])]))


@lru_cache(maxsize=8)
def _floor(cache: str, frames: int, n: int) -> float:
    """The per-frame FD of R = min(n, |train|) train clips of T = `frames` (drawn by FLOOR_SEED) to the held-out
    ones; only those R are rendered."""
    clf, held_feats, _ = _reference(cache, frames)
    glyphs, _, _, _, corners, _ = clip_geometry("train", frames)
    pick = torch.randperm(len(glyphs), generator=torch.Generator().manual_seed(FLOOR_SEED))[:n]
    return _per_frame_fd(_features_and_predictions(clf, render(glyphs[pick], corners[pick]))[0], held_feats)


def check_clips(images, frames: int | None = None) -> torch.Tensor:
    """Clips [N, 1, T, H, W] in [-1, 1] -> float32 CPU tensor; EvalInputError unless T >= MIN_FRAMES (and
    T == `frames` when given: the data's length)."""
    shape = tuple(np.shape(images))
    t = shape[2] if len(shape) == 5 else frames or "T"
    if frames is not None and t != frames:
        raise EvalInputError(f"clips must have shape [N, 1, {frames}, {HEIGHT}, {WIDTH}] (the data's {frames} "
                             f"frames), got {shape}")
    if isinstance(t, int) and t < MIN_FRAMES:
        raise EvalInputError(f"clips must have shape [N, 1, T, {HEIGHT}, {WIDTH}] with T >= {MIN_FRAMES} frames "
                             f"(motion needs two), got {shape}")
    return check_pixels(images, (1, t, HEIGHT, WIDTH), "clips")


def evaluate_moving_digits(images, digits, directions, cache: str | None = None, frames: int | None = None,
                           first_frames=None) -> dict:
    """Metrics (module docstring) of clips [N, 1, T, H, W] in [-1, 1] conditioned on digits, directions int [N];
    `frames`: the T the clips must have (None: any T >= 2); `first_frames` [N, 1, H, W] in [-1, 1]: the frames an
    image-to-video model was given (adds first_frame_error and first_frame_match)."""
    x = check_clips(images, frames)
    k = check_ids(digits, len(x), "digits", NUM_CLASSES)
    d = check_ids(directions, len(x), "directions", len(DIRECTIONS))
    t, cache = x.shape[2], str(cache_dir(cache).resolve())
    clf, held_feats, held_acc = _reference(cache, t)
    feats, pred = _features_and_predictions(clf, x)
    fd = _per_frame_fd(feats, held_feats)
    floor = _floor(cache, t, len(x))
    velocity = fit_velocity(centroid_tracks(x))
    given = {}
    if first_frames is not None:
        g = check_pixels(first_frames, (1, HEIGHT, WIDTH), "first_frames")
        if len(g) != len(x):
            raise EvalInputError(f"first_frames has {len(g)} frames for {len(x)} clips")
        given = {"first_frame_error": first_frame_error(x, g).mean().item(),
                 "first_frame_match": (pred[:, 0] == _features_and_predictions(clf, g[:, :, None])[1][:, 0])
                 .double().mean().item()}
    return {
        "frechet_distance": fd,
        "frechet_floor": floor,
        "fd_ratio": fd / floor if floor > 0 else float("inf"),
        "digit_accuracy": (pred == k[:, None]).double().mean().item(),
        "direction_accuracy": (predict_direction(velocity) == d).double().mean().item(),
        "mean_speed": velocity.norm(dim=1).mean().item(),
        "consistency": (pred[:, 1:] == pred[:, :-1]).double().mean().item(),
        "warp_error": warp_error(x).mean().item(),
        "num_samples": int(len(x)),
        "num_frames": int(t),
        "classifier_heldout_accuracy": held_acc,
        **given,
    }


def load_samples(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, digits, directions) of a samples.npz; EvalInputError naming the file and missing keys."""
    return load_npz(path, ("images", "digits", "directions"),
                    "sample a --data moving-digits[:T] model with launch/sample.py")


def load_first_frames(path: str) -> np.ndarray | None:
    """The `first_frames` [N, 1, H, W] of an image-to-video samples.npz, None when it has none."""
    with np.load(path) as npz:
        return npz["first_frames"] if "first_frames" in npz.files else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmd2_mega.eval.moving_digits", description=__doc__.split("\n")[0])
    p.add_argument("samples", help=".npz with images [N, 1, T, H, W] in [-1, 1], digits and directions int [N] "
                                   "(image-to-video: first_frames [N, 1, H, W])")
    args = p.parse_args(argv)
    try:
        result = evaluate_moving_digits(*load_samples(args.samples), first_frames=load_first_frames(args.samples))
    except EvalInputError as e:
        print(f"error: {args.samples}: {e}" if args.samples not in str(e) else f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
