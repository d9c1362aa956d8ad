"""The causal Wan student: the Wan's weights with block-causal self-attention and a noise level per chunk.

Built by `family.WanFamily.build` when the build options carry a `CausalLayout` (`models/causal.py`: chunks,
rolling window, sink); it has exactly the Wan's parameters, so it initialises from a converted diffusers folder
or a teacher checkpoint and exports to the same layout. Cross-attention to the text is unchanged. An image-to-video
student (the concat form, `image.py`) streams from its image: each chunk reads its frames of the clip's [mask, image
latent] channels (the mask only on the clip's first frame; past the condition's frames its last one repeats).

    sigma [B]            one noise level for every chunk (the package's convention)
    sigma [B, chunks]    a level per chunk: the time embedding and the modulation of a token are its chunk's
                         (per frame rows [B, F, 6, D] on the fused kernels: `model.modulate`; under CP / SP, where
                         a rank's tokens need not start at a frame, per token)

Two forward paths compute the same thing:
- `forward` (training): one parallel pass over the whole clip; self-attention runs chunk by chunk over the key
  ranges each chunk sees (`BlockCausal`), dense calls with no mask.
- `stream_forward` (generation): one chunk at a time with a `KVCache`: per layer this rank's self-attention
  k / v of the earlier chunks it still sees (its heads under TP; under CP the head group the all-to-all gives it,
  over every token), and the text's k / v, computed once (per grad mode). With `write=True` the chunk's own
  k / v join the cache and chunks that no later chunk sees are evicted (the rolling window); rotary positions
  keep counting. The cache's k / v live in buffers preallocated for the most a chunk sees, written in place: a
  forward copies its own chunk's k / v, not the whole cache (`KVCache`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models.attention import attention
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.family import BuildOptions, DataShape
from dmd2_mega.models.wan.model import Wan, WanSpec


def _cat(t: torch.Tensor, ranges: list) -> torch.Tensor:
    """Tokens [B, S, ...] of t in `ranges` [(start, end)], in order (a view for one range)."""
    if len(ranges) == 1:
        return t[:, ranges[0][0]:ranges[0][1]]
    return torch.cat([t[:, a:b] for a, b in ranges], dim=1)


class BlockCausal:
    """The parallel pass's self-attention: each chunk's queries over the key ranges it sees
    (`CausalLayout.key_ranges`); one chunk is plain full attention (exactly the bidirectional Wan's)."""

    def __init__(self, layout: CausalLayout, frames: int, per_frame: int):
        self.spans = [(a * per_frame, b * per_frame, layout.key_ranges(i, frames, per_frame))
                      for i, (a, b) in enumerate(layout.chunks(frames))]

    stateless = True  # recompute in backward may run it again

    def layer(self, i: int) -> "BlockCausal":
        return self

    def self_attention(self, q, k, v, backend: str) -> torch.Tensor:
        if len(self.spans) == 1:
            return attention(q, k, v, backend)
        return torch.cat([attention(q[:, a:b], _cat(k, r), _cat(v, r), backend) for a, b, r in self.spans], dim=1)

    @staticmethod
    def text_kv(compute: Callable):
        return compute()


class KVCache:
    """What streaming generation keeps between chunks (module docstring); `chunks` / `frames`: how many are written.

    Self-attention k / v: per layer a k and a v buffer [B, capacity, heads, d], allocated at the first chunk for
    `capacity_frames` (the most a chunk sees: `CausalLayout.visible_frames`), the kept chunks in ascending order
    from token 0; `self_kv[layer]` = {chunk: (k, v)} views of them. A forward without grad writes its chunk's k / v
    in place after them and attends over that prefix: it copies one chunk, not the cache (joining every held chunk
    with `torch.cat` per forward copied ~5 GB at Wan 480p, by estimate). With grad, or on a read-only `view`, the
    held chunks are joined as before, so autograd keeps what it saved and a view never writes (a chunk written with
    grad keeps its graph in `self_kv`). Same keys, same order: bit-identical outputs. `advance` moves the window's
    chunks down over an evicted one, once per chunk; a buffer a view reads is copied before it is overwritten; a
    stream longer than sized (no window) reallocates."""

    def __init__(self, layout: CausalLayout, num_layers: int, capacity_frames: int = 0):
        self.layout, self.chunks, self.frames, self.capacity_frames = layout, 0, 0, capacity_frames
        self.self_kv: list[dict] = [{} for _ in range(num_layers)]
        self.text: list[Optional[tuple]] = [None] * num_layers
        self.text_grad: list[Optional[tuple]] = [None] * num_layers  # computed with grad: for forwards with grad
        self.buffers: list[Optional[tuple]] = [None] * num_layers  # per layer (k, v) [B, capacity tokens, heads, d]
        self.slots: dict[int, tuple[int, int]] = {}  # kept chunk -> its token range in every layer's buffers
        self.used = 0  # tokens the kept chunks fill
        self.pinned = [0] * num_layers  # tokens of a layer's buffers a view reads: copied before they are written
        self.grad_kv: list[set] = [set() for _ in range(num_layers)]  # chunks whose self_kv holds k / v with grad
        self.read_only = False
        self._written = 0

    def nbytes(self) -> int:
        """Bytes held on this rank (self-attention k / v of the kept chunks and the text's)."""
        held = [t for layer in self.self_kv for kv in layer.values() for t in kv]
        held += [t for kv in self.text + self.text_grad if kv is not None for t in kv]
        return sum(t.numel() * t.element_size() for t in held)

    def buffer_bytes(self) -> int:
        """Bytes of the self-attention buffers allocated on this rank (the kept chunks and room for the rest)."""
        return sum(t.numel() * t.element_size() for kv in self.buffers if kv is not None for t in kv)

    def view(self) -> "KVCache":
        """A read-only copy of the cache as it is now: the same chunks' k / v (the tensors shared; later writes and
        evictions not seen) and no text k / v with grad yet. A forward with grad against a fresh view each time can
        run again in backward (a replayed chunk under recompute) and build the same graph."""
        out = KVCache(self.layout, len(self.self_kv), self.capacity_frames)
        out.chunks, out.frames, out.text, out.read_only = self.chunks, self.frames, list(self.text), True
        out.self_kv = [dict(layer) for layer in self.self_kv]
        self.pinned = [max(p, self.used) for p in self.pinned]
        return out

    def step(self, write: bool, frames: int) -> "_CachedStep":
        """The mixer of one chunk's forward (`frames` token frames); `write`: its k / v join the cache."""
        if write and self.read_only:
            raise ValueError("a read-only view of a KV cache (`KVCache.view`) is never written")
        return _CachedStep(self, write, frames)

    def attend(self, i: int, q, k, v, backend: str, write: bool, frames: int) -> torch.Tensor:
        """Layer i's self-attention of the chunk's q over the kept chunks' k / v and its own (class docstring)."""
        if self.read_only or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            past = [self.self_kv[i][j] for j in self.layout.kept(self.chunks)]
            if write:
                self._store(i, k.detach(), v.detach(), frames)
                self.self_kv[i][self.chunks] = (k, v)
                self.grad_kv[i].add(self.chunks)
            if not past:
                return attention(q, k, v, backend)
            return attention(q, torch.cat([kv[0] for kv in past] + [k], 1), torch.cat([kv[1] for kv in past] + [v], 1),
                             backend)
        n = self.used
        kb, vb = self._store(i, k, v, frames)
        if write:
            self.self_kv[i][self.chunks] = (kb[:, n:], vb[:, n:])
        return attention(q, k, v, backend) if n == 0 else attention(q, kb, vb, backend)

    def _store(self, i: int, k: torch.Tensor, v: torch.Tensor, frames: int) -> tuple:
        """k / v [B, s, heads, d] copied into layer i's buffers after the kept chunks; views [B, used + s, heads, d]
        of the buffers over both. A buffer missing, too small or read by a view is reallocated first."""
        n, s = self.used, k.shape[1]
        held = self.buffers[i]
        if held is None or held[0].shape[1] < n + s or n < self.pinned[i]:
            cap = max(n + s, self.capacity_frames * (s // frames))
            new = tuple(torch.empty((t.shape[0], cap, *t.shape[2:]), dtype=t.dtype, device=t.device) for t in (k, v))
            if held is not None and n:
                for a, b in zip(new, held):
                    a[:, :n].copy_(b[:, :n])
            self.buffers[i], self.pinned[i] = new, 0
            self._views(i)
        kb, vb = self.buffers[i]
        kb[:, n:n + s].copy_(k)
        vb[:, n:n + s].copy_(v)
        self._written = s
        return kb[:, :n + s], vb[:, :n + s]

    def _views(self, i: int) -> None:
        """Layer i's `self_kv` entries of the chunks written without grad: views of its buffers at their slots."""
        kb, vb = self.buffers[i]
        for j, (a, b) in self.slots.items():
            if j not in self.grad_kv[i]:
                self.self_kv[i][j] = (kb[:, a:b], vb[:, a:b])

    def advance(self, frames: int) -> None:
        """Chunk `chunks` is written: count it, evict what the next chunk no longer sees and move the kept chunks
        down to lie in order from token 0 (a buffer a view reads: into a new one)."""
        self.slots[self.chunks] = (self.used, self.used + self._written)
        self.chunks, self.frames = self.chunks + 1, self.frames + frames
        slots, at = {}, 0
        for j in self.layout.kept(self.chunks):
            a, b = self.slots[j]
            slots[j], at = (at, at + b - a), at + b - a
        moves = [(self.slots[j], to) for j, to in slots.items() if self.slots[j] != to]
        for i, layer in enumerate(self.self_kv):
            for j in [j for j in layer if j not in slots]:
                del layer[j]
            self.grad_kv[i] &= set(slots)
            if self.buffers[i] is None or not moves:
                continue
            if moves[0][1][0] < self.pinned[i]:
                new = tuple(torch.empty_like(t) for t in self.buffers[i])
                for j, (c, d) in slots.items():
                    for t, old in zip(new, self.buffers[i]):
                        t[:, c:d].copy_(old[:, self.slots[j][0]:self.slots[j][1]])
                self.buffers[i], self.pinned[i] = new, 0
            else:
                for (a, b), (c, d) in moves:  # in ascending order: each lands below its source, above the last
                    for t in self.buffers[i]:
                        t[:, c:d].copy_(t[:, a:b].clone() if a < d else t[:, a:b])  # a move shorter than the chunk
        self.slots, self.used = slots, at
        for i, kv in enumerate(self.buffers):
            if kv is not None:
                self._views(i)


class _CachedStep:
    """One chunk's forward against a `KVCache` (the mixer of `Wan._forward`); writes its k / v when asked.
    Stateful (it reads and fills the cache), so `Wan._block` does not recompute it in backward."""

    stateless = False

    def __init__(self, cache: KVCache, write: bool, frames: int, i: int = 0):
        self.cache, self.write, self.frames, self.i = cache, write, frames, i

    def layer(self, i: int) -> "_CachedStep":
        return _CachedStep(self.cache, self.write, self.frames, i)

    def self_attention(self, q, k, v, backend: str) -> torch.Tensor:
        return self.cache.attend(self.i, q, k, v, backend, self.write, self.frames)

    def text_kv(self, compute: Callable):
        """The text's k / v of this layer, computed once per grad mode: a forward with grad (a training replay)
        must not read k / v computed without it, or the text's projections would get no gradient."""
        text = self.cache.text_grad if torch.is_grad_enabled() else self.cache.text
        if text[self.i] is None:
            text[self.i] = compute()
        return text[self.i]


class CausalWan(Wan):
    """The Wan with block-causal attention over chunks of frames (module docstring)."""

    def __init__(self, spec: WanSpec, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()):
        super().__init__(spec, shape, tp_size, options)
        self.causal_layout: CausalLayout = options.causal
        if self.image_form == "first-frame":
            raise ConfigError(f"--causal with --model-size {spec.name} on first-frame image-to-video data (TI2V): a "
                              f"causal student streams from an image in the concat form only (Wan 2.1 I2V: "
                              f"in_channels = 2 x out + 4)")

    def _conditions(self, sigma, cond, frames):
        if sigma.dim() == 1:
            return super()._conditions(sigma, cond, frames)
        spans = self.causal_layout.chunks(frames)
        if sigma.dim() != 2 or sigma.shape[1] != len(spans):
            raise ValueError(f"a causal Wan takes sigma [B] or [B, chunks] = [B, {len(spans)}] for {frames} frames "
                             f"in chunks of {self.causal_layout.chunk_frames}; got shape {tuple(sigma.shape)}")
        # chunk by chunk, each a [B] batch as the [B] path and a streamed chunk run it: equal levels give equal rows
        temb, mod = (torch.stack(t, 1) for t in zip(*(self.condition_embedder.time(s) for s in sigma.unbind(1))))
        of_frame = self.causal_layout.frame_chunks(frames)
        return temb[:, of_frame], mod[:, of_frame], self.condition_embedder.text(cond)

    def _mixer(self, x: torch.Tensor) -> BlockCausal:
        f, hh, ww = self._grid(x)
        return BlockCausal(self.causal_layout, f, hh * ww)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """v [B, C, T, H, W] of the whole clip, block-causal; sigma [B] or [B, chunks]."""
        return self._forward(x, sigma, cond, self._mixer(x))

    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        return self._features(x, sigma, cond, layer, self._mixer(x))

    def forward_features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int):
        return self._run(x, sigma, cond, self._mixer(x), tap=layer)

    def forward_features_and(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int, extra):
        return self._joined(x, sigma, cond, layer, extra, self._mixer(x))

    def stream(self, noise: torch.Tensor, cond: torch.Tensor, denoise: Callable, context_noise: float = 0.0):
        """Generate a clip chunk by chunk; yields each chunk's x0 [B, C, f, H, W] as it is done.

        noise [draws, B, C, F, H, W] (F frames, any number: past the training length the rolling window bounds
        the cache); `denoise(predict, noise_chunk)` -> x0 samples one chunk from its noise [draws, B, C, f, H, W]
        with predict(x, sigma [B], cond) -> v run against the cache (the few-step sampler:
        `sampling.stream_student`). The chunk is then re-run at `context_noise` (x0 itself at 0, else x0
        re-noised with the chunk's last draw) to write its k / v into the cache (--causal-context-noise)."""
        cache, b = self.new_cache(noise.shape[-3] // self.spec.patch_size[0]), noise.shape[1]

        def predict(x, sigma, c):
            return self.stream_forward(x, sigma, c, cache)
        for first, end in self.causal_layout.chunks(noise.shape[-3]):
            draws = noise[..., first:end, :, :]
            x0 = denoise(predict, draws)
            level = torch.full((b,), float(context_noise), device=x0.device)
            context = x0 if context_noise == 0 else (1 - context_noise) * x0 + context_noise * draws[-1].to(x0)
            self.stream_forward(context, level, cond, cache, write=True)
            yield x0

    def new_cache(self, frames: Optional[int] = None) -> KVCache:
        """A KV cache sized for a stream of `frames` token frames (None: the clip the model was built for); a longer
        stream without a window reallocates it as it grows."""
        frames = frames or self.shape.spatial[0] // self.spec.patch_size[0]
        return KVCache(self.causal_layout, len(self.blocks), self.causal_layout.visible_frames(frames))

    def stream_forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, cache: KVCache,
                       write: bool = False) -> torch.Tensor:
        """v [B, C, f, H, W] of the next chunk x (f frames, its rotary positions after the cache's frames) against
        the cache; sigma [B]. write: add this chunk's k / v to the cache (the chunk is then done)."""
        if sigma.dim() != 1:
            raise ValueError(f"stream_forward takes one noise level per sample, sigma [B]; got {tuple(sigma.shape)}")
        v = self._forward(x, sigma, cond, cache.step(write, self._grid(x)[0]), first_frame=cache.frames)
        if write:
            cache.advance(self._grid(x)[0])
        return v


def check_causal(spec: WanSpec, options: BuildOptions) -> None:
    """ConfigError for a causal build the Wan family cannot make."""
    if spec.boundary_ratio is not None:
        raise ConfigError(f"--causal: a causal student is one model; {spec.name} is Wan 2.2's two "
                          f"experts (distil into one expert's weights: --from-diffusers ... --subfolder transformer)")
