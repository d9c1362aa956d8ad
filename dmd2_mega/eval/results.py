"""What a trainer's `evaluate()` reports of the samples it drew, the same for every trainer: the grid PNG, the
eval media's files and the data's quality metrics."""
from __future__ import annotations

import os
from typing import Optional

import torch

from dmd2_mega.eval.data_metrics import metrics_for_data
from dmd2_mega.eval.grid import save_grid, save_video_grid


def sample_results(images: torch.Tensor, cond: torch.Tensor, out_dir: Optional[str], step: str, iteration: int,
                   data: str, media=None) -> dict:
    """images [N, C, (T,) H, W] drawn for `cond` (labels [N] or embeddings) at `iteration` of the trainer's `step`
    ("iter", "cycle") -> {"grid": <out_dir>/samples/<step>_<iteration>.png (100 images, one row per class, or 16
    videos), "media": what `media` (an `EvalMedia`) wrote (its GIFs / PNGs go to TensorBoard), and the metrics of
    `--data data`}; no files without `out_dir`."""
    result = {}
    if out_dir:
        labels = cond if cond.dim() == 1 else None
        png = os.path.join(out_dir, "samples", f"{step}_{iteration:07d}.png")
        result["grid"] = (save_video_grid(images[:16], png) if images.dim() == 5 else
                          save_grid(images[:100], labels[:100] if labels is not None else None, png))
        written = media.write(images, out_dir, iteration) if media is not None else None
        if written is not None:
            result["media"] = written
    result.update(metrics_for_data(data, images, cond))
    return result
