"""Moving digits: an embedded, text-conditioned video set made from scikit-learn's 8x8 digits.

Each clip is one 8x8 digit (`digits.py`, pixels value / 8 - 1 in [-1, 1]) sliding across a blank
(-1) canvas of H x W = 16 x 16 over T frames (`--data moving-digits`: T = FRAMES = 4; `--data moving-digits:T`:
any T >= 2), in one of 4 directions at 1 or 2 px / frame:
    x    float32 [N, 1, T, H, W] in [-1, 1]      frame t = the digit with its top-left corner at
                                                 ((row0 + t * s * dy_d) mod H, (col0 + t * s * dx_d) mod W)
    direction d in 0..3 = right, left, down, up  (dy, dx) = (0, +1), (0, -1), (+1, 0), (-1, 0)
    speed s in {1, 2} px / frame                 (rows grow downwards, as in the image)
The path is centred, so over 4 frames the whole 8x8 digit stays inside the canvas: across the motion
the corner sits at (W - 8) / 2 = 4, along it the path of s (4 - 1) px is centred in the 8 px of room,
starting at (8 - 3 s) // 2 (moving right / down; mirrored for left / up): speed 1 visits 2..5,
speed 2 visits 1, 3, 5, 7. A clip is thus fixed by (glyph, direction, speed); the variety is the
digit's handwriting and the speed. Why not a random start: a Wan transformer knows positions only
relatively (rotary, no absolute embedding), and with random starts the (digit, direction) condition
explains 8% of the clips' pixel variance (centred: 51%); the wan-digits teacher then did not learn
the direction in the CPU budget (25% direction accuracy after 1,200 steps, vs 69% after 1,000 centred).

Long clips live on a torus: the canvas wraps round, canvas pixel (r, c) of frame t shows glyph pixel
((r - row_t) mod H, (c - col_t) mod W) where both are < 8 (`render`), so a digit leaving one edge re-enters at
the opposite one, every frame holds the whole digit (its pixel mass is the same in all frames), and frame t + 1
is frame t circularly shifted by the velocity s * (dy_d, dx_d): any T is valid and the motion never changes
(period H / s = 16 / s frames). The start (row0, col0) is the 4-frame clip's centred one for every T, and
the 4-frame clips never touch an edge (corners 1..7, glyph 8 px, canvas 16 px), so frames 0..3 of a T-frame
clip equal the 4-frame clip bit for bit and `--data moving-digits` is exactly the set it was before clips had
a length. `--data moving-digits:T` names the length in the --data string itself, which checkpoints record
(args.train.data) and which launch/sample.py and the evals rebuild the data from (`frames_of_spec`).

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
train 5,752 clips, held-out 1,436 (for every T: the speeds do not depend on T). All clips are rendered at
once with tensor ops (`render`): memory 1 KiB per frame and clip (T = 24: 141 MB for the train split).

`--data moving-digits-i2v[:T]` (`moving_digits_i2v.py`) is the same clips for image-to-video, each condition the
prompt embedding followed by the clip's first frame (flat, `cond_parts`); `decode_conditions` reads the text part
of such a condition (`text_part`), so the labels and the metric are the same for both sets.
"""
import re
from functools import lru_cache
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from dmd2_mega.errors import DataError
from .dataset import ImageDataset
from .digits import NUM_CLASSES, _load, split_indices

FRAMES, HEIGHT, WIDTH = 4, 16, 16
"""FRAMES: the length of `--data moving-digits` (and the start of every longer clip's centred path)."""
MIN_FRAMES = 2
"""The shortest `--data moving-digits:T`: a clip shows its direction (the prompt names it) from 2 frames on."""
SPEC = "moving-digits"
I2V_SPEC = "moving-digits-i2v"
"""The image-to-video variant (`moving_digits_i2v.py`): the same clips, each conditioned on its prompt and first
frame."""
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
    frame, any integers: taken mod (H, W)) -> clips float32 [N, 1, T, HEIGHT, WIDTH], background -1.

    On the torus (module docstring): canvas pixel (r, c) of frame t reads glyph pixel ((r - row_t) mod H,
    (c - col_t) mod W) where both are < 8, else the background; for a glyph inside the canvas that is the glyph
    pasted at its corner. One gather from the glyph on a blank canvas, indexed by [N, T, H] rows x [N, T, W]
    columns."""
    n = len(glyphs)
    canvas = F.pad(glyphs.float(), (0, WIDTH - GLYPH, 0, HEIGHT - GLYPH), value=-1.0)           # [N, H, W]
    rows = (torch.arange(HEIGHT) - corners[..., 0, None]) % HEIGHT                              # [N, T, H]
    cols = (torch.arange(WIDTH) - corners[..., 1, None]) % WIDTH                                # [N, T, W]
    return canvas[torch.arange(n).view(n, 1, 1, 1), rows[..., :, None], cols[..., None, :]].unsqueeze(1)


def trajectories(directions: torch.Tensor, rng: np.random.RandomState,
                 frames: int = FRAMES) -> Tuple[torch.Tensor, torch.Tensor]:
    """directions int64 [N] -> (speeds int64 [N], corners int64 [N, T = frames, 2] in [0, H) x [0, W)): a
    uniform speed of SPEEDS and the path of that (direction, speed) from the 4-frame clip's centred start,
    wrapping round the torus (module docstring)."""
    n = len(directions)
    room = torch.tensor([HEIGHT - GLYPH, WIDTH - GLYPH])
    speeds = torch.as_tensor(np.asarray(SPEEDS)[rng.randint(0, len(SPEEDS), n)], dtype=torch.int64)
    step = STEPS[directions] * speeds[:, None]                          # [N, 2] px / frame
    travel = step.abs() * (FRAMES - 1)                                   # [N, 2] px over the 4-frame clip
    start = (room - travel) // 2 + torch.where(step < 0, travel, 0)
    corners = start[:, None] + torch.arange(frames).view(1, -1, 1) * step[:, None]
    return speeds, corners % torch.tensor([HEIGHT, WIDTH])


def parse_spec(spec: Optional[str]) -> Optional[Tuple[str, int]]:
    """A --data value -> (its set, SPEC or I2V_SPEC, and the clip length it names): 'moving-digits[-i2v]' ->
    FRAMES, 'moving-digits[-i2v]:T' -> T; anything else (digits, a shard directory) -> None. DataError naming
    --data unless T is an integer >= MIN_FRAMES."""
    if spec in (SPEC, I2V_SPEC):
        return spec, FRAMES
    base = next((b for b in (SPEC, I2V_SPEC) if isinstance(spec, str) and spec.startswith(b + ":")), None)
    if base is None:
        return None
    count = spec[len(base) + 1:]
    if not re.fullmatch(r"[0-9]+", count) or int(count) < MIN_FRAMES:
        raise DataError(f"--data {spec}: the frame count T of {base}:T must be an integer >= {MIN_FRAMES}, "
                        f"got {count!r}")
    return base, int(count)


def frames_of_spec(spec: Optional[str]) -> Optional[int]:
    """A --data value -> the clip length it names (`parse_spec`: moving-digits[-i2v][:T]), else None."""
    parsed = parse_spec(spec)
    return parsed[1] if parsed is not None else None


def spec_of_frames(frames: int, base: str = SPEC) -> str:
    """The --data value of `base`'s clips of `frames` frames: `base` for FRAMES, else '<base>:T'."""
    return base if frames == FRAMES else f"{base}:{frames}"


def check_frames(frames) -> int:
    """`frames` as an int; DataError (naming --data moving-digits:T) unless it is an integer >= MIN_FRAMES."""
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < MIN_FRAMES:
        raise DataError(f"--data moving-digits:T: the frame count T must be an integer >= {MIN_FRAMES}, "
                        f"got {frames!r}")
    return int(frames)


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


def text_part(cond) -> torch.Tensor:
    """The prompt embeddings float32 [N, L, D] (on the CPU) of cond [N, L, D] (`--data moving-digits`) or of a flat
    image-to-video condition [N, L D + T H W] (`--data moving-digits-i2v`: the text part first, then the image part
    [1, T, H, W], T >= MIN_FRAMES); DataError for any other shape."""
    c = torch.as_tensor(cond).detach().to("cpu", torch.float32)
    text = PROMPT_LEN * EMBED_DIM
    image = c.shape[1] - text if c.dim() == 2 else 0  # the image part's values, T H W
    if image >= MIN_FRAMES * HEIGHT * WIDTH and image % (HEIGHT * WIDTH) == 0:
        return c[:, :text].reshape(len(c), PROMPT_LEN, EMBED_DIM)
    if c.dim() != 3 or tuple(c.shape[1:]) != (PROMPT_LEN, EMBED_DIM):
        raise DataError(f"moving-digits conditions must be embeddings [N, {PROMPT_LEN}, {EMBED_DIM}] (moving-digits-"
                        f"i2v: [N, {text} + T x {HEIGHT * WIDTH}], the text part first), got shape {tuple(c.shape)}")
    return c


def decode_conditions(cond) -> Tuple[torch.Tensor, torch.Tensor]:
    """cond float [N, L, D] (or an image-to-video condition, of which the text part is read: `text_part`) ->
    (digit int64 [N], direction int64 [N]): the exact inverse of `prompt_embedding`. DataError if a row is not one
    of the 40 prompts (to float32 rounding)."""
    c = text_part(cond)
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


def clip_geometry(split: str, frames: int = FRAMES):
    """(glyphs float64 [N, 8, 8] in [-1, 1], digit, direction, speed int64 [N], corners int64 [N, T, 2], image
    index into `load_digits()` order int64 [N]) of a split's clips of T = `frames` frames; deterministic.
    `render(glyphs, corners)` draws them (all, or the rows of a subset)."""
    if split not in SPLITS:
        raise DataError(f"moving-digits split must be 'train' or 'heldout', got {split!r}")
    frames = check_frames(frames)
    images, labels = _load()
    index = torch.from_numpy(split_indices()[SPLITS.index(split)]).repeat_interleave(CLIPS_PER_IMAGE)
    direction = torch.arange(CLIPS_PER_IMAGE).repeat(len(index) // CLIPS_PER_IMAGE)
    rng = np.random.RandomState(GEOMETRY_SEED + SPLITS.index(split))
    speed, corners = trajectories(direction, rng, frames)
    glyphs = torch.from_numpy(images)[index] / 8.0 - 1.0
    return glyphs, torch.from_numpy(labels)[index], direction, speed, corners, index


def make_clips(split: str, frames: int = FRAMES):
    """(clips float32 [N, 1, T, H, W], digit, direction, speed int64 [N], corners int64 [N, T, 2], image index
    into `load_digits()` order int64 [N]) of a split, T = `frames`; deterministic."""
    glyphs, digit, direction, speed, corners, index = clip_geometry(split, frames)
    return render(glyphs, corners), digit, direction, speed, corners, index


class MovingDigitsDataset(ImageDataset):
    """`--data moving-digits[:T]`: x float32 [N, 1, T, 16, 16] in [-1, 1] (T = frames, default 4), cond float32
    [N, 4, 16] (the prompt embedding of (digit, direction)), negative = the empty prompt; see the module
    docstring."""

    spec = SPEC
    """The --data name of the set (a subclass's: moving-digits-i2v)."""

    def __init__(self, split: str = "train", frames: int = FRAMES):
        clips, digit, direction, speed, corners, index = make_clips(split, frames)
        source = f"{spec_of_frames(int(frames), self.spec)}[{split}]"
        super().__init__(clips, prompt_embedding(digit, direction), num_classes=None,
                         cond_shape=(PROMPT_LEN, EMBED_DIM), source=source)
        self.set_negative(empty_prompt(), f"{self.source} (the empty prompt)")
        self.split = split
        self.frames = int(frames)
        """T, the clip length."""
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
