"""Feature classifier for the 8x8 digits metric.

A small CNN on images x [N, 1, 8, 8] in [-1, 1]:
    conv3x3(1->16) relu, conv3x3(16->32) relu, maxpool2 -> [N, 32, 4, 4],
    conv3x3(32->32) relu, flatten 512 -> linear 64 relu  = features phi(x) [N, 64],
    linear 64 -> 10                                       = logits [N, 10].
The features phi are the space in which `frechet.frechet_distance` compares samples with data. `EvalCNN`, its
base, is what it shares with the moving-digits `frame_classifier.FrameClassifier`: the batched, gradient-free
`features` / `logits` of inputs checked against the net's input shape; `cached` is their shared cache.

Trained once, deterministically (seed 0, CPU, AdamW + cosine LR, cross entropy, random +-1 pixel
shifts padded with the background value -1), on `DigitsDataset("train")`, then cached as
`$DMD2_MEGA_CACHE/digits_classifier_v1.pt` (default `~/.cache/dmd2_mega`) together with a
fingerprint of the training data. A cache that fails to load, does not fit the architecture or was
trained on other data is retrained and rewritten (temp file + os.replace, never half-written).
"""
from __future__ import annotations

import abc
import hashlib
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.data.digits import DigitsDataset

CACHE_ENV = "DMD2_MEGA_CACHE"
CACHE_NAME = "digits_classifier_v1.pt"
NUM_CLASSES = 10
FEATURE_DIM = 64


def load_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 [N, 1, 8, 8] in [-1, 1], labels int64 [N]) of DigitsDataset(split)."""
    ds = DigitsDataset(split=split)
    x = ds.x if hasattr(ds, "x") else ds.images  # ImageDataset names them x / cond
    y = ds.cond if hasattr(ds, "cond") else ds.labels
    images = torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8)
    labels = torch.as_tensor(y, dtype=torch.int64).reshape(-1)
    return images, labels


class EvalCNN(nn.Module, metaclass=abc.ABCMeta):
    """What the two eval CNNs share (this one and `frame_classifier.FrameClassifier`): `embed(x)` -> features
    [N, FEATURE_DIM] (the subclass's layers), `head` -> logits [N, 10], and `features` / `logits` of any number of
    inputs [N, *INPUT] in [-1, 1], in batches of BATCH on the CPU without gradients."""
    INPUT: tuple = ()
    WHAT = "inputs"
    BATCH = 2048
    head: nn.Linear

    @abc.abstractmethod
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """inputs [n, *INPUT] -> features [n, FEATURE_DIM]"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))

    @torch.no_grad()
    def _batched(self, fn, inputs: torch.Tensor) -> torch.Tensor:
        self.eval()
        x = torch.as_tensor(inputs).detach().to("cpu", torch.float32)
        if x.ndim != 1 + len(self.INPUT) or tuple(x.shape[1:]) != tuple(self.INPUT):
            raise ValueError(f"{type(self).__name__} expects {self.WHAT} [N, {', '.join(map(str, self.INPUT))}], "
                             f"got {tuple(x.shape)}")
        return torch.cat([fn(x[i:i + self.BATCH]) for i in range(0, len(x), self.BATCH)])

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """Penultimate features float32 [N, FEATURE_DIM] of inputs [N, *INPUT] in [-1, 1]."""
        return self._batched(self.embed, inputs)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """float32 [N, 10]."""
        return self._batched(self.forward, inputs)


class DigitsClassifier(EvalCNN):
    INPUT = (1, 8, 8)
    WHAT = "images"

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, FEATURE_DIM)
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        h = F.relu(self.conv3(F.max_pool2d(h, 2)))
        return F.relu(self.fc(h.flatten(1)))

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Predicted class int64 [N]."""
        return self.logits(images).argmax(1)

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        return (self.predict(images) == torch.as_tensor(labels)).double().mean().item()


def _random_shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift each image by (dy, dx) in {-1, 0, 1}^2, filling with the background value -1."""
    padded = F.pad(x, (1, 1, 1, 1), value=-1.0)
    offs = torch.randint(0, 3, (len(x), 2), generator=gen)
    out = torch.empty_like(x)
    for dy in range(3):
        for dx in range(3):
            m = (offs[:, 0] == dy) & (offs[:, 1] == dx)
            out[m] = padded[m, :, dy:dy + 8, dx:dx + 8]
    return out


def train_classifier(images: torch.Tensor, labels: torch.Tensor, seed: int = 0,
                     epochs: int = 30, batch_size: int = 64, lr: float = 3e-3) -> DigitsClassifier:
    """Deterministic training on CPU; the global RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsClassifier()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-len(images) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps_per_epoch)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(images), generator=gen)
        for i in range(0, len(images), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(model(_random_shift(images[idx], gen)), labels[idx],
                                   label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: `path`, else $DMD2_MEGA_CACHE, else ~/.cache/dmd2_mega."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dmd2_mega"
    return Path(path).expanduser()


def _fingerprint(images: torch.Tensor, labels: torch.Tensor) -> str:
    h = hashlib.sha256(images.contiguous().numpy().tobytes())
    h.update(labels.contiguous().numpy().tobytes())
    return h.hexdigest()


def _try_load(path: Path, fingerprint: str, make: Callable[[], nn.Module], what: str) -> nn.Module | None:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("fingerprint") != fingerprint:
            print(f"[eval] {path} was trained on other data; retraining", file=sys.stderr)
            return None
        model = make()
        model.load_state_dict(blob["state_dict"], strict=True)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise ValueError("non-finite weights")
        return model.eval()
    except Exception as e:  # corrupt, truncated, or from another architecture
        print(f"[eval] cannot use cached {what} {path} ({type(e).__name__}: {e}); retraining", file=sys.stderr)
        return None


def cached(file: Path, fingerprint: str, make: Callable[[], nn.Module], train: Callable[[], nn.Module],
           what: str) -> nn.Module:
    """The model cached at `file` when it was trained on the data `fingerprint` names and loads whole into
    `make()`; else `train()`'s model, written there first (atomically)."""
    if file.exists():
        model = _try_load(file, fingerprint, make, what)
        if model is not None:
            return model
    print(f"[eval] training the {what} -> {file}", file=sys.stderr)
    model = train()
    state = {"state_dict": model.state_dict(), "fingerprint": fingerprint, "version": 1}
    atomic_write(file, lambda f: torch.save(state, f))
    return model


def load_or_train_classifier(path: str | os.PathLike | None = None) -> DigitsClassifier:
    """The cached classifier in `cache_dir(path)`, trained and written there first if missing/bad."""
    images, labels = load_split("train")
    return cached(cache_dir(path) / CACHE_NAME, _fingerprint(images, labels), DigitsClassifier,
                  lambda: train_classifier(images, labels), "digits feature classifier")
