"""Self-Forcing's autoregressive rollout of a causal student (`models/wan/causal.py`), with backward simulation.

A causal student generates each sample's whole video chunk by chunk with its KV cache. Chunk c runs the few-step
schedule sigma_0 = 1 > ... > sigma_{N-1} (`flow.student_sigmas`) up to its exit step e_c and keeps the x0 there:

    x^(0) = eps_0[chunk c]
    for i = 0 .. e_c:
        x0^(i) = x^(i) - sigma_i v(x^(i), sigma_i | cache)
        i < e_c:  x^(i+1) = (1 - sigma_{i+1}) x0^(i) + sigma_{i+1} eps_{i+1}[chunk c]      (fresh noise)
    keep x_c = x^(e_c), sigma_c = sigma_{e_c}, x0_c = x0^(e_c)
    context_c = (1 - s) x0_c + s eps_N[chunk c],  s = --causal-context-noise (0: x0_c itself)
    one forward at (context_c, s) writes chunk c's k / v into the cache for the chunks after it (not after the last)

The generated video is x0 = [x0_0, ..., x0_{C-1}]: what the critic and the DMD loss read. The actor replays each
chunk's exit step with grad from (x_c, sigma_c) over the contexts of the earlier chunks (their cache inputs), which
is why the rollout keeps `x`, `sigma` and `context` (`replay`): Self-Forcing's gradient path, the DMD gradient on the
whole video reaching every chunk's exit-step output and, through the cache, nothing of the earlier chunks.

Rollouts past the training length (--self-forcing-rollout-frames F > T, Self-Forcing++'s remedy for a student that
has never seen its own frames past T): the rollout runs F frames, and each micro-batch's critic phase and DMD loss
read one window of T frames of it (`draw_window`: chunks [c0, c1), drawn uniformly from `stop_gen` after the exit
steps), the bidirectional teacher and critic at their own length; the replay runs the chunks before the window for
their cache only and carries grad in the window.

Exit steps: `per_chunk=True` (Self-Forcing's): e_c ~ U{0..N-1} drawn once per chunk for the whole batch; False: per
sample and chunk. Samples that exit earlier in a chunk run on with the others (their later outputs are not kept), so
every forward is the whole batch against one cache.

Generator consumption, independent of the exit steps (so TP / CP ranks with equal generators roll out identically):
    1. exit steps from `stop_gen` (CPU): torch.randint(0, N, (chunks,)) or (n, chunks) (`draw_exits`; a cycle draws
       every micro-batch's, and its window after them, at its start and copies the exits to the device in ONE
       non-blocking copy: `method.SelfForcingMethod.rollout_step`)
    2. from `noise_gen`: eps_0 [n, *video], then eps_1 .. eps_{N-1} (one full video each), then eps_N (the
       context re-noise, drawn only when s > 0)
All under torch.no_grad(). Shapes: video (C, F, H, W); x, x0hat, context [n, C, F, H, W]; sigma, exit_step
[n, chunks] (fp32, int64).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from dmd2_mega.distributed.parallel import to_device
from dmd2_mega.errors import RolloutError
from dmd2_mega.methods.rollout import micro_batch_rows
from dmd2_mega.models import recompute


@dataclass
class CausalRollout:
    """One rollout of n samples (module docstring)."""

    x: Tensor          # [n, C, F, H, W]  each chunk's input at its exit step
    sigma: Tensor      # [n, chunks] fp32 each chunk's exit level
    x0hat: Tensor      # [n, C, F, H, W]  the generated video: each chunk's x0 at its exit step (detached)
    context: Tensor    # [n, C, F, H, W]  what each chunk's cache was written from (at the context level)
    cond: Tensor       # [n, ...]
    exit_step: Tensor  # [n, chunks] int64
    sample_id: Tensor  # [n] int64

    def __len__(self) -> int:
        return self.x.shape[0]

    def micro_batch(self, k: int, size: int) -> "CausalRollout":
        """Rows [k * size, (k + 1) * size): micro-batch k of size `size` (what DMD2's critic phase reads)."""
        return micro_batch_rows(self, k, size)

    def window(self, chunks: tuple[int, int], spans: list[tuple[int, int]]) -> "CausalRollout":
        """Chunks [c0, c1) of every sample (frames spans[c0][0] .. spans[c1 - 1][1]; views): what the critic and the
        teacher score of a rollout longer than the training length (`draw_window`)."""
        c0, c1 = chunks
        a, b = spans[c0][0], spans[c1 - 1][1]
        return replace(self, x=self.x[:, :, a:b], x0hat=self.x0hat[:, :, a:b], context=self.context[:, :, a:b],
                       sigma=self.sigma[:, c0:c1], exit_step=self.exit_step[:, c0:c1])


def draw_exits(stop_gen: torch.Generator, n: int, chunks: int, steps: int, per_chunk: bool = True) -> Tensor:
    """[n, chunks] int64 host exit steps U{0..N-1} from `stop_gen` (CPU): one per chunk for the whole batch, or per
    sample and chunk (module docstring)."""
    if stop_gen.device.type != "cpu":
        raise RolloutError(f"the exit steps are drawn on the host: pass a CPU stop_gen (got {stop_gen.device})")
    exits = torch.randint(0, steps, (chunks,) if per_chunk else (n, chunks), generator=stop_gen)
    return exits.expand(n, chunks) if per_chunk else exits


@torch.no_grad()
def causal_rollout(model, noise_gen: torch.Generator, stop_gen: Optional[torch.Generator], cond: Tensor,
                   sigmas: Tensor, *, shape, context_noise: float = 0.0, per_chunk: bool = True,
                   dtype: torch.dtype = torch.float32, sample_id_offset: int = 0, levels: Optional[list] = None,
                   exits: Optional[tuple[Tensor, Tensor]] = None) -> CausalRollout:
    """The rollout of len(cond) samples of video `shape` (C, F, H, W) by the causal `model` (module docstring).
    `levels`: the sigmas as host floats (the method keeps them from its start: no device read per rollout); None
    reads them off `sigmas`. `exits`: the exit steps drawn ahead, ([n, chunks] on the host, the same on the device)
    (a cycle's, `draw_exits`); None: drawn here from `stop_gen` and copied to the device in one non-blocking copy."""
    layout = getattr(model, "causal_layout", None)
    if layout is None:
        raise RolloutError("a Self-Forcing rollout needs a causal student (built with --causal)")
    if sigmas.ndim != 1 or sigmas.numel() < 1:
        raise RolloutError(f"sigmas must be a 1-D [N] tensor with N >= 1, got shape {tuple(sigmas.shape)}")
    n, steps, device = cond.shape[0], sigmas.numel(), cond.device
    chunks = layout.chunks(shape[1])
    if exits is None:
        host = draw_exits(stop_gen, n, len(chunks), steps, per_chunk)
        exits = host, to_device(host.contiguous(), device)  # pinned and non-blocking on CUDA: no host wait
    elif tuple(exits[0].shape) != (n, len(chunks)):
        raise RolloutError(f"exit steps drawn for {tuple(exits[0].shape)} (samples, chunks), not this rollout's "
                           f"{(n, len(chunks))}")
    exits, exits_dev = exits
    eps = [torch.randn((n, *shape), generator=noise_gen, device=noise_gen.device, dtype=dtype).to(device)
           for _ in range(steps)]
    ctx_eps = (torch.randn((n, *shape), generator=noise_gen, device=noise_gen.device, dtype=dtype).to(device)
               if context_noise > 0 else None)
    sig = sigmas.to(device=device, dtype=torch.float32)
    if levels is None:  # host floats (one copy, before the loop): the updates' maths in `dtype`
        levels = sigmas.float().cpu().tolist()
    cache = model.new_cache(chunks[-1][1])  # sized for the whole rollout, which may be longer than a clip
    x_out, x0_out, ctx_out = (torch.empty((n, *shape), device=device, dtype=dtype) for _ in range(3))
    for c, (a, b) in enumerate(chunks):
        last = int(exits[:, c].max())  # the batch runs until its latest exit
        mine = exits_dev[:, c].view(n, 1, 1, 1, 1)
        x = eps[0][:, :, a:b]
        for i in range(last + 1):
            s = sig[i].expand(n)
            x0 = x - levels[i] * model.stream_forward(x, s, cond, cache).to(dtype)
            here = mine == i
            x_out[:, :, a:b] = torch.where(here, x, x_out[:, :, a:b])
            x0_out[:, :, a:b] = torch.where(here, x0, x0_out[:, :, a:b])
            if i < last:
                x = (1 - levels[i + 1]) * x0 + levels[i + 1] * eps[i + 1][:, :, a:b]
        done = x0_out[:, :, a:b]
        ctx = done if ctx_eps is None else (1 - context_noise) * done + context_noise * ctx_eps[:, :, a:b]
        ctx_out[:, :, a:b] = ctx
        if c < len(chunks) - 1:  # the last chunk's k / v would serve no later chunk
            model.stream_forward(ctx, torch.full((n,), float(context_noise), device=device), cond, cache, write=True)
    ids = torch.arange(n, dtype=torch.int64, device=device) + sample_id_offset
    return CausalRollout(x_out, sig[exits_dev], x0_out, ctx_out, cond, exits_dev, ids)


def draw_window(spans: list[tuple[int, int]], frames: int, gen: torch.Generator) -> tuple[int, int]:
    """Chunks [c0, c1) of a rollout in chunk `spans` covering `frames` frames, the window start drawn uniformly
    from `gen` (CPU) among the chunk boundaries where such a window fits (`window_starts`); the whole rollout,
    with no draw, when it is `frames` long (Self-Forcing++'s windows of a rollout past the teacher's horizon)."""
    starts = window_starts(spans, frames)
    if len(starts) == 1:
        c0 = starts[0]
    else:
        c0 = starts[int(torch.randint(0, len(starts), (1,), generator=gen))]
    c1 = next(c for c in range(c0, len(spans)) if spans[c][1] == spans[c0][0] + frames) + 1
    return c0, c1


def window_starts(spans: list[tuple[int, int]], frames: int) -> list[int]:
    """The chunks c0 where a window of `frames` frames starts and ends on chunk boundaries; RolloutError if none."""
    ends = {b for _, b in spans}
    starts = [c for c, (a, _) in enumerate(spans) if a + frames in ends]
    if not starts:
        raise RolloutError(f"no window of {frames} frames starts and ends on the chunk boundaries "
                           f"{[a for a, _ in spans] + [spans[-1][1]]} of the rollout")
    return starts


def replay(model, rollout: CausalRollout, context_noise: float = 0.0, grad_chunks: Optional[int] = None,
           window: Optional[tuple[int, int]] = None) -> Tensor:
    """The rollout's video x0 [n, C, F, H, W] again, with grad through each chunk's exit step only: chunk by chunk,
    x0_c = x_c - sigma_c v(x_c, sigma_c | cache), the cache written without grad from the earlier chunks' contexts
    at `context_noise` (as the rollout wrote it). Equal to the rollout's x0hat (up to float rounding).
    window (c0, c1): only chunks [c0, c1) are returned (`draw_window`); the chunks before c0 only write the cache,
    the chunks after c1 are not run.
    grad_chunks M (--causal-grad-chunks): only the last M chunks (of the window) carry grad (Self-Forcing's
    last-21-frames rule); the others are the rollout's x0hat as they are, with no forward.
    Under --recompute-granularity full or selective (the model's `options.recompute`, in training) each chunk's exit
    forward is checkpointed at that granularity (`models/recompute.py`) against a read-only view of the cache
    (`KVCache.view`) and run again in backward: the replay then holds one chunk's activations (selective: and every
    chunk's attention outputs) at a time instead of every chunk's, whatever the number of chunks."""
    n, cond, out = len(rollout), rollout.cond, []
    spans = model.causal_layout.chunks(rollout.x.shape[2])
    cache = model.new_cache(spans[-1][1])  # sized for the rollout's frames
    level = torch.full((n,), float(context_noise), device=cond.device)
    c0, c1 = window or (0, len(spans))
    first_grad = c0 if grad_chunks is None else max(c0, c1 - grad_chunks)
    how = model.options.recompute if model.training and torch.is_grad_enabled() else "none"
    for c, (a, b) in enumerate(spans[:c1]):
        x, sigma = rollout.x[:, :, a:b], rollout.sigma[:, c]
        if c < c0:
            pass  # before the window: its context only
        elif c < first_grad:
            out.append(rollout.x0hat[:, :, a:b])
        elif how != "none":
            held = cache.view()  # the cache as this chunk read it, for the forward and its rerun in backward
            v = recompute.run(how, lambda x_, s_, held=held: model.stream_forward(x_, s_, cond, held.view()), x, sigma)
            out.append(x - sigma.view(n, 1, 1, 1, 1).to(x.dtype) * v.to(x.dtype))
        else:
            v = model.stream_forward(x, sigma, cond, cache).to(x.dtype)
            out.append(x - sigma.view(n, 1, 1, 1, 1).to(x.dtype) * v)
        if c < c1 - 1:  # the last chunk's k / v would serve no later chunk
            with torch.no_grad():
                model.stream_forward(rollout.context[:, :, a:b], level, cond, cache, write=True)
    return torch.cat(out, dim=2)
