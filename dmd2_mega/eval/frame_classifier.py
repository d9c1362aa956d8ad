"""Frame classifier for the moving-digits metric: which digit a 16x16 frame shows, wherever it sits.

A small CNN on frames x [N, 1, 16, 16] in [-1, 1] (`data/moving_digits.py` geometry):
    conv3x3(1->16) relu, maxpool2 -> [N, 16, 8, 8], conv3x3(16->32) relu, maxpool2 -> [N, 32, 4, 4],
    conv3x3(32->32) relu, flatten 512 -> linear 64 relu   = features phi(x) [N, 64],
    linear 64 -> 10                                        = logits [N, 10].
Why a classifier of its own and not the 8x8 digits one on a crop around the digit's centroid: the
centroid of a digit is not the centre of its 8x8 box (a "1" or a "7" sits off-centre), so a crop
shifts each class differently, and a generated frame with a smeared digit would be cropped wrongly
and scored twice for one fault. This one is trained on whole frames with the digit anywhere, which is
the real frames' distribution, and needs no localisation.

Trained once, deterministically (seed 0, CPU, AdamW + cosine LR, cross entropy with label smoothing
0.05), on frames rendered from the TRAIN digit images (`digits.split_indices`) at corners drawn
uniformly over all positions that keep the digit inside the canvas: EPOCHS = 8 passes, each over
PLACEMENTS = 8 frames per image at fresh corners (torch.Generator(seed)); held-out images are never
seen. About 15 s on one CPU core; 98% accuracy on the frames of the held-out clips. Cached as
`$DMD2_MEGA_CACHE/moving_digits_classifier_v1.pt` (the directory of `classifier.cache_dir`) with a
fingerprint of the training images and the canvas size; a cache that fails to load, does not fit or
was trained on other data is retrained and rewritten atomically.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from dmd2_mega.data.digits import NUM_CLASSES, _load, split_indices
from dmd2_mega.data.moving_digits import GLYPH, HEIGHT, WIDTH, render
from dmd2_mega.eval.classifier import EvalCNN, cache_dir, cached

CACHE_NAME = "moving_digits_classifier_v1.pt"
FEATURE_DIM = 64
EPOCHS = 8
PLACEMENTS = 8
"""Frames per train image and epoch (each at its own random corner): 8 x 8 x 1,438 frames in all."""


class FrameClassifier(EvalCNN):
    INPUT = (1, HEIGHT, WIDTH)
    WHAT = "frames"
    BATCH = 4096

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * (HEIGHT // 4) * (WIDTH // 4), FEATURE_DIM)
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.relu(self.fc(F.relu(self.conv3(h)).flatten(1)))


def train_glyphs() -> tuple[torch.Tensor, torch.Tensor]:
    """(train digit images float32 [N, 8, 8] in [-1, 1], labels int64 [N])."""
    images, labels = _load()
    train = split_indices()[0]
    return torch.from_numpy(images[train] / 8.0 - 1.0), torch.from_numpy(labels[train])


def random_frames(glyphs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each glyph [N, 8, 8] at a uniform corner inside the canvas -> frames [N, 1, H, W]."""
    room = torch.tensor([HEIGHT - GLYPH + 1, WIDTH - GLYPH + 1])
    corners = (torch.rand(len(glyphs), 1, 2, generator=gen) * room).floor().long()
    return render(glyphs, corners)[:, :, 0]


def train_classifier(glyphs: torch.Tensor, labels: torch.Tensor, seed: int = 0, epochs: int = EPOCHS,
                     batch_size: int = 128, lr: float = 3e-3) -> FrameClassifier:
    """Deterministic training on CPU; the global RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FrameClassifier()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    glyphs, labels = glyphs.repeat(PLACEMENTS, 1, 1), labels.repeat(PLACEMENTS)
    steps_per_epoch = -(-len(glyphs) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps_per_epoch)
    model.train()
    for _ in range(epochs):
        frames = random_frames(glyphs, gen)
        perm = torch.randperm(len(glyphs), generator=gen)
        for i in range(0, len(glyphs), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(model(frames[idx]), labels[idx], label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def _fingerprint(glyphs: torch.Tensor, labels: torch.Tensor) -> str:
    h = hashlib.sha256(glyphs.float().contiguous().numpy().tobytes())
    h.update(labels.contiguous().numpy().tobytes())
    h.update(f"{HEIGHT}x{WIDTH}/{EPOCHS}x{PLACEMENTS}".encode())
    return h.hexdigest()


def load_or_train_frame_classifier(path: str | os.PathLike | None = None) -> FrameClassifier:
    """The cached classifier in `classifier.cache_dir(path)`, trained and written there first if missing/bad."""
    glyphs, labels = train_glyphs()
    return cached(cache_dir(path) / CACHE_NAME, _fingerprint(glyphs, labels), FrameClassifier,
                  lambda: train_classifier(glyphs, labels), "moving-digits frame classifier")
