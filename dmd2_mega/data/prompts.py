"""A fixed list of precomputed prompt embeddings: the validation prompts of `--eval-prompts FILE`.

One safetensors file (written by `launch/prepare_data.py --prompts-only`, or `write_prompts`):
    cond      [P, *cond_shape]  floating: one text embedding per prompt (e.g. UMT5 [512, 4096] for Wan)
    negative  [*cond_shape]     floating, optional: the negative prompt's embedding
    metadata  {"prompts": JSON list of the P prompt strings}
`read_prompts` checks it against the model's condition shape and raises `DataError` naming the file.
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


@dataclass
class Prompts:
    cond: torch.Tensor               # [P, *cond_shape] in the stored dtype
    texts: List[str]                 # P prompt strings
    negative: Optional[torch.Tensor]  # [*cond_shape] or None

    def names(self) -> List[str]:
        """File-name-safe, unique names: `<i>_<first words of the prompt>`."""
        return [f"{i:03d}_{slug(t)}" for i, t in enumerate(self.texts)]


def slug(text: str, max_len: int = 40) -> str:
    """A prompt as a file-name fragment: lower-case words joined by '-', at most max_len characters."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:max_len].rstrip("-") or "prompt"


def write_prompts(path: str, cond: torch.Tensor, texts: Sequence[str],
                  negative: Optional[torch.Tensor] = None) -> None:
    """Write P embeddings [P, *cond_shape] with their P prompt strings (atomically: a temp name, then rename)."""
    if cond.dim() < 2 or cond.shape[0] != len(texts) or not cond.is_floating_point():
        raise DataError(f"write_prompts {path}: need floating cond [P, ...] with P == len(texts); got "
                        f"{cond.dtype} {list(cond.shape)} and {len(texts)} prompts")
    tensors = {"cond": cond.contiguous()}
    if negative is not None:
        if tuple(negative.shape) != tuple(cond.shape[1:]):
            raise DataError(f"write_prompts {path}: negative must be {list(cond.shape[1:])}, got {list(negative.shape)}")
        tensors["negative"] = negative.contiguous()
    blob = save(tensors, metadata={"prompts": json.dumps(list(texts))})
    atomic_write(path, lambda f: f.write(blob))


def read_prompts(path: str, cond_shape: Optional[Sequence[int]] = None, flag: str = "--eval-prompts") -> Prompts:
    """The prompts file at `path`, checked against the model's condition shape when given."""
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
    return Prompts(cond, texts, negative)
