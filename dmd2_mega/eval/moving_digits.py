"""Sample quality on moving digits: per-frame Frechet distance, digit, motion direction, consistency.

Clips x [N, 1, T, H, W] in [-1, 1] (`data/moving_digits.py` geometry) conditioned on (digit k_n,
direction d_n); phi = the features [., 64] and p_t = argmax logits of the cached `FrameClassifier`
(frame_classifier.py; why not the 8x8 classifier on a crop: see there), applied to each frame x_t:
    frechet_distance  = mean_t FD(phi(samples[:, t]), phi(held-out clips[:, t]))   (FD per frame index)
    frechet_floor     = the same for R = min(N, |train|) train clips drawn by a fixed seed: what real
                        clips of the same number score (FD's finite-sample bias); fd_ratio = FD / floor
    digit_accuracy    = mean over n, t of [p_t(x_n) == k_n]
    direction_accuracy= mean over n of [dir(v_n) == d_n], v_n [2] (rows, cols per frame) = the least-squares
                        slope over t of the centroid c_t = sum_p w_p p / sum_p w_p with weights w = (x + 1) / 2
                        (background -1 weighs 0); dir(v) = argmax_d <v, step_d> over the 4 unit steps, and
                        "no motion" (always wrong) when |v| < MIN_SPEED = 0.5 px / frame (real speeds: 1, 2)
    mean_speed        = mean |v_n| px / frame (real clips: 1.5; a frozen clip: 0)
    consistency       = mean over n and t < T-1 of [p_t(x_n) == p_{t+1}(x_n)]: a clip whose digit
                        flickers between frames scores low, a steady one 1
    warp_error        = mean over n, t < T-1 of min over integer shifts (dy, dx) in [-2, 2]^2 of
                        mean |shift(x_t) - x_{t+1}| (shifted in with background -1): the frame-to-frame
                        change left after motion compensation, 0 for real clips (exact translations of a
                        digit inside the canvas), large for flicker or for a shape that changes
Real held-out clips score digit accuracy = the classifier's held-out frame accuracy (~98%), direction
accuracy 1, consistency ~0.99, warp_error 0; a clip repeating its first frame has mean_speed 0 and
direction accuracy 0; a clip played backwards has direction accuracy 0.

CLI: `python -m dmd2_mega.eval.moving_digits samples.npz` with keys `images` float [N, 1, T, H, W] in
[-1, 1], `digits` and `directions` int [N] (launch/sample.py writes them for --data moving-digits);
prints the dict as JSON on stdout. `report_video` prints several as one table.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from dmd2_mega.data.digits import NUM_CLASSES
from dmd2_mega.data.moving_digits import DIRECTIONS, FRAMES, HEIGHT, STEPS, WIDTH, MovingDigitsDataset
from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.classifier import cache_dir
from dmd2_mega.eval.digits import check_ids, check_pixels, load_npz
from dmd2_mega.eval.frame_classifier import load_or_train_frame_classifier
from dmd2_mega.eval.frechet import frechet_distance

FLOOR_SEED = 0
MIN_SPEED = 0.5
MAX_SHIFT = 2


def frames_of(clips: torch.Tensor) -> torch.Tensor:
    """[N, 1, T, H, W] -> [N * T, 1, H, W], clip-major."""
    n, c, t, h, w = clips.shape
    return clips.transpose(1, 2).reshape(n * t, c, h, w)


def centroid_tracks(clips: torch.Tensor) -> torch.Tensor:
    """Intensity-weighted centroid (row, col) per frame, float64 [N, T, 2]; weights (x + 1) / 2, a frame with
    no mass at the canvas centre."""
    w = ((clips[:, 0].double() + 1) / 2).clamp(min=0)                          # [N, T, H, W]
    mass = w.sum((2, 3))
    rows = (w.sum(3) * torch.arange(HEIGHT, dtype=torch.float64)).sum(2)
    cols = (w.sum(2) * torch.arange(WIDTH, dtype=torch.float64)).sum(2)
    centre = torch.tensor([(HEIGHT - 1) / 2, (WIDTH - 1) / 2], dtype=torch.float64)
    track = torch.stack([rows, cols], dim=-1) / mass.clamp(min=1e-12)[..., None]
    return torch.where(mass[..., None] > 1e-12, track, centre)


def fit_velocity(tracks: torch.Tensor) -> torch.Tensor:
    """Least-squares slope over t of tracks [N, T, 2] -> velocity [N, 2] (px / frame)."""
    t = torch.arange(tracks.shape[1], dtype=tracks.dtype)
    t = t - t.mean()
    return (tracks * t[None, :, None]).sum(1) / (t * t).sum()


def predict_direction(velocity: torch.Tensor) -> torch.Tensor:
    """velocity [N, 2] -> direction id int64 [N] (index into DIRECTIONS), -1 where |v| < MIN_SPEED."""
    d = (velocity @ STEPS.to(velocity.dtype).T).argmax(1)
    return torch.where(velocity.norm(dim=1) >= MIN_SPEED, d, -1)


def warp_error(clips: torch.Tensor) -> torch.Tensor:
    """Per clip [N]: mean over consecutive frames of the least mean |shift(x_t) - x_{t+1}| over integer shifts
    in [-MAX_SHIFT, MAX_SHIFT]^2 (background -1 shifted in)."""
    x = clips[:, 0].float()
    prev, nxt = x[:, :-1], x[:, 1:]
    m = MAX_SHIFT
    padded = F.pad(prev, (m, m, m, m), value=-1.0)
    best = torch.full(prev.shape[:2], float("inf"))
    for dy in range(2 * m + 1):  # 25 shifts, each over the whole batch
        for dx in range(2 * m + 1):
            moved = padded[..., dy:dy + HEIGHT, dx:dx + WIDTH]
            best = torch.minimum(best, (moved - nxt).abs().mean((2, 3)))
    return best.mean(1)


@lru_cache(maxsize=4)
def _reference(cache: str):
    """(classifier, held-out features per frame index [T, M, 64], held-out frame accuracy, train clips)."""
    clf = load_or_train_frame_classifier(cache)
    held = MovingDigitsDataset("heldout")
    feats = clf.features(frames_of(held.x)).view(len(held), FRAMES, -1).transpose(0, 1)
    acc = (clf.logits(frames_of(held.x)).argmax(1) == held.digit.repeat_interleave(FRAMES)).double().mean().item()
    return clf, feats, acc, MovingDigitsDataset("train").x


def _per_frame_fd(clf, clips: torch.Tensor, held_feats: torch.Tensor) -> float:
    feats = clf.features(frames_of(clips)).view(len(clips), FRAMES, -1)
    return float(np.mean([frechet_distance(feats[:, t], held_feats[t]) for t in range(FRAMES)]))


def evaluate_moving_digits(images, digits, directions, cache: str | None = None) -> dict:
    """Metrics (module docstring) of clips [N, 1, T, H, W] in [-1, 1] conditioned on digits, directions int [N]."""
    x = check_pixels(images, (1, FRAMES, HEIGHT, WIDTH), "clips")
    k = check_ids(digits, len(x), "digits", NUM_CLASSES)
    d = check_ids(directions, len(x), "directions", len(DIRECTIONS))
    clf, held_feats, held_acc, train_x = _reference(str(cache_dir(cache).resolve()))

    fd = _per_frame_fd(clf, x, held_feats)
    gen = torch.Generator().manual_seed(FLOOR_SEED)
    real = train_x[torch.randperm(len(train_x), generator=gen)[:min(len(x), len(train_x))]]
    floor = _per_frame_fd(clf, real, held_feats)
    pred = clf.logits(frames_of(x)).argmax(1).view(len(x), FRAMES)
    velocity = fit_velocity(centroid_tracks(x))
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
        "classifier_heldout_accuracy": held_acc,
    }


def load_samples(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, digits, directions) of a samples.npz; EvalInputError naming the file and missing keys."""
    return load_npz(path, ("images", "digits", "directions"),
                    "sample a --data moving-digits model with launch/sample.py")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmd2_mega.eval.moving_digits", description=__doc__.split("\n")[0])
    p.add_argument("samples", help=".npz with images [N, 1, T, H, W] in [-1, 1], digits and directions int [N]")
    args = p.parse_args(argv)
    try:
        result = evaluate_moving_digits(*load_samples(args.samples))
    except EvalInputError as e:
        print(f"error: {args.samples}: {e}" if args.samples not in str(e) else f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
