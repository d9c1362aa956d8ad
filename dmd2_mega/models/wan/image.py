"""The Wan family's image-to-video forms: what the image adds to a sample's condition and how the model reads it.

Forms (`model.image_form`, from the transformer's config.json and the data):
    "concat"       Wan 2.1 I2V, Wan 2.2 I2V A14B: in_channels = 2 C + M for C latent channels. The model reads
                   [x, mask, y] on channels (WanImageToVideoPipeline's order): y [C, T, H, W] the VAE latent of the
                   image followed by zero frames, mask [M, T, H, W] one on the first latent frame (M = the VAE's
                   temporal factor, 4: the first pixel frame repeated over the first latent frame's M frames).
                   Wan 2.1 also reads the CLIP image embedding [Li, image_dim] through `ImageEmbedder` as extra
                   keys / values of cross-attention (add_k_proj, add_v_proj, norm_added_k), whose output adds to the
                   text's before to_out.
    "first-frame"  Wan 2.2 TI2V-5B's image mode (the pipeline's expand_timesteps): x's first latent frame is replaced
                   by the image's latent [C, 1, H, W] and that frame's tokens get timestep 0.

A sample's condition is ONE flat tensor, cond [B, N] (`CondParts`: the text [L, text_dim], then the CLIP embedding,
then the image latent), so every generic path (the loader, the samplers, CFG's batch of two, the DP gathers) carries
one tensor as for text; only the family unpacks it. CFG's negative keeps the image and swaps the text for the
negative prompt (`CondParts.with_text`: Wan's I2V convention, WanImageToVideoPipeline's negative branch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dmd2_mega.errors import ConfigError

CLIP_LEN = 257
"""Tokens of a CLIP ViT-H/14 image embedding at 224 px (256 patches and the class token): Wan 2.1 I2V's image
encoder, the length a converted model is built with when no data gives one."""

MASK_CHANNELS = 4
"""The concat form's mask channels: the Wan VAE's temporal compression (4 pixel frames per latent frame)."""


@dataclass(frozen=True)
class CondParts:
    """The layout of a flat I2V condition: text [L, text_dim], clip [Li, image_dim] or None, image [C, T', H, W]."""

    text: tuple
    clip: Optional[tuple]
    image: tuple

    @classmethod
    def from_parts(cls, parts: tuple, where: str) -> "CondParts":
        """From `DataShape.cond_parts` (("text", shape), ("clip", shape)?, ("image", shape)), as data_info stores
        them; a ConfigError naming `where` for any other layout."""
        named = {name: tuple(int(n) for n in shape) for name, shape in parts}
        if list(named) not in (["text", "image"], ["text", "clip", "image"]) or len(named) != len(parts):
            raise ConfigError(f"{where}: the condition parts are {[n for n, _ in parts]}; an image-to-video Wan reads "
                              f"['text', 'clip', 'image'] or ['text', 'image']")
        if len(named["text"]) != 2 or len(named["image"]) != 4 or len(named.get("clip", (0, 0))) != 2:
            raise ConfigError(f"{where}: condition parts {dict(named)}; expected text [L, D], clip [L, D] and image "
                              f"[C, T, H, W]")
        return cls(named["text"], named.get("clip"), named["image"])

    def _sizes(self, image: tuple) -> list:
        """The parts' element counts; the image's 0 while its frame count is None (`unpack` reads it off cond)."""
        return [math.prod(s) for s in (self.text, self.clip) if s is not None] + [0 if None in image
                                                                                   else math.prod(image)]

    def unpack(self, cond: torch.Tensor, image: tuple) -> tuple:
        """(text [B, L, D], clip [B, Li, Di] or None, image [B, *image]) views of cond [B, N]; `image`: the image
        latent's shape for the latents at hand (a model reads any frame count and size, as for text); a frame count
        of None is read off cond's size (a clip's whole image latent, which a streamed chunk slices)."""
        if image[1] is None and cond.dim() == 2:
            per_frame = image[0] * math.prod(image[2:])
            image = (image[0], max(1, (cond.shape[1] - sum(self._sizes(image)[:-1])) // per_frame), *image[2:])
        sizes = self._sizes(image)
        if cond.dim() != 2 or cond.shape[1] != sum(sizes):
            raise ValueError(f"an image-to-video Wan takes cond [B, {sum(sizes)}] (text {list(self.text)}, "
                             f"clip {list(self.clip) if self.clip else None}, image {list(image)}); "
                             f"got {tuple(cond.shape)}")
        b, pieces = cond.shape[0], iter(cond.split(sizes, dim=1))
        text = next(pieces).view(b, *self.text)
        clip = next(pieces).view(b, *self.clip) if self.clip is not None else None
        return text, clip, next(pieces).view(b, *image)

    def with_text(self, cond: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """cond with its text replaced by `text` [L, D] (broadcast) or [B, L, D]: CFG's negative of an I2V sample."""
        n = math.prod(self.text)
        return torch.cat([text.to(cond).reshape(-1, n).expand(cond.shape[0], n), cond[:, n:]], dim=1)


def concat_mask(image: torch.Tensor, mask_channels: int, first_frame: int = 0) -> torch.Tensor:
    """The concat form's mask [B, M, T', H, W] of an image latent [B, C, T', H, W]: 1 on the clip's first latent
    frame (frame 0 of `image` when it starts the clip, first_frame 0; none in a later streamed chunk)."""
    b, _, t, h, w = image.shape
    mask = image.new_zeros(b, mask_channels, t, h, w)
    if first_frame == 0:
        mask[:, :, 0] = 1
    return mask


def chunk_frames(image: torch.Tensor, first: int, frames: int) -> torch.Tensor:
    """Frames [first, first + frames) of a clip's image latent [B, C, T', H, W]; past its end the last frame repeats
    (the latent of the zero frames that follow the image), so a causal student streams past its training length."""
    index = torch.arange(first, first + frames, device=image.device).clamp_(max=image.shape[2] - 1)
    return image if first == 0 and frames == image.shape[2] else image.index_select(2, index)


class ImageEmbedder(nn.Module):
    """CLIP image embeddings [B, Li, image_dim] -> [B, Li, D]: fp32 LayerNorm, linear, GELU, linear, fp32 LayerNorm
    (diffusers' WanImageEmbedding; replicated over TP: it runs once per sample on 257 tokens)."""

    def __init__(self, image_dim: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)  # eps 1e-5, as diffusers' FP32LayerNorm default
        self.ff = nn.Sequential(nn.Linear(image_dim, image_dim), nn.GELU(), nn.Linear(image_dim, hidden))
        self.norm2 = nn.LayerNorm(hidden)
        for lin in self.ff[::2]:
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        x = clip.to(self.ff[0].weight.dtype)
        return fp32_layer_norm(self.norm2, self.ff(fp32_layer_norm(self.norm1, x)))


def fp32_layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` (affine) of x computed in fp32, cast back to x's dtype (diffusers' FP32LayerNorm)."""
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(),
                        norm.eps).to(x.dtype)
