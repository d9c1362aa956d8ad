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


def _check_labels(labels, n: int) -> torch.Tensor:
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if y.is_floating_point() or y.dtype == torch.bool:
        raise EvalInputError(f"labels must be integer class ids, got dtype {y.dtype}")
    y = y.to("cpu", torch.int64)
    if tuple(y.shape) != (n,):
        raise EvalInputError(f"labels must have shape [N] = [{n}], got {tuple(y.shape)}")
    if len(y) and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise EvalInputError(f"labels must lie in [0, {NUM_CLASSES}) (no null class), "
                             f"got min {int(y.min())}, max {int(y.max())}")
    return y


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
    y = None if labels is None else _check_labels(labels, len(x))
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
        with np.load(args.samples) as npz:
            need = ["images"] + ([] if args.no_labels else ["labels"])
            missing = [k for k in need if k not in npz.files]
            if missing:
                raise EvalInputError(f"{args.samples}: missing key(s) {missing}; found {npz.files} "
                                     f"(pass --no-labels for unconditional samples)")
            images = npz["images"]
            labels = None if args.no_labels else npz["labels"]
    except (OSError, ValueError) as e:
        if not isinstance(e, EvalInputError):
            e = EvalInputError(f"{args.samples}: cannot read as .npz ({e})")
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
