"""Sample quality on the 8x8 digits: Frechet distance in classifier features + class accuracy.

With phi the penultimate features [N, 64] of the cached `DigitsClassifier`:
    frechet_distance = FD(phi(samples), phi(held-out real digits))
    frechet_floor    = FD(phi(R), phi(held-out)), R = min(N, |train|) train digits drawn without
                       replacement by a fixed seed: what real data of the same size scores
    fd_ratio         = frechet_distance / frechet_floor   (~1 for real-quality samples)
    class_accuracy   = mean(argmax classifier(samples) == conditioning label)  (None if no labels)
    diversity        = D(samples) / D(held-out), D = mean over classes c of the mean over pixels of
                       the std over the samples of class c (one class if no labels): ~1 for real
                       diversity, -> 0 under mode collapse
FD has a positive finite-sample bias that shrinks with N, hence the floor at the same N.

CLI: `python -m dmd2_mega.eval.digits samples.npz` with keys `images` float [N, 1, 8, 8] in
[-1, 1] and `labels` int64 [N] (or `--no-labels`); prints the dict as JSON on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.classifier import NUM_CLASSES, cache_dir, load_or_train_classifier, load_split
from dmd2_mega.eval.frechet import frechet_distance

FLOOR_SEED = 0
RANGE_TOL = 1e-3  # allowed overshoot of [-1, 1] (float rounding of a clamp / rescale)


@lru_cache(maxsize=4)
def _reference(cache: str):
    """(classifier, held-out features [M, D], held-out accuracy, train images) for a cache dir."""
    clf = load_or_train_classifier(cache)
    held_x, held_y = load_split("heldout")
    train_x, _ = load_split("train")
    return clf, clf.features(held_x), clf.accuracy(held_x, held_y), train_x


def check_pixels(images, shape: tuple, what: str) -> torch.Tensor:
    """Samples [N, *shape] in [-1, 1] (tensor or array) -> float32 CPU tensor, or an EvalInputError naming `what`
    (e.g. "images" / "clips") and the problem: dtype, shape, N < 2, NaN/inf, a range that is not [-1, 1]."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if not x.is_floating_point():
        raise EvalInputError(f"{what} must be floating point in [-1, 1], got dtype {x.dtype}")
    x = x.detach().to("cpu", torch.float32)
    if x.ndim != 1 + len(shape) or tuple(x.shape[1:]) != tuple(shape):
        raise EvalInputError(f"{what} must have shape [N, {', '.join(map(str, shape))}], got {tuple(x.shape)}")
    if x.shape[0] < 2:
        raise EvalInputError(f"need at least 2 {what} to fit a covariance, got N={x.shape[0]}")
    if not torch.isfinite(x).all():
        raise EvalInputError(f"{what} contain {int((~torch.isfinite(x)).sum())} NaN/inf values")
    lo, hi = x.min().item(), x.max().item()
    if lo < -1 - RANGE_TOL or hi > 1 + RANGE_TOL:
        raise EvalInputError(f"{what} must lie in [-1, 1], got min {lo:.4g}, max {hi:.4g} "
                             f"(clamp samples to [-1, 1]; are they in [0, 1] or [0, 255]?)")
    return x


def check_ids(values, n: int, what: str, k: int, note: str = "") -> torch.Tensor:
    """Integer ids [N] = [n] in [0, k) (tensor or array) -> int64 CPU tensor, or an EvalInputError naming `what`
    (e.g. "labels" / "directions") and the problem: a float or bool dtype, another shape, an id out of range
    (`note` follows the range, e.g. " (no null class)")."""
    y = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if y.is_floating_point() or y.dtype == torch.bool:
        raise EvalInputError(f"{what} must be integer ids, got dtype {y.dtype}")
    y = y.to("cpu", torch.int64)
    if tuple(y.shape) != (n,):
        raise EvalInputError(f"{what} must have shape [N] = [{n}], got {tuple(y.shape)}")
    if len(y) and (y.min() < 0 or y.max() >= k):
        raise EvalInputError(f"{what} must lie in [0, {k}){note}, got min {int(y.min())}, max {int(y.max())}")
    return y


def load_npz(path: str, keys: Sequence[str], hint: str = "") -> tuple:
    """The arrays `keys` of a samples .npz, in order; an EvalInputError naming the file when it cannot be read
    or lacks a key (then `hint`: how to get a file that has it)."""
    try:
        with np.load(path) as npz:
            missing = [key for key in keys if key not in npz.files]
            if missing:
                raise EvalInputError(f"{path}: missing key(s) {missing}; found {npz.files}"
                                     + (f" ({hint})" if hint else ""))
            return tuple(npz[key] for key in keys)
    except (OSError, ValueError) as e:
        if isinstance(e, EvalInputError):
            raise
        raise EvalInputError(f"{path}: cannot read as .npz ({e})") from None


def load_samples(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of a samples.npz of a --data digits model (launch/sample.py)."""
    return load_npz(path, ("images", "labels"), "pass --no-labels for unconditional samples")


def pixel_diversity(x: torch.Tensor, y: torch.Tensor | None) -> float:
    """Mean over classes of the mean per-pixel std within the class (x [N, ...], y [N] or None)."""
    flat = x.reshape(len(x), -1).double()
    if y is None:
        return float(flat.std(dim=0).mean())
    stds = [flat[y == c].std(dim=0).mean() for c in torch.unique(y).tolist() if int((y == c).sum()) > 1]
    return float(torch.stack(stds).mean()) if stds else 0.0


def evaluate_digits(images, labels=None, cache: str | None = None) -> dict:
    """Metrics of samples images [N, 1, 8, 8] in [-1, 1] with conditioning labels int64 [N] or None."""
    x = check_pixels(images, (1, 8, 8), "images")
    y = None if labels is None else check_ids(labels, len(x), "labels", NUM_CLASSES, " (no null class)")
    clf, held_feats, held_acc, train_x = _reference(str(cache_dir(cache).resolve()))

    fd = frechet_distance(clf.features(x), held_feats)
    n_real = min(len(x), len(train_x))
    gen = torch.Generator().manual_seed(FLOOR_SEED)
    real = train_x[torch.randperm(len(train_x), generator=gen)[:n_real]]
    floor = frechet_distance(clf.features(real), held_feats)
    held_x, held_y = load_split("heldout")
    real_div = pixel_diversity(held_x, None if y is None else held_y)
    return {
        "frechet_distance": fd,
        "frechet_floor": floor,
        "fd_ratio": fd / floor if floor > 0 else float("inf"),
        "class_accuracy": None if y is None else clf.accuracy(x, y),
        "diversity": pixel_diversity(x, y) / real_div,
        "num_samples": int(len(x)),
        "classifier_heldout_accuracy": held_acc,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmd2_mega.eval.digits", description=__doc__.split("\n")[0])
    p.add_argument("samples", help=".npz with images float [N, 1, 8, 8] in [-1, 1] and labels int64 [N]")
    p.add_argument("--no-labels", action="store_true", help="unconditional samples: skip class_accuracy")
    args = p.parse_args(argv)
    try:
        if args.no_labels:
            (images,), labels = load_npz(args.samples, ("images",)), None
        else:
            images, labels = load_samples(args.samples)
    except EvalInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[eval] {args.samples}: {images.shape[0] if images.ndim else 0} samples", file=sys.stderr)
    try:
        result = evaluate_digits(images, labels)
    except EvalInputError as e:
        print(f"error: {args.samples}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
