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
Modules: `dataset` (ImageDataset), `digits`, `shards` (ShardDataset, write_shards), `sampler`.
"""
import os

from dmd2_mega.errors import DataError

from .dataset import ImageDataset
from .digits import DigitsDataset
from .sampler import GlobalBatchSampler
from .shards import ShardDataset, write_shards


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


__all__ = ["ImageDataset", "DigitsDataset", "ShardDataset", "write_shards",
           "GlobalBatchSampler", "build_dataset"]
