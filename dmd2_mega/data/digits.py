"""scikit-learn's 8x8 handwritten digits as a class-conditional image dataset.

`sklearn.datasets.load_digits()`: 1,797 grey images, 8x8, integer values 0..16, 10 classes, read from the file it
reads (`sklearn/datasets/data/digits.csv.gz`: one row per image, 64 pixels then the label) without importing
scikit-learn, whose import (scipy.stats with it) costs ~3.5 s of every training process's start-up.
    x = value / 8 - 1       float32 [N, 1, 8, 8] in [-1, 1]   (0 -> -1, 16 -> +1)
    y = label               int64 [N] in [0, 10); null class id for CFG = 10

Fixed train / held-out split, stratified by class: for each class c with n_c images (in
`load_digits` order), a `numpy.random.RandomState(SPLIT_SEED)` permutation (the legacy generator,
whose stream NumPy keeps frozen across versions) picks round(HELDOUT_FRACTION * n_c) of them for
held-out. With seed 0 and fraction 0.2: train 1,438 images, held-out 359 (every class in both).
"""
import importlib.util
import os
from functools import lru_cache
from typing import Tuple

import numpy as np
import torch

from dmd2_mega.errors import DataError
from .dataset import ImageDataset

SPLIT_SEED = 0
HELDOUT_FRACTION = 0.2
NUM_CLASSES = 10
TRAIN_SIZE, HELDOUT_SIZE = 1438, 359


DIGITS_FILE = os.path.join("datasets", "data", "digits.csv.gz")  # inside the installed sklearn package


def digits_file() -> str:
    """The installed scikit-learn's digits.csv.gz, located without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), DIGITS_FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise DataError(f"the embedded digits data set is scikit-learn's {DIGITS_FILE}: not found "
                        f"({path or 'scikit-learn is not installed'}); pip install scikit-learn")
    return path


@lru_cache(maxsize=1)
def _load() -> Tuple[np.ndarray, np.ndarray]:
    rows = np.loadtxt(digits_file(), delimiter=",", dtype=np.float32)  # [1797, 65]
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


@lru_cache(maxsize=1)
def split_indices() -> Tuple[np.ndarray, np.ndarray]:
    """(train, heldout) indices into `load_digits()` order, each sorted ascending."""
    _, labels = _load()
    rng = np.random.RandomState(SPLIT_SEED)
    heldout = []
    for c in range(NUM_CLASSES):
        members = np.flatnonzero(labels == c)
        n_held = int(np.floor(HELDOUT_FRACTION * len(members) + 0.5))
        heldout.append(members[rng.permutation(len(members))[:n_held]])
    heldout = np.sort(np.concatenate(heldout))
    train = np.setdiff1d(np.arange(len(labels)), heldout)
    return train, heldout


class DigitsDataset(ImageDataset):
    """The embedded digits: x float32 [N, 1, 8, 8] in [-1, 1], labels int64 [N], 10 classes."""

    def __init__(self, split: str = "train"):
        if split not in ("train", "heldout"):
            raise DataError(f"digits split must be 'train' or 'heldout', got {split!r}")
        images, labels = _load()
        train, heldout = split_indices()
        self.split = split
        self.indices = train if split == "train" else heldout
        x = torch.from_numpy(images[self.indices] / 8.0 - 1.0).unsqueeze(1)
        y = torch.from_numpy(labels[self.indices])
        super().__init__(x, y, num_classes=NUM_CLASSES, cond_shape=None, source=f"digits[{split}]")
