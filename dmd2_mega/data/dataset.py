"""`ImageDataset`: the in-memory (x, cond) interface every dataset of `dmd2_mega.data` exposes
(see the package docstring)."""
from typing import Optional, Tuple

import torch

from dmd2_mega.errors import DataError


class ImageDataset:
    """In-memory (x, cond) pairs with the shared interface described in the package docstring."""

    def __init__(self, x: torch.Tensor, cond: torch.Tensor, num_classes: Optional[int],
                 cond_shape: Optional[Tuple[int, ...]], source: str):
        if x.dim() not in (4, 5):
            raise DataError(f"{source}: expected images/latents [N, C, H, W] or video latents [N, C, T, H, W], "
                            f"got shape {tuple(x.shape)}")
        if (num_classes is None) == (cond_shape is None):
            raise DataError(f"{source}: exactly one of num_classes / cond_shape must be set")
        if cond.shape[0] != x.shape[0]:
            raise DataError(f"{source}: {x.shape[0]} latents but {cond.shape[0]} conditions")
        self.x = x.float().contiguous()
        self.cond = cond.long() if num_classes is not None else cond.float()
        self.num_classes = num_classes
        self.cond_shape = tuple(cond_shape) if cond_shape is not None else None
        self.channels = int(x.shape[1])
        self.spatial = tuple(int(n) for n in x.shape[2:])
        """(H, W) or (T, H, W)."""
        self.negative = None
        """The negative-prompt embedding [*cond_shape] CFG uses (text data that stores one), else None."""
        self.source = source

    @property
    def image_size(self):
        """The side of square 2-D samples, else None."""
        sp = self.spatial
        return sp[0] if len(sp) == 2 and sp[0] == sp[1] else None

    def __len__(self) -> int:
        return self.x.shape[0]

    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """indices: int64 [n] -> (x float32 [n, C, *spatial], cond int64 [n] or float32 [n, *cond_shape])."""
        return self.x[indices], self.cond[indices]

    def null_cond(self, n: int) -> torch.Tensor:
        """The null (unconditional) condition for n samples: class id num_classes, the negative-prompt
        embedding, or zeros."""
        if self.num_classes is not None:
            return torch.full((n,), self.num_classes, dtype=torch.int64)
        if self.negative is not None:
            return self.negative.float().expand(n, *self.cond_shape).clone()
        return torch.zeros((n, *self.cond_shape), dtype=torch.float32)

    def __repr__(self) -> str:
        cond = f"num_classes={self.num_classes}" if self.num_classes is not None else f"cond_shape={self.cond_shape}"
        return (f"{type(self).__name__}({self.source}, n={len(self)}, "
                f"latent={[self.channels, *self.spatial]}, {cond})")
