"""Datasets behind `--data`: the embedded 8x8 digits or a directory of safetensors shards.

Every dataset is held in memory as
    x    float32 [N, C, H, W]  (H == W == image_size; pixels in [-1, 1] or precomputed latents)
    cond int64 [N] labels in [0, num_classes)          (class-conditional), or
         float32 [N, *cond_shape] embeddings           (text-conditional)
and exposes one interface (`ImageDataset`): `len(ds)`, `ds.get_batch(indices) -> (x, cond)`,
`channels`, `image_size`, `num_classes` (int, or None for embeddings), `cond_shape` (tuple, or None
for labels) and `null_cond(n)`: the null condition for CFG, i.e. labels full of `num_classes`
(the null class id) or all-zero embeddings.

`build_dataset("digits", split)` -> `DigitsDataset`; `build_dataset(path)` -> `ShardDataset`.
Which indices each rank reads per iteration is `GlobalBatchSampler`'s job (sampler.py).
"""
import os
from typing import Optional, Tuple

import torch

from dmd2_mega.errors import DataError


class ImageDataset:
    """In-memory (x, cond) pairs with the shared interface described in the package docstring."""

    def __init__(self, x: torch.Tensor, cond: torch.Tensor, num_classes: Optional[int],
                 cond_shape: Optional[Tuple[int, ...]], source: str):
        if x.dim() != 4:
            raise DataError(f"{source}: expected images/latents [N, C, H, W], got shape {tuple(x.shape)}")
        if x.shape[2] != x.shape[3]:
            raise DataError(f"{source}: expected square latents (H == W), got H={x.shape[2]}, W={x.shape[3]}")
        if (num_classes is None) == (cond_shape is None):
            raise DataError(f"{source}: exactly one of num_classes / cond_shape must be set")
        if cond.shape[0] != x.shape[0]:
            raise DataError(f"{source}: {x.shape[0]} latents but {cond.shape[0]} conditions")
        self.x = x.float().contiguous()
        self.cond = cond.long() if num_classes is not None else cond.float()
        self.num_classes = num_classes
        self.cond_shape = tuple(cond_shape) if cond_shape is not None else None
        self.channels = int(x.shape[1])
        self.image_size = int(x.shape[2])
        self.source = source

    def __len__(self) -> int:
        return self.x.shape[0]

    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """indices: int64 [n] -> (x float32 [n, C, H, W], cond int64 [n] or float32 [n, *cond_shape])."""
        return self.x[indices], self.cond[indices]

    def null_cond(self, n: int) -> torch.Tensor:
        """The null (unconditional) condition for n samples: class id num_classes, or zeros."""
        if self.num_classes is not None:
            return torch.full((n,), self.num_classes, dtype=torch.int64)
        return torch.zeros((n, *self.cond_shape), dtype=torch.float32)

    def __repr__(self) -> str:
        cond = f"num_classes={self.num_classes}" if self.num_classes is not None else f"cond_shape={self.cond_shape}"
        return (f"{type(self).__name__}({self.source}, n={len(self)}, "
                f"latent=[{self.channels},{self.image_size},{self.image_size}], {cond})")


from .digits import DigitsDataset  # noqa: E402  (needs DataError / ImageDataset above)
from .sampler import GlobalBatchSampler  # noqa: E402
from .shards import ShardDataset, write_shards  # noqa: E402


def build_dataset(spec: str, split: str = "train") -> ImageDataset:
    """`--data` value -> dataset. 'digits' -> DigitsDataset(split); a directory -> ShardDataset."""
    if split not in ("train", "heldout"):
        raise DataError(f"split must be 'train' or 'heldout', got {split!r}")
    if spec == "digits":
        return DigitsDataset(split)
    if not spec or not os.path.isdir(spec):
        raise DataError(f"--data must be 'digits' or a directory of safetensors shards with index.json; "
                        f"got {spec!r}, which is not an existing directory")
    if split != "train":
        raise DataError(f"--data {spec}: shard datasets define only split='train'; there is no "
                        f"held-out split (got split={split!r})")
    return ShardDataset(spec)


__all__ = ["DataError", "ImageDataset", "DigitsDataset", "ShardDataset", "write_shards",
           "GlobalBatchSampler", "build_dataset"]
