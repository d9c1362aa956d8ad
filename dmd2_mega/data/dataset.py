"""`LatentDataset`: the (x, cond) interface every dataset of `dmd2_mega.data` exposes (see the package
docstring), and `ImageDataset`, the in-memory one."""
import math
from abc import ABC, abstractmethod
from typing import Optional, Sequence, Tuple

import torch

from dmd2_mega.errors import DataError


class LatentDataset(ABC):
    """The shared interface: `len`, `get_batch`, shapes, the null condition. Subclasses set the shape
    attributes with `_set_shapes` and implement `__len__` / `get_batch` (abstract: the base is not a dataset)."""

    def _set_shapes(self, channels: int, spatial: Sequence[int], num_classes: Optional[int],
                    cond_shape: Optional[Sequence[int]], source: str, cond_parts: Optional[Sequence] = None) -> None:
        if (num_classes is None) == (cond_shape is None):
            raise DataError(f"{source}: exactly one of num_classes / cond_shape must be set")
        self.channels = int(channels)
        self.spatial = tuple(int(n) for n in spatial)
        """(H, W) or (T, H, W)."""
        self.num_classes = num_classes
        self.cond_shape = tuple(cond_shape) if cond_shape is not None else None
        self.cond_parts = check_parts(cond_parts, self.cond_shape, source) if cond_parts else None
        """A condition of parts, flat in cond ((name, shape), ...: an image-to-video Wan's text, CLIP embedding and
        image latent; `models.DataShape.cond_parts`), else None."""
        self.negative = None
        """The negative-prompt embedding CFG uses (text data that stores one; the text part's shape when the
        condition has parts), else None."""
        self.source = source
        self.null_note = (f"the learned null class (id {num_classes})" if num_classes is not None else
                          f"the zero embedding ({source} stores no negative prompt)")
        """Which null condition CFG uses and where it came from, in words (the trainers' start-up line)."""

    def set_negative(self, emb: torch.Tensor, where: str) -> None:
        """Text data's negative-prompt embedding [*cond_shape], read from `where` (named in `null_note`)."""
        self.negative = emb
        self.null_note = f"the negative prompt of {where}"

    @property
    def image_size(self):
        """The side of square 2-D samples, else None."""
        sp = self.spatial
        return sp[0] if len(sp) == 2 and sp[0] == sp[1] else None

    @abstractmethod
    def __len__(self) -> int:
        """The number of samples."""

    @abstractmethod
    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x [n, C, *spatial], cond [n] int64 or [n, *cond_shape]) for the int64 `indices` [n]."""

    @property
    def negative_shape(self) -> Optional[tuple]:
        """The negative prompt's shape: the text part of a condition of parts, else cond_shape."""
        return text_shape(self.cond_parts, self.cond_shape)

    def null_cond(self, n: int) -> torch.Tensor:
        """The null (unconditional) condition for n samples: class id num_classes, the negative-prompt
        embedding, or zeros."""
        if self.cond_parts:
            raise DataError(f"{self.source}: the negative of a condition of parts keeps each sample's image; it is "
                            f"the model's (FamilyModel.negative_for), not one for all samples")
        if self.num_classes is not None:
            return torch.full((n,), self.num_classes, dtype=torch.int64)
        if self.negative is not None:
            return self.negative.float().expand(n, *self.cond_shape).clone()
        return torch.zeros((n, *self.cond_shape), dtype=torch.float32)

    def __repr__(self) -> str:
        cond = f"num_classes={self.num_classes}" if self.num_classes is not None else f"cond_shape={self.cond_shape}"
        return (f"{type(self).__name__}({self.source}, n={len(self)}, "
                f"latent={[self.channels, *self.spatial]}, {cond})")


class ImageDataset(LatentDataset):
    """In-memory (x, cond) pairs: x float32, cond int64 labels or float32 embeddings."""

    def __init__(self, x: torch.Tensor, cond: torch.Tensor, num_classes: Optional[int],
                 cond_shape: Optional[Tuple[int, ...]], source: str, cond_parts: Optional[Sequence] = None):
        if x.dim() not in (4, 5):
            raise DataError(f"{source}: expected images/latents [N, C, H, W] or video latents [N, C, T, H, W], "
                            f"got shape {tuple(x.shape)}")
        if cond.shape[0] != x.shape[0]:
            raise DataError(f"{source}: {x.shape[0]} latents but {cond.shape[0]} conditions")
        self._set_shapes(x.shape[1], x.shape[2:], num_classes, cond_shape, source, cond_parts)
        self.x = x.float().contiguous()
        self.cond = cond.long() if num_classes is not None else cond.float()

    def __len__(self) -> int:
        return self.x.shape[0]

    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """indices: int64 [n] -> (x float32 [n, C, *spatial], cond int64 [n] or float32 [n, *cond_shape])."""
        return self.x[indices], self.cond[indices]


def check_parts(parts: Sequence, cond_shape: Optional[tuple], source: str) -> tuple:
    """`parts` as ((name, shape), ...) after checking that it names a text part and flattens to cond_shape [N]."""
    try:
        out = tuple((str(name), tuple(int(n) for n in shape)) for name, shape in parts)
    except (TypeError, ValueError):
        raise DataError(f"{source}: 'cond_parts' must be [[name, [sizes...]], ...], found {parts!r}") from None
    size = sum(math.prod(shape) for _, shape in out)
    if "text" not in dict(out) or cond_shape is None or tuple(cond_shape) != (size,):
        raise DataError(f"{source}: 'cond_parts' {parts_record(out)} (a 'text' part and others, "
                        f"{size} values flat) do not describe cond_shape {list(cond_shape or [])}")
    return out


def parts_record(parts: Sequence) -> list:
    """((name, shape), ...) as stored: [[name, [sizes...]], ...] (index.json's, data_info's and an eval-prompts
    file's "cond_parts")."""
    return [[name, list(shape)] for name, shape in parts]


def text_shape(parts: Optional[Sequence], cond_shape) -> tuple:
    """The shape of a negative prompt: the text part of a condition of parts, else the condition's own shape."""
    return tuple(dict(parts)["text"] if parts else cond_shape)
