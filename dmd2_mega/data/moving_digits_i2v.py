"""Moving digits as image-to-video: `--data moving-digits-i2v[:T]`, each clip conditioned on its prompt and first frame.

The clips are those of `--data moving-digits[:T]` (`moving_digits.py`), bit for bit; the condition adds the first
frame in the concat image-to-video form of a Wan (`models/wan/image.py`, `--model-size wan-digits-i2v`), pixels
standing for latents (the VAE is the identity):
    x      float32 [N, 1, T, H, W] in [-1, 1]
    cond   float32 [N, L D + T H W] = [N, 64 + 256 T], one flat tensor per sample (`CondParts`):
             text   [L, D] = [4, 16]        the prompt embedding of "digit k moves <direction>" (`prompt_embedding`)
             image  [1, T, H, W]            the clip's first frame, then T - 1 zero frames
    cond_parts  (("text", (4, 16)), ("image", (1, T, 16, 16)))
    negative    the empty prompt [4, 16] (the text part's shape: CFG's negative keeps each sample's image and swaps
                its text, `FamilyModel.negative_for`)
The first frame fixes the digit's handwriting and start; the start (module docstring of `moving_digits.py`: the
centred path of the (direction, speed)) tells some directions apart, the prompt names the direction.

Eval conditions (`balanced_conditions`, what launch/sample.py and the trainers' eval sample): sample k has the prompt
of (digit, direction) = `balanced_pairs` (k mod 10, (k div 10) mod 4) and the first frame of the j-th held-out clip
of that (digit, direction), j = (k div 40) mod M (M: the fewest held-out clips of any pair, 35), whatever the split:
400 samples show 10 held-out glyphs per pair. `condition_labels` reads the text part for the labels
(`decode_conditions`) and hands samples.npz the given first frames, which `eval.moving_digits` scores (the
first-frame error).
Memory: cond holds 64 + 256 T floats per clip beside x's 256 T (T = 4: 25 MB for the train split).
"""
from functools import lru_cache
from typing import Dict

import numpy as np
import torch

from dmd2_mega.errors import DataError
from .digits import NUM_CLASSES
from .moving_digits import (DIRECTIONS, EMBED_DIM, FRAMES, HEIGHT, I2V_SPEC, PROMPT_LEN, WIDTH, MovingDigitsDataset,
                            balanced_pairs, clip_geometry, decode_conditions, empty_prompt, prompt_embedding, render)

TEXT = PROMPT_LEN * EMBED_DIM
"""Values of the text part, first in cond."""


def cond_parts(frames: int) -> tuple:
    """The parts of a T-frame condition: (("text", (L, D)), ("image", (1, T, H, W)))."""
    return ("text", (PROMPT_LEN, EMBED_DIM)), ("image", (1, int(frames), HEIGHT, WIDTH))


def i2v_conditions(prompts: torch.Tensor, first: torch.Tensor, frames: int) -> torch.Tensor:
    """prompts float [N, L, D], first frames float [N, 1, H, W] -> cond float32 [N, L D + T H W]: the prompt, then the
    image part [1, T, H, W] = the first frame followed by T - 1 zero frames."""
    image = first.new_zeros(len(first), 1, int(frames), HEIGHT, WIDTH, dtype=torch.float32)
    image[:, :, 0] = first
    return torch.cat([prompts.float().flatten(1), image.flatten(1)], dim=1)


def given_first_frames(cond) -> torch.Tensor:
    """The first frame [N, 1, H, W] (float32, CPU) in the image part of conditions cond [N, L D + T H W]."""
    c = torch.as_tensor(cond).detach().to("cpu", torch.float32)
    if c.dim() != 2 or c.shape[1] < TEXT + HEIGHT * WIDTH:
        raise DataError(f"moving-digits-i2v conditions are flat [N, {TEXT} + T x {HEIGHT * WIDTH}], got shape "
                        f"{tuple(c.shape)}")
    return c[:, TEXT:TEXT + HEIGHT * WIDTH].reshape(len(c), 1, HEIGHT, WIDTH)


@lru_cache(maxsize=1)
def heldout_first_frames() -> torch.Tensor:
    """float32 [10, 4, M, 1, H, W]: the first frames of the held-out clips of each (digit, direction), in split order,
    M = the fewest of any pair. A first frame does not depend on T (the speeds and starts do not)."""
    glyphs, digit, direction, _, corners, _ = clip_geometry("heldout", FRAMES)
    pair = digit * len(DIRECTIONS) + direction
    m = int(torch.bincount(pair, minlength=NUM_CLASSES * len(DIRECTIONS)).min())
    pick = torch.stack([torch.nonzero(pair == p)[:m, 0] for p in range(NUM_CLASSES * len(DIRECTIONS))])  # [40, M]
    first = render(glyphs[pick.flatten()], corners[pick.flatten(), :1])[:, :, 0]           # [40 M, 1, H, W]
    return first.view(NUM_CLASSES, len(DIRECTIONS), m, 1, HEIGHT, WIDTH)


class MovingDigitsI2VDataset(MovingDigitsDataset):
    """`--data moving-digits-i2v[:T]`: the clips of `MovingDigitsDataset`, cond float32 [N, 64 + 256 T] (the prompt
    embedding, then the first frame and T - 1 zero frames), negative = the empty prompt [4, 16]; see the module
    docstring."""

    spec = I2V_SPEC

    def __init__(self, split: str = "train", frames: int = FRAMES):
        super().__init__(split, frames)
        self.cond = i2v_conditions(self.cond, self.x[:, :, 0], self.frames)
        self._set_shapes(self.channels, self.spatial, None, self.cond.shape[1:], self.source, cond_parts(self.frames))
        self.set_negative(empty_prompt(), f"{self.source} (the empty prompt)")

    def balanced_conditions(self, n: int, start: int = 0) -> torch.Tensor:
        """Samples start .. start + n - 1's conditions [n, 64 + 256 T]: the prompts of `balanced_pairs` with the first
        frames of held-out clips of the same (digit, direction) (module docstring)."""
        digit, direction = balanced_pairs(n, start)
        table = heldout_first_frames()
        j = (torch.arange(start, start + n) // (NUM_CLASSES * len(DIRECTIONS))) % table.shape[2]
        return i2v_conditions(prompt_embedding(digit, direction), table[digit, direction, j], self.frames)

    def condition_labels(self, cond: torch.Tensor) -> Dict[str, np.ndarray]:
        """The arrays samples.npz stores beside the clips so they can be scored: {"digits", "directions"} int64 [N]
        decoded from the text part of cond, and "first_frames" float32 [N, 1, H, W], the given first frames."""
        digit, direction = decode_conditions(cond)
        return {"digits": digit.numpy(), "directions": direction.numpy(),
                "first_frames": given_first_frames(cond).numpy()}
