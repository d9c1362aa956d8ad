"""`write_shards`: tensors in memory -> the shard format of `shards.py` (tests, small tools; a real set is
written by `launch/prepare_data.py`)."""
import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from dmd2_mega.files.atomic import atomic_path, atomic_write
from dmd2_mega.errors import DataError
from .dataset import check_parts, parts_record, text_shape
from .shard_index import INDEX, NEGATIVE


def write_shards(path: str, latents: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 cond: Optional[torch.Tensor] = None, num_classes: Optional[int] = None,
                 shard_size: int = 4096, negative: Optional[torch.Tensor] = None,
                 cond_parts: Optional[tuple] = None) -> dict:
    """Write latents [N, C, H, W] with labels [N] (num_classes defaults to max + 1) or
    cond [N, *cond_shape] as `shard_size`-sample shards + index.json under `path`; returns the index.
    cond_parts: cond [N, n] is a condition of parts flattened ((name, shape), ...: an image-to-video Wan's text,
    CLIP embedding and image latent); the negative is then the text part's.
    Every file is written atomically (`files/atomic.py`) and index.json last, so a crash never leaves a readable
    partial set."""
    if (labels is None) == (cond is None):
        raise DataError("write_shards: pass exactly one of labels= or cond=")
    if latents.dim() not in (4, 5):
        raise DataError(f"write_shards: latents must be [N, C, H, W] or [N, C, T, H, W], got shape "
                        f"{tuple(latents.shape)}")
    c = labels if labels is not None else cond
    n = latents.shape[0]
    if c.shape[0] != n or n == 0 or shard_size < 1:
        raise DataError(f"write_shards: need N >= 1 latents with N conditions and shard_size >= 1; got "
                        f"{n} latents, {c.shape[0]} conditions, shard_size {shard_size}")
    parts = check_parts(cond_parts, tuple(c.shape[1:]), "write_shards") if cond_parts is not None else None
    index = {"shards": [], "latent_shape": list(latents.shape[1:])}
    if labels is not None:
        index.update(cond="labels", num_classes=int(num_classes if num_classes is not None
                                                    else int(labels.max()) + 1))
    else:
        index.update(cond="embedding", cond_shape=list(cond.shape[1:]))
        if parts is not None:
            index["cond_parts"] = parts_record(parts)
    os.makedirs(path, exist_ok=True)
    key = "labels" if labels is not None else "cond"
    for i, start in enumerate(range(0, n, shard_size)):
        name = f"shard_{i:05d}.safetensors"
        sl = slice(start, start + shard_size)
        with atomic_path(os.path.join(path, name)) as tmp:
            save_file({"latents": latents[sl].contiguous(), key: c[sl].contiguous()}, tmp)
        index["shards"].append({"file": name, "num_samples": int(latents[sl].shape[0])})
    if negative is not None:
        text = text_shape(parts, c.shape[1:])
        if cond is None or tuple(negative.shape) != tuple(text):
            raise DataError(f"write_shards: negative must be one embedding {list(text)} of text data, got "
                            f"{list(negative.shape)}")
        with atomic_path(os.path.join(path, NEGATIVE)) as tmp:
            save_file({"cond": negative.contiguous()}, tmp)
    atomic_write(os.path.join(path, INDEX), lambda f: json.dump(index, f, indent=1), text=True)
    return index
