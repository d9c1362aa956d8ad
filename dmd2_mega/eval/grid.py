"""Sample grids as PNG.

images [N, C, H, W] in [-1, 1] -> uint8 pixels round((x + 1) * 127.5), clipped to [0, 255]
(NaN -> 0); C == 1 grey, C == 3 RGB, any other C: the first channel as grey. Each image is
upscaled by `upscale` (nearest neighbour).

With labels [N]: one row per class 0..num_classes-1 (num_classes defaults to max label + 1),
the samples of class c in their input order along row c, columns = the largest class count;
empty cells stay black. Without labels: a near-square grid, ceil(sqrt(N)) columns, row-major.
The PNG is (rows * H * upscale) high and (cols * W * upscale) wide, written to a temporary
file in the target directory and renamed, so a reader never sees a half-written image.
`save_video_grid` lays videos [N, C, T, H, W] out one per row, frames along the row; `save_video_gif` writes
them as one looping GIF whose frame t is the near-square (or `cols`-wide) grid of every video's frame t.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.errors import EvalInputError


def _to_numpy(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _layout(n: int, labels, num_classes):
    """[(row, col)] cell of each image, and (rows, cols)."""
    if labels is None:
        cols = max(1, math.ceil(math.sqrt(n)))
        return [(i // cols, i % cols) for i in range(n)], (max(1, -(-n // cols)), cols)
    y = _to_numpy(labels)
    if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
        raise EvalInputError(f"save_grid: labels must be integers of shape [{n}], got {y.dtype} {y.shape}")
    rows = int(num_classes) if num_classes is not None else (int(y.max()) + 1 if n else 1)
    if n and (y.min() < 0 or y.max() >= rows):
        raise EvalInputError(f"save_grid: labels must lie in [0, {rows}) (num_classes={num_classes}), "
                             f"got min {int(y.min())}, max {int(y.max())}")
    counts = [0] * rows
    cells = []
    for c in y.tolist():
        cells.append((c, counts[c]))
        counts[c] += 1
    return cells, (rows, max(1, max(counts, default=0)))


def save_grid(images, labels, path, num_classes: int | None = None, upscale: int = 4) -> str:
    """Write images [N, C, H, W] in [-1, 1] as a PNG grid at `path`; returns the path."""
    x = _to_numpy(images).astype(np.float32)
    if x.ndim != 4:
        raise EvalInputError(f"save_grid: images must be [N, C, H, W], got shape {x.shape}")
    if int(upscale) < 1:
        raise EvalInputError(f"save_grid: upscale must be >= 1, got {upscale}")
    n, c, h, w = x.shape
    x = x[:, :3] if c == 3 else x[:, :1]
    pix = np.clip(np.round((np.nan_to_num(x, nan=-1.0) + 1.0) * 127.5), 0, 255).astype(np.uint8)
    pix = pix.transpose(0, 2, 3, 1)  # [N, H, W, C']
    cells, (rows, cols) = _layout(n, labels, num_classes)
    canvas = np.zeros((rows * h, cols * w, pix.shape[3]), dtype=np.uint8)
    for img, (r, col) in zip(pix, cells):
        canvas[r * h:(r + 1) * h, col * w:(col + 1) * w] = img
    u = int(upscale)
    canvas = canvas.repeat(u, axis=0).repeat(u, axis=1)
    im = Image.fromarray(canvas[..., 0] if canvas.shape[2] == 1 else canvas)

    path = os.fspath(path)
    atomic_write(path, lambda f: im.save(f, format="PNG"))
    return path


def save_video_grid(videos, path, upscale: int = 4) -> str:
    """Write videos [N, C, T, H, W] in [-1, 1] as a PNG: one row per video, its T frames left to right (channel
    rules as `save_grid`; for latents, a look at channel 0 until they are decoded with a VAE)."""
    v = torch.as_tensor(_to_numpy(videos))
    if v.dim() != 5:
        raise EvalInputError(f"save_video_grid: videos must be [N, C, T, H, W], got shape {tuple(v.shape)}")
    n, c, t, h, w = v.shape
    frames = v.transpose(1, 2).reshape(n * t, c, h, w)
    return save_grid(frames, torch.arange(n).repeat_interleave(t), path, num_classes=n, upscale=upscale)


def save_video_gif(videos, path, cols: int | None = None, upscale: int = 4, fps: float = 4.0) -> str:
    """Write videos [N, C, T, H, W] in [-1, 1] as a looping GIF at `path`: frame t is the grid of frame t of every
    video, `cols` videos per row (default ceil(sqrt(N))), row-major, empty cells black (pixel and channel rules as
    `save_grid`); returns the path."""
    v = _to_numpy(videos).astype(np.float32)
    if v.ndim != 5 or v.shape[0] < 1:
        raise EvalInputError(f"save_video_gif: videos must be [N, C, T, H, W] with N >= 1, got shape {v.shape}")
    if int(upscale) < 1 or (cols is not None and int(cols) < 1) or not fps > 0:
        raise EvalInputError(f"save_video_gif: upscale and cols must be >= 1 and fps > 0, got upscale={upscale}, "
                             f"cols={cols}, fps={fps}")
    n, c, t, h, w = v.shape
    v = v[:, :3] if c == 3 else v[:, :1]
    pix = np.clip(np.round((np.nan_to_num(v, nan=-1.0) + 1.0) * 127.5), 0, 255).astype(np.uint8)
    cols = int(cols) if cols is not None else max(1, math.ceil(math.sqrt(n)))
    rows = -(-n // cols)
    cells = np.zeros((rows * cols, *pix.shape[1:]), dtype=np.uint8)  # [R * K, C', T, H, W]
    cells[:n] = pix
    grid = cells.reshape(rows, cols, -1, t, h, w).transpose(3, 0, 4, 1, 5, 2).reshape(t, rows * h, cols * w, -1)
    u = int(upscale)
    grid = grid.repeat(u, axis=1).repeat(u, axis=2)
    frames = [Image.fromarray(f[..., 0] if f.shape[2] == 1 else f) for f in grid]
    path = os.fspath(path)
    atomic_write(path, lambda f: frames[0].save(f, format="GIF", save_all=True, append_images=frames[1:],
                                                duration=round(1000 / fps), loop=0))
    return path
