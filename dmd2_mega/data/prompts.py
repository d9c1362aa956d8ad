"""A fixed list of precomputed prompt embeddings: the validation prompts of `--eval-prompts FILE`.

One safetensors file (written by `launch/prepare_data.py --prompts-only`, or `write_prompts`):
    cond      [P, *cond_shape]  floating: one text embedding per prompt (e.g. UMT5 [512, 4096] for Wan), or
                                [P, N]: a condition of parts flattened (an image-to-video Wan's text, CLIP embedding
                                and image latent: `models/wan/image.py`, written with --prompts-only --images)
    negative  [*cond_shape]     floating, optional: the negative prompt's embedding (with parts: the text part's
                                [L, D]; CFG's negative keeps each sample's image)
    metadata  {"prompts": JSON list of the P prompt strings,
               "cond_parts": JSON [[name, [sizes...]], ...] when cond has parts (as index.json's "cond_parts"),
               "images": JSON list of the P image paths, optional (as the --images file wrote them)}
`read_prompts` checks it against the model's condition shape (and parts) and raises `DataError` naming the file.
"""
import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.errors import DataError
from .dataset import check_parts, parts_record, text_shape


@dataclass
class Prompts:
    cond: torch.Tensor               # [P, *cond_shape] in the stored dtype
    texts: List[str]                 # P prompt strings
    negative: Optional[torch.Tensor]  # [*cond_shape] (with cond_parts: the text part's [L, D]) or None
    cond_parts: Optional[tuple] = None   # ((name, shape), ...) of a flat cond [P, N], else None
    images: Optional[List[str]] = None   # the P image paths of image-to-video conditions, when recorded

    def names(self) -> List[str]:
        """File-name-safe, unique names: `<i>_<first words of the prompt>`."""
        return [f"{i:03d}_{slug(t)}" for i, t in enumerate(self.texts)]


def slug(text: str, max_len: int = 40) -> str:
    """A prompt as a file-name fragment: lower-case words joined by '-', at most max_len characters."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:max_len].rstrip("-") or "prompt"


def write_prompts(path: str, cond: torch.Tensor, texts: Sequence[str], negative: Optional[torch.Tensor] = None,
                  cond_parts: Optional[Sequence] = None, images: Optional[Sequence[str]] = None) -> None:
    """Write P embeddings [P, *cond_shape] with their P prompt strings (atomically: a temp name, then rename);
    `cond_parts` when cond [P, N] is a condition of parts (the negative is then the text part's), `images` the P
    image paths to record."""
    if cond.dim() < 2 or cond.shape[0] != len(texts) or not cond.is_floating_point():
        raise DataError(f"write_prompts {path}: need floating cond [P, ...] with P == len(texts); got "
                        f"{cond.dtype} {list(cond.shape)} and {len(texts)} prompts")
    parts = check_parts(cond_parts, tuple(cond.shape[1:]), f"write_prompts {path}") if cond_parts else None
    meta = {"prompts": json.dumps(list(texts))}
    if parts:
        meta["cond_parts"] = json.dumps(parts_record(parts))
    if images is not None:
        if len(images) != len(texts) or not all(isinstance(i, str) for i in images):
            raise DataError(f"write_prompts {path}: images must be {len(texts)} paths, got {list(images)!r}")
        meta["images"] = json.dumps(list(images))
    tensors = {"cond": cond.contiguous()}
    if negative is not None:
        want = text_shape(parts, cond.shape[1:])
        if tuple(negative.shape) != tuple(want):
            raise DataError(f"write_prompts {path}: negative must be {list(want)}, got {list(negative.shape)}")
        tensors["negative"] = negative.contiguous()
    blob = save(tensors, metadata=meta)
    atomic_write(path, lambda f: f.write(blob))


def read_prompts(path: str, cond_shape: Optional[Sequence[int]] = None, flag: str = "--eval-prompts",
                 cond_parts: Optional[Sequence] = None) -> Prompts:
    """The prompts file at `path`, checked against the model's condition shape and parts when given; its
    negative against the text part (or cond's shape)."""
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file (write one with launch/prepare_data.py --prompts-only)")
    try:
        with safe_open(path, framework="pt") as f:
            keys, meta = set(f.keys()), f.metadata() or {}
            if "cond" not in keys:
                raise DataError(f"{flag} {path}: expected tensor 'cond' [P, L, D], found keys {sorted(keys)}")
            cond = f.get_tensor("cond")
            negative = f.get_tensor("negative") if "negative" in keys else None
    except DataError:
        raise
    except Exception as e:  # safetensors' own errors for a corrupt header
        raise DataError(f"{flag} {path}: cannot read as safetensors ({e})") from e
    try:
        texts = json.loads(meta.get("prompts", "null"))
    except json.JSONDecodeError:
        texts = None
    if not (isinstance(texts, list) and len(texts) == cond.shape[0] and all(isinstance(t, str) for t in texts)):
        raise DataError(f"{flag} {path}: metadata 'prompts' must be a JSON list of {cond.shape[0]} strings")
    if not cond.is_floating_point() or not torch.isfinite(cond).all():
        raise DataError(f"{flag} {path}: 'cond' must be finite floating embeddings, got {cond.dtype}")
    if cond_shape is not None and tuple(cond.shape[1:]) != tuple(cond_shape):
        raise DataError(f"{flag} {path}: embeddings are {list(cond.shape[1:])} per prompt, but the model takes "
                        f"{list(cond_shape)}")
    parts = _json_meta(meta, "cond_parts", flag, path)
    parts = check_parts(parts, tuple(cond.shape[1:]), f"{flag} {path}") if parts is not None else None
    if cond_parts is not None:
        have, takes = ([[str(n), [int(k) for k in s]] for n, s in p] if p else None for p in (parts, cond_parts))
        if have != takes:
            raise DataError(f"{flag} {path}: the conditions' parts are {have}, but the model takes {takes} (write "
                            f"it with prepare_data.py --prompts-only --images, the model's pipeline and sizes)")
    want = text_shape(parts, cond.shape[1:])
    if negative is not None and tuple(negative.shape) != tuple(want):
        raise DataError(f"{flag} {path}: 'negative' is {list(negative.shape)}, expected {list(want)} (the "
                        f"{'text part' if parts else 'embedding'} of a condition)")
    images = _json_meta(meta, "images", flag, path)
    if images is not None and not (isinstance(images, list) and len(images) == len(texts)
                                   and all(isinstance(i, str) for i in images)):
        raise DataError(f"{flag} {path}: metadata 'images' must be a JSON list of {len(texts)} paths")
    return Prompts(cond, texts, negative, parts, images)


def _json_meta(meta: dict, key: str, flag: str, path: str):
    """metadata[key] parsed as JSON, or None when absent."""
    if key not in meta:
        return None
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError as e:
        raise DataError(f"{flag} {path}: metadata '{key}' is not JSON ({e})") from None
