"""Moving digits: an embedded, text-conditioned video set made from scikit-learn's 8x8 digits.

Each clip is one 8x8 digit (`digits.py`, pixels value / 8 - 1 in [-1, 1]) sliding across a blank
(-1) canvas of H x W = 16 x 16 over T = 4 frames, in one of 4 directions at 1 or 2 px / frame:
    x    float32 [N, 1, T, H, W] in [-1, 1]      frame t = the digit with its top-left corner at
                                                 (row0 + t * s * dy_d, col0 + t * s * dx_d)
    direction d in 0..3 = right, left, down, up  (dy, dx) = (0, +1), (0, -1), (+1, 0), (-1, 0)
    speed s in {1, 2} px / frame                 (rows grow downwards, as in the image)
The path is centred, so the whole 8x8 digit stays inside the canvas in every frame: across the motion
the corner sits at (W - 8) / 2 = 4, along it the path of s (T - 1) px is centred in the 8 px of room,
starting at (8 - s (T - 1)) // 2 (moving right / down; mirrored for left / up): speed 1 visits 2..5,
speed 2 visits 1, 3, 5, 7. A clip is thus fixed by (glyph, direction, speed); the variety is the
digit's handwriting and the speed. Why not a random start: a Wan transformer knows positions only
relatively (rotary, no absolute embedding), and with random starts the (digit, direction) condition
explains 8% of the clips' pixel variance (centred: 51%); the wan-digits teacher then did not learn
the direction in the CPU budget (25% direction accuracy after 1,200 steps, vs 69% after 1,000 centred).

Conditioning is a text-like embedding, not a label, as a frozen text encoder would give it:
the prompt "digit <k> moves <direction>" is the L = 4 tokens [digit, k, moves, direction] of the
fixed vocabulary `VOCAB`, embedded as cond[l] = E[token_l] + P[l] (float32 [L, D] = [4, 16]), with E
[|VOCAB|, D] and P [L, D] drawn once from `numpy.random.RandomState(EMBED_SEED)` (standard normal,
P scaled by 0.5). The negative (CFG's null condition, and where the teacher's condition dropout
drops to) is the empty prompt: L pad tokens, E[<pad>] + P, as Wan recipes encode an empty
negative prompt; it is not zero, so the model cannot confuse it with a small prompt.
`prompt_embedding(digit, direction)` is the table, `decode_conditions(cond)` its exact inverse
(nearest of the 40 prompts, with a DataError if any condition is farther than float32 rounding).

Splits reuse `digits.split_indices()`: the train clips are made from the 1,438 train images,
the held-out clips from the 359 held-out ones (no digit image in both). Every image gives
CLIPS_PER_IMAGE = 4 clips, one per direction (so (digit, direction) is as balanced as the
digits), with the speed from `numpy.random.RandomState(GEOMETRY_SEED + split_id)`:
train 5,752 clips, held-out 1,436. All clips are rendered at once with tensor ops (`render`).
"""
from functools import lru_cache
from typing import Dict, Tuple

import numpy as np
import torch

from dmd2_mega.errors import DataError
from .dataset import ImageDataset
from .digits import NUM_CLASSES, _load, split_indices

FRAMES, HEIGHT, WIDTH = 4, 16, 16
GLYPH = 8
"""The side of a scikit-learn digit."""
DIRECTIONS = ("right", "left", "down", "up")
STEPS = torch.tensor([[0, 1], [0, -1], [1, 0], [-1, 0]])
"""(dy, dx) per direction, int64 [4, 2]."""
SPEEDS = (1, 2)
CLIPS_PER_IMAGE = len(DIRECTIONS)
GEOMETRY_SEED = 1
EMBED_SEED = 2
SPLITS = ("train", "heldout")

VOCAB = ("<pad>", "digit", "moves", *[str(k) for k in range(NUM_CLASSES)], *DIRECTIONS)
PROMPT_LEN, EMBED_DIM = 4, 16
PAD = 0


def render(glyphs: torch.Tensor, corners: torch.Tensor) -> torch.Tensor:
    """glyphs float [N, 8, 8] in [-1, 1], corners int64 [N, T, 2] (row, col of the glyph's top-left per
    frame, glyph inside the canvas) -> clips float32 [N, 1, T, HEIGHT, WIDTH], background -1.

    Canvas pixel (r, c) of frame t reads glyph pixel (r - row_t, c - col_t) where that lies in the glyph."""
    rows = torch.arange(HEIGHT).view(1, 1, HEIGHT, 1) - corners[..., 0, None, None]  # [N, T, H, 1]
    cols = torch.arange(WIDTH).view(1, 1, 1, WIDTH) - corners[..., 1, None, None]   # [N, T, 1, W]
    inside = (rows >= 0) & (rows < GLYPH) & (cols >= 0) & (cols < GLYPH)             # [N, T, H, W]
    flat = rows.clamp(0, GLYPH - 1) * GLYPH + cols.clamp(0, GLYPH - 1)
    n, t = corners.shape[:2]
    pix = glyphs.reshape(n, 1, GLYPH * GLYPH).float().expand(n, t, -1).gather(2, flat.reshape(n, t, -1))
    return torch.where(inside, pix.view(n, t, HEIGHT, WIDTH), -1.0).unsqueeze(1)


def trajectories(directions: torch.Tensor, rng: np.random.RandomState) -> Tuple[torch.Tensor, torch.Tensor]:
    """directions int64 [N] -> (speeds int64 [N], corners int64 [N, T, 2]): a uniform speed of SPEEDS and the
    centred path of that (direction, speed) (module docstring)."""
    n = len(directions)
    room = torch.tensor([HEIGHT - GLYPH, WIDTH - GLYPH])
    speeds = torch.as_tensor(np.asarray(SPEEDS)[rng.randint(0, len(SPEEDS), n)], dtype=torch.int64)
    step = STEPS[directions] * speeds[:, None]                          # [N, 2] px / frame
    travel = step.abs() * (FRAMES - 1)                                   # [N, 2] px over the clip
    start = (room - travel) // 2 + torch.where(step < 0, travel, 0)
    corners = start[:, None] + torch.arange(FRAMES).view(1, -1, 1) * step[:, None]
    return speeds, corners


@lru_cache(maxsize=1)
def _table() -> Tuple[torch.Tensor, torch.Tensor]:
    """(token embeddings E float32 [|VOCAB|, D], positions P float32 [L, D]) from RandomState(EMBED_SEED)."""
    rng = np.random.RandomState(EMBED_SEED)
    e = rng.standard_normal((len(VOCAB), EMBED_DIM))
    p = 0.5 * rng.standard_normal((PROMPT_LEN, EMBED_DIM))
    return torch.from_numpy(e).float(), torch.from_numpy(p).float()


def prompt_tokens(digit: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """digit, direction int64 [N] -> token ids int64 [N, L] of "digit <k> moves <direction>"."""
    base = torch.tensor([VOCAB.index("digit"), VOCAB.index("0"), VOCAB.index("moves"), VOCAB.index("right")])
    return base + torch.stack([torch.zeros_like(digit), digit, torch.zeros_like(digit), direction], dim=1)


def embed_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """token ids int64 [N, L] -> float32 [N, L, D] = E[tokens] + P."""
    e, p = _table()
    return e[tokens] + p


def prompt_embedding(digit, direction) -> torch.Tensor:
    """int [N] digits in 0..9 and directions in 0..3 -> cond float32 [N, L, D]."""
    digit, direction = torch.as_tensor(digit).long(), torch.as_tensor(direction).long()
    if digit.shape != direction.shape or digit.dim() != 1:
        raise DataError(f"moving-digits prompts: digit and direction must be int [N] of one N, got shapes "
                        f"{tuple(digit.shape)} and {tuple(direction.shape)}")
    for name, v, k in (("digit", digit, NUM_CLASSES), ("direction", direction, len(DIRECTIONS))):
        if len(v) and (v.min() < 0 or v.max() >= k):
            raise DataError(f"moving-digits prompts: {name} must lie in [0, {k}), got {int(v.min())}..{int(v.max())}")
    return embed_tokens(prompt_tokens(digit, direction))


def empty_prompt() -> torch.Tensor:
    """The negative: the empty prompt (L pad tokens), float32 [L, D]."""
    return embed_tokens(torch.full((1, PROMPT_LEN), PAD))[0]


@lru_cache(maxsize=1)
def _all_prompts() -> torch.Tensor:
    """The 40 prompt embeddings float32 [10 * 4, L * D], row = digit + 10 * direction."""
    k = torch.arange(NUM_CLASSES * len(DIRECTIONS))
    return prompt_embedding(k % NUM_CLASSES, k // NUM_CLASSES).flatten(1)


def decode_conditions(cond) -> Tuple[torch.Tensor, torch.Tensor]:
    """cond float [N, L, D] -> (digit int64 [N], direction int64 [N]): the exact inverse of `prompt_embedding`.
    DataError if a row is not one of the 40 prompts (to float32 rounding)."""
    c = torch.as_tensor(cond).detach().to("cpu", torch.float32)
    if c.dim() != 3 or tuple(c.shape[1:]) != (PROMPT_LEN, EMBED_DIM):
        raise DataError(f"moving-digits conditions must be embeddings [N, {PROMPT_LEN}, {EMBED_DIM}], "
                        f"got shape {tuple(c.shape)}")
    table = _all_prompts()
    dist = torch.cdist(c.flatten(1).double(), table.double())  # [N, 40]
    best, idx = dist.min(dim=1)
    tol = 1e-5 * float(table.abs().max())
    if len(c) and not bool((best <= tol).all()):
        bad = int((best > tol).nonzero()[0])
        raise DataError(f"moving-digits conditions: row {bad} is no prompt \"digit <k> moves <direction>\" "
                        f"(nearest at distance {float(best[bad]):.3g}; the negative / empty prompt has no label)")
    return idx % NUM_CLASSES, idx // NUM_CLASSES


def balanced_pairs(n: int, start: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(digit, direction) int64 [n] of samples k = start .. start + n - 1, cycling through all 40 pairs:
    digit = k mod 10, direction = (k div 10) mod 4."""
    k = torch.arange(start, start + n)
    return k % NUM_CLASSES, (k // NUM_CLASSES) % len(DIRECTIONS)


def make_clips(split: str):
    """(clips float32 [N, 1, T, H, W], digit, direction, speed int64 [N], corners int64 [N, T, 2], image index
    into `load_digits()` order int64 [N]) of a split; deterministic."""
    if split not in SPLITS:
        raise DataError(f"moving-digits split must be 'train' or 'heldout', got {split!r}")
    images, labels = _load()
    index = torch.from_numpy(split_indices()[SPLITS.index(split)]).repeat_interleave(CLIPS_PER_IMAGE)
    direction = torch.arange(CLIPS_PER_IMAGE).repeat(len(index) // CLIPS_PER_IMAGE)
    rng = np.random.RandomState(GEOMETRY_SEED + SPLITS.index(split))
    speed, corners = trajectories(direction, rng)
    glyphs = torch.from_numpy(images)[index] / 8.0 - 1.0
    clips = render(glyphs, corners)
    return clips, torch.from_numpy(labels)[index], direction, speed, corners, index


class MovingDigitsDataset(ImageDataset):
    """`--data moving-digits`: x float32 [N, 1, 4, 16, 16] in [-1, 1], cond float32 [N, 4, 16] (the prompt
    embedding of (digit, direction)), negative = the empty prompt; see the module docstring."""

    def __init__(self, split: str = "train"):
        clips, digit, direction, speed, corners, index = make_clips(split)
        super().__init__(clips, prompt_embedding(digit, direction), num_classes=None,
                         cond_shape=(PROMPT_LEN, EMBED_DIM), source=f"moving-digits[{split}]")
        self.set_negative(empty_prompt(), f"{self.source} (the empty prompt)")
        self.split = split
        self.digit, self.direction, self.speed = digit, direction, speed
        """int64 [N] each: the digit class, direction id (DIRECTIONS) and speed (px / frame) of every clip."""
        self.corners = corners
        """int64 [N, T, 2]: the glyph's top-left (row, col) per frame."""
        self.image_index = index
        """int64 [N]: the source image in `load_digits()` order."""

    def balanced_conditions(self, n: int, start: int = 0) -> torch.Tensor:
        """Samples start .. start + n - 1's prompt embeddings [n, L, D], cycling through all 40 (digit, direction)
        pairs (`balanced_pairs`)."""
        return prompt_embedding(*balanced_pairs(n, start))

    def condition_labels(self, cond: torch.Tensor) -> Dict[str, np.ndarray]:
        """The arrays samples.npz stores beside the clips so they can be scored: {"digits", "directions"}
        int64 [N] decoded from cond [N, L, D]."""
        digit, direction = decode_conditions(cond)
        return {"digits": digit.numpy(), "directions": direction.numpy()}
