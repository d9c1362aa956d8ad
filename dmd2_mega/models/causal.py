"""Causal (streaming) students: frames in chunks, each chunk attending to itself and to earlier chunks.

Family-agnostic geometry of a causal video student (the Wan family's model: `models/wan/causal.py`). The F latent
frames of a clip (token frames: frames / the temporal patch) are split into chunks of `chunk_frames`
(`--causal-chunk-frames`, default 3 as Self-Forcing's chunk-wise model; 1 is frame-wise); when F is not a multiple,
the FIRST chunk is the shorter one (F = 7, chunk 3: 1 + 3 + 3), so every later chunk has the full length that
streaming generation repeats. A query in chunk i sees the keys of chunk j when

    j <= i  and  (j < sink_chunks  or  window is None  or  j > i - window)

(`--causal-sink-chunks S`, `--causal-local-attn-chunks W`: LongLive's attention sink, Rolling Forcing's rolling
window: the first S chunks and the last W, its own included). The visible keys of chunk i are a few contiguous
token ranges, so attention runs chunk by chunk over those ranges: dense SDPA / flash calls, no [S, S] mask
(1 GB of booleans at Wan 480p x 81 frames), and the same blocks the KV-cached streaming path computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dmd2_mega.errors import ConfigError


@dataclass(frozen=True)
class CausalLayout:
    """How a causal student splits frames into chunks and which chunks a chunk attends to (module docstring)."""

    chunk_frames: int = 3
    """--causal-chunk-frames: token frames per chunk (the first chunk may be shorter)."""
    window: Optional[int] = None
    """--causal-local-attn-chunks: attend to the last `window` chunks (its own included); None: every earlier one."""
    sink: int = 0
    """--causal-sink-chunks: the first `sink` chunks stay visible to every later chunk (with a window)."""

    def __post_init__(self):
        if self.chunk_frames < 1:
            raise ConfigError(f"--causal-chunk-frames must be >= 1, got {self.chunk_frames}")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"--causal-local-attn-chunks must be >= 1 (its own chunk), got {self.window}")
        if self.sink < 0:
            raise ConfigError(f"--causal-sink-chunks must be >= 0, got {self.sink}")
        if self.sink and self.window is None:
            raise ConfigError("--causal-sink-chunks keeps chunks visible past a rolling window; give "
                              "--causal-local-attn-chunks W too (without a window every chunk is visible)")

    def chunks(self, frames: int) -> list[tuple[int, int]]:
        """[(first frame, end frame)] of each chunk of a clip of `frames` token frames."""
        if frames < 1:
            raise ConfigError(f"a causal model needs at least one frame, got {frames}")
        first = frames % self.chunk_frames or self.chunk_frames
        return [(0, first)] + [(s, s + self.chunk_frames) for s in range(first, frames, self.chunk_frames)]

    def frame_chunks(self, frames: int) -> list[int]:
        """The chunk of each of the `frames` token frames (what per-chunk rows become per frame)."""
        return [i for i, (s, e) in enumerate(self.chunks(frames)) for _ in range(s, e)]

    def visible(self, i: int) -> list[int]:
        """The chunks (ascending) that chunk i attends to."""
        if self.window is None:
            return list(range(i + 1))
        return [j for j in range(i + 1) if j < self.sink or j > i - self.window]

    def kept(self, done: int) -> list[int]:
        """The chunks a KV cache must hold after chunks 0 .. done - 1 are written, for chunk `done` to come."""
        return [j for j in self.visible(done) if j < done]

    def visible_frames(self, frames: int) -> int:
        """The most frames one chunk's queries see (its own included) in a stream whose chunks are those of a
        `frames`-frame clip, however long it runs under a window: what a KV cache holds at its fullest."""
        if self.window is not None:  # longer by whole chunks: the same first chunk, every window reached
            frames += (self.sink + self.window) * self.chunk_frames
        spans = self.chunks(frames)
        return max(sum(spans[j][1] - spans[j][0] for j in self.visible(i)) for i in range(len(spans)))

    def key_ranges(self, i: int, frames: int, per_frame: int) -> list[tuple[int, int]]:
        """Token ranges [(start, end)] of the keys chunk i sees in a clip of `frames` frames of `per_frame` tokens,
        adjacent chunks merged (no window: the one range [0, end of chunk i))."""
        spans = self.chunks(frames)
        out: list[list[int]] = []
        for j in self.visible(i):
            a, b = (f * per_frame for f in spans[j])
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
        return [tuple(r) for r in out]

    def describe(self) -> str:
        window = "every earlier chunk" if self.window is None else (
            f"the last {self.window} chunks" + (f" and the first {self.sink} (sink)" if self.sink else ""))
        return f"causal: chunks of {self.chunk_frames} frames, each attending to itself and {window}"
