"""Datasets behind `--data`: the embedded 8x8 digits, the embedded moving-digits clips, or a directory of
safetensors shards.

Every dataset yields
    x    [N, C, H, W] or video [N, C, T, H, W]  (pixels in [-1, 1] or precomputed latents)
    cond int64 [N] labels in [0, num_classes)          (class-conditional), or
         [N, *cond_shape] embeddings                   (text-conditional)
through one interface (`LatentDataset`): `len(ds)`, `ds.get_batch(indices) -> (x, cond)`, `channels`,
`spatial`, `image_size`, `num_classes` (int, or None for embeddings), `cond_shape` (tuple, or None for
labels), `cond_parts` (a condition of parts flat in cond, e.g. an I2V Wan's text, CLIP and image latent, else
None), `negative` and `null_cond(n)`: the null condition for CFG, i.e. labels full of `num_classes` (the
null class id), the negative-prompt embedding or all-zero embeddings. In-memory sets (`ImageDataset`) are
float32; shard sets stream in their stored dtype (`loader.MicroBatchLoader` casts on the device).

`build_dataset("digits", split)` -> `DigitsDataset`; `build_dataset("moving-digits", split)` ->
`MovingDigitsDataset` (video clips x [N, 1, 4, 16, 16], prompt embeddings cond [N, 4, 16] of
(digit, direction), negative = the empty prompt's embedding), `build_dataset("moving-digits:T", split)` the
same clips T frames long (wrapping round the canvas; `moving_digits.parse_spec` parses the name);
`build_dataset("moving-digits-i2v[:T]", split)` -> `MovingDigitsI2VDataset` (the same clips, each condition the
prompt embedding and the clip's first frame followed by zero frames, flat, with cond_parts: image-to-video);
`build_dataset(path)` -> `ShardDataset`.
Which indices each rank reads per iteration is `GlobalBatchSampler`'s job (sampler.py).
Modules: `dataset` (LatentDataset, ImageDataset), `digits`, `moving_digits`, `moving_digits_i2v`, `shards`
(ShardDataset, load_shards), `shard_index` (the format's checks), `safetensors_rows` (header + row reads),
`shard_writer` (write_shards), `sampler` (GlobalBatchSampler), `loader` (MicroBatchLoader: DataLoader workers in the
sampler's order), `prompts` (the --eval-prompts file).
"""
import os

from dmd2_mega.errors import DataError

from .dataset import ImageDataset, LatentDataset
from .digits import DigitsDataset
from .moving_digits import I2V_SPEC, MovingDigitsDataset, parse_spec
from .moving_digits_i2v import MovingDigitsI2VDataset
from .sampler import GlobalBatchSampler
from .shard_writer import write_shards
from .shards import ShardDataset, load_shards


def build_dataset(spec: str, split: str = "train") -> LatentDataset:
    """`--data` value -> dataset. 'digits' -> DigitsDataset(split); 'moving-digits' -> MovingDigitsDataset(split)
    (4 frames), 'moving-digits:T' -> MovingDigitsDataset(split, T); 'moving-digits-i2v[:T]' ->
    MovingDigitsI2VDataset(split, T); a directory -> ShardDataset."""
    if split not in ("train", "heldout"):
        raise DataError(f"split must be 'train' or 'heldout', got {split!r}")
    if spec == "digits":
        return DigitsDataset(split)
    moving = parse_spec(spec)
    if moving is not None:
        base, frames = moving
        return (MovingDigitsI2VDataset if base == I2V_SPEC else MovingDigitsDataset)(split, frames)
    if not spec or not os.path.isdir(spec):
        raise DataError(f"--data must be 'digits', 'moving-digits', 'moving-digits:T' (T frames per clip), "
                        f"'moving-digits-i2v[:T]' or a directory of safetensors shards with index.json; got {spec!r}, "
                        f"which is not an existing directory")
    if split != "train":
        raise DataError(f"--data {spec}: shard datasets define only split='train'; there is no "
                        f"held-out split (got split={split!r})")
    return ShardDataset(spec)


__all__ = ["LatentDataset", "ImageDataset", "DigitsDataset", "MovingDigitsDataset", "MovingDigitsI2VDataset",
           "ShardDataset", "load_shards", "write_shards", "GlobalBatchSampler", "build_dataset"]
