"""Sampling trained models across DP ranks (eval during training and launch/sample.py).

Teacher (`generate`): Euler integration of the velocity ODE from sigma = 1 to 0 (flow.euler_sampler,
CFG batched). Student (`generate_student`): the few-step DMD2 sampler on the student grid
sigma_0 = 1 > ... > sigma_{N-1}:  x0 = x - sigma_i v(x, sigma_i);  x <- (1 - sigma_{i+1}) x0 +
sigma_{i+1} eps_{i+1} with fresh eps; the output is the last x0.
All noise [N, ...] is drawn up front from one seeded CPU generator on every rank (the result does
not depend on the DP size); each DP rank integrates its contiguous slice, TP ranks of a group run
the same slice together (their layers are sharded), and the slices are all-gathered over DP.
Outputs: images [N, C, H, W] float32 on the CPU, clamped to the data range [-1, 1].

`sample_batches` (launch/sample.py) makes the same samples batch by batch, reading that noise with `SeededNoise`
in O(batch) memory.
Streaming evaluation (launch/eval_fid.py) draws noise per sample instead: `keyed_noise` gives sample i the
draws of its own generator, seeded by (seed, i) through numpy's SeedSequence, so a sample does not depend on
the number of ranks, on the batch it runs in or on the other samples, and nothing of size N is ever held.
`checkpoint_sampler` reads which sampler a checkpoint takes (launch/sample.py's rules: a payload with
"student_sigmas" is a DMD2 student) into a `Sampler`, which maps noise [draws, B, ...] to samples [B, ...];
`load_sampling_model` builds the model of a checkpoint with its EMA or raw weights.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

import dmd2_kernels
from dmd2_mega import flow
from dmd2_mega.errors import CheckpointError, ConfigError


def eval_conditions(dataset, n: int, start: int = 0) -> torch.Tensor:
    """The conditions of samples start .. start + n - 1: class-balanced labels 0..K-1 repeated, the data's own
    balanced prompts (`balanced_conditions(n, start)`, e.g. moving digits: all (digit, direction) pairs in turn),
    or the data's condition embeddings in order, repeated."""
    if dataset.num_classes is not None:
        return torch.arange(start, start + n) % dataset.num_classes
    if hasattr(dataset, "balanced_conditions"):
        return dataset.balanced_conditions(n, start)
    idx = torch.arange(start, start + n) % len(dataset)
    return dataset.get_batch(idx)[1].float()  # shard sets keep their stored dtype (e.g. bf16)


def _dp_map(fn, n: int, shape: tuple, device, dp_rank: int, dp_size: int, dp_group) -> torch.Tensor:
    """Run fn(lo, hi) -> [hi - lo, *shape] on this rank's slice and all-gather the slices over DP on the
    compute device (one path for NCCL and gloo); one copy to the host at the end."""
    per = -(-n // dp_size)
    lo, hi = min(dp_rank * per, n), min((dp_rank + 1) * per, n)
    out = torch.zeros((per, *shape), dtype=torch.float32, device=device)
    if hi > lo:
        out[: hi - lo] = fn(lo, hi).float().clamp_(-1, 1)
    if dp_size > 1:
        gathered = [torch.empty_like(out) for _ in range(dp_size)]
        dist.all_gather(gathered, out, group=dp_group)
        out = torch.cat(gathered)
    return out[:n].cpu()


def _eval_mode(model):
    was = model.training
    model.eval()
    return was


@torch.no_grad()
def generate(model, cond: torch.Tensor, *, shape: tuple, steps: int, guidance: float, shift: float,
             seed: int, device: torch.device, dp_rank: int = 0, dp_size: int = 1, dp_group=None,
             null_cond: torch.Tensor = None) -> torch.Tensor:
    """Teacher samples for `cond` [N, ...] with `steps` Euler steps and CFG `guidance`."""
    n = cond.shape[0]
    noise = torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))
    was = _eval_mode(model)

    def run(lo, hi):
        c = cond[lo:hi].to(device)
        nc = null_cond[lo:hi].to(device) if null_cond is not None else model.negative_for(c)
        return model.pin_given(flow.euler_sampler(model, noise[lo:hi].to(device), c, nc if guidance != 1.0 else None,
                                                  steps=steps, guidance=guidance, shift=shift), c)

    out = _dp_map(run, n, shape, device, dp_rank, dp_size, dp_group)
    model.train(was)
    return out


@torch.no_grad()
def few_step_sample(model, noise: torch.Tensor, cond: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """noise [N_steps, B, ...]: noise[0] the start, noise[i] the fresh draw re-noising to sigma_i."""
    x, x0 = noise[0], None
    b = x.shape[0]
    for i, s in enumerate(sigmas.tolist()):
        sig = torch.full((b,), s, device=x.device, dtype=torch.float32)
        x0 = dmd2_kernels.x0_from_velocity(x, model(x, sig, cond).to(x.dtype), sig)
        if i + 1 < len(sigmas):
            x = flow.add_noise(x0, noise[i + 1], sigmas[i + 1].expand(b).to(x.device))
    return x0


def stream_student(model, noise: torch.Tensor, cond: torch.Tensor, sigmas: torch.Tensor, context_noise: float = 0.0):
    """A causal student's streaming generation (`FamilyModel.stream`): yields x0 chunk by chunk, each chunk
    sampled with the few-step sampler on `sigmas` against the KV cache. noise [draws, B, C, F, H, W]: draws =
    len(sigmas) (the start and the re-noising draws), plus one when context_noise > 0 (the cache re-run's)."""
    steps = len(sigmas)

    def denoise(predict, draws):
        return few_step_sample(predict, draws[:steps], cond, sigmas)
    return model.stream(noise, cond, denoise, context_noise)


@torch.no_grad()
def generate_student(model, cond: torch.Tensor, sigmas: torch.Tensor, *, shape: tuple, seed: int,
                     device: torch.device, dp_rank: int = 0, dp_size: int = 1, dp_group=None) -> torch.Tensor:
    """Student samples for `cond` [N, ...] on the student grid `sigmas` [N_steps]."""
    n = cond.shape[0]
    noise = torch.randn((len(sigmas), n, *shape), generator=torch.Generator().manual_seed(seed))
    was = _eval_mode(model)
    def run(lo, hi):
        c = cond[lo:hi].to(device)
        return model.pin_given(few_step_sample(model, noise[:, lo:hi].to(device), c, sigmas.to(device)), c)
    out = _dp_map(run, n, shape, device, dp_rank, dp_size, dp_group)
    model.train(was)
    return out


class SeededNoise:
    """`torch.randn((draws, n, *shape), generator=torch.Generator().manual_seed(seed))`, the noise `generate` and
    `generate_student` draw up front, read batch by batch (`take`) while holding O(batch) values.

    How torch fills a float32 CPU tensor of M >= 16 normals: M uniforms u_0 .. u_{M-1} from the generator, turned
    into normals 16 at a time (Box-Muller within each aligned block of 16); when 16 does not divide M, the last 16
    values are redrawn from 16 further uniforms. So a value at position p < L (L = M, or the last aligned position
    at least 16 before M) depends only on its block, and `torch.randn(k)` from a generator that has consumed an
    aligned p0 <= L uniforms gives positions p0 .. p0 + k (k a multiple of 16), or for p0 = L and k = M - L the
    exact tail. Each of the `draws` rows [n, *shape] is read by its own cursor: a generator advanced once, in
    bounded chunks, to the row's block. tests/test_sampling_stream.py checks the equality bit for bit."""

    CHUNK = 1 << 20  # values drawn at a time while advancing a generator (a multiple of 16)

    def __init__(self, seed: int, n: int, shape: tuple, draws: int = 1):
        self.n, self.shape, self.draws, self.row = n, tuple(shape), draws, n * math.prod(shape)
        self.total = draws * self.row
        self.safe = self.total if self.total % 16 == 0 else max(self.total // 16 * 16 - 16, 0)
        walker, pos = torch.Generator().manual_seed(seed), 0
        self.cursors = []
        for d in range(draws):  # one pass: cursor d starts at row d's block
            start = d * self.row
            aligned = min(start // 16 * 16, self.safe)
            while pos < aligned:
                k = min(self.CHUNK, aligned - pos)
                torch.randn(k, generator=walker)
                pos += k
            gen = torch.Generator()
            gen.set_state(walker.get_state())
            cursor = [gen, pos, torch.empty(0)]  # generator, its position, the values drawn past the reads
            self._read(cursor, start - aligned)  # skip into the row
            self.cursors.append(cursor)
        self.done = 0

    def _read(self, cursor: list, k: int) -> torch.Tensor:
        gen, pos, buf = cursor
        parts, have = [buf], buf.numel()
        while have < k:
            if pos < self.safe:  # plain blocks
                m = min(self.safe - pos, -(-(k - have) // 16) * 16)
            else:  # the tail, in one draw as the full tensor makes it
                m = self.total - pos
            parts.append(torch.randn(m, generator=gen))
            pos, have = pos + m, have + m
        out = torch.cat(parts)
        cursor[1], cursor[2] = pos, out[k:].clone()
        return out[:k]

    def take(self, b: int) -> torch.Tensor:
        """The next b samples' noise [draws, b, *shape] (samples done .. done + b - 1)."""
        if self.done + b > self.n:
            raise RuntimeError(f"noise for {self.n} samples: {self.done} taken, {b} more asked")
        self.done += b
        size = b * math.prod(self.shape)
        return torch.stack([self._read(c, size).view(b, *self.shape) for c in self.cursors])


@torch.no_grad()
def sample_batches(model, sampler: "Sampler", n: int, cond_of, *, shape: tuple, seed: int, batch_size: int,
                   device: torch.device, dp_rank: int = 0, dp_size: int = 1, dp_group=None):
    """Yield (lo, samples [hi - lo, *shape] float32 on the CPU, in [-1, 1]) for samples lo .. hi - 1 in order,
    `batch_size` per DP rank at a time; `cond_of(lo, hi)` gives their conditions. The noise is `SeededNoise`, so
    the samples are `generate` / `generate_student`'s (bit for bit when one batch holds all n; otherwise up to
    float rounding of forwards at another batch size) and memory is O(batch), whatever n."""
    noise = SeededNoise(seed, n, shape, sampler.draws)
    was = _eval_mode(model)
    try:
        for lo in range(0, n, batch_size * dp_size):
            hi = min(lo + batch_size * dp_size, n)
            z, c = noise.take(hi - lo), cond_of(lo, hi)
            yield lo, _dp_map(lambda a, b: sampler(model, z[:, a:b].to(device), c[a:b].to(device)), hi - lo, shape,
                              device, dp_rank, dp_size, dp_group)
    finally:
        model.train(was)


# ---- checkpoints and samplers shared by launch/sample.py and launch/eval_fid.py -------------------------
# The checkpoint and model-building imports are deferred into the functions that use them: they pull in
# megatron-core (seconds of start-up), which the samplers above, imported by eval.media, do not need.

def check_out_dir(out: str, flag: str = "--out", what: str = "samples.npz and grid.png") -> None:
    """ConfigError if `out`, or the nearest of its parents that exists, is a file rather than a directory."""
    p = os.path.abspath(out)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        where = "" if p == os.path.abspath(out) else f": {p!r}"
        raise ConfigError(f"{flag} {out!r}{where} is an existing file; expected a directory (for {what})")


def add_sampler_flags(p) -> None:
    """--steps, --guidance and --shift of an argparse parser (sample.py, eval_fid.py; checked by
    `check_sampler_flags`); the guidance default is the trainers' --eval-guidance."""
    from dmd2_mega.config import TrainConfig
    g = TrainConfig.eval_guidance
    p.add_argument("--steps", type=int, default=None,
                   help="teacher: Euler steps (default 50); DMD2 student: default its own saved schedule")
    p.add_argument("--guidance", type=float, default=g,
                   help=f"teacher CFG scale (default {g:g}, as the trainers' --eval-guidance; students ignore it)")
    p.add_argument("--shift", type=float, default=None, help="default: the checkpoint's --timestep-shift")


def check_sampler_flags(steps: Optional[int], guidance: float, shift: Optional[float]) -> None:
    """ConfigError naming --steps / --guidance / --shift when one is out of range (sample.py, eval_fid.py)."""
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if not (math.isfinite(guidance) and guidance >= 1):
        raise ConfigError(f"--guidance must be a finite number >= 1, got {guidance}")
    if shift is not None and not (math.isfinite(shift) and shift > 0):
        raise ConfigError(f"--shift must be a finite number > 0, got {shift}")


def check_checkpoint(load: str, iteration: Optional[int]) -> None:
    """CheckpointError unless --load is a checkpoint directory holding --iteration (default: its latest)."""
    from dmd2_mega.train.checkpoint import iter_dir, latest_iteration
    latest = latest_iteration(load)  # CheckpointError if --load is missing or a file
    if iteration is None:
        if latest is None:
            raise CheckpointError(f"--load {load} holds no checkpoint (no latest_checkpointed_iteration.txt)")
        return
    d = iter_dir(load, iteration)
    if not (os.path.isdir(d) or os.path.isdir(d + ".old")):
        saved = sorted(n for n in os.listdir(load) if n.startswith("iter_") and n[5:].isdigit())
        raise CheckpointError(f"--iteration {iteration}: --load {load} holds no {os.path.basename(d)} "
                              f"(saved: {', '.join(saved[-10:]) or 'none'}; latest: {latest})")


def load_sampling_model(payload: dict, info: dict, ps, *, no_ema: bool = False, bf16: bool = False,
                        source: str = "--load", negative: Optional[torch.Tensor] = None):
    """(model, "EMA weights" | "raw weights"): the checkpoint's model at this rank's TP degree, with a DMD2
    student's EMA (saved beside the weights under the same names) in place of its weights unless `no_ema`; a LoRA
    student's adapters merged into their base (`train/lora_checkpoint.merged_payload`)."""
    from dmd2_mega.train.builders import build_model, cast_model
    from dmd2_mega.train.checkpoint import load_model_weights
    from dmd2_mega.config import ModelConfig
    from dmd2_mega.train.lora_checkpoint import merged_payload
    payload = merged_payload(payload, ps, source)  # a LoRA student: its adapters merged into their base
    model = build_model(ModelConfig.saved(payload["args"]).weights_only(), info, ps, negative=negative)
    state, weights = payload["model"], "raw weights"
    if "ema" in payload and not no_ema:
        state, weights = {**state, **payload["ema"]}, "EMA weights"
    load_model_weights(model, state, source)
    return cast_model(model, bf16), weights


@dataclass(frozen=True)
class Sampler:
    """A DMD2 student's few-step sampler on `sigmas` [steps] (no CFG), or (sigmas None) the teacher's Euler
    sampler with `steps` steps, CFG `guidance` and timestep `shift`. `stream`: a causal student generates chunk
    by chunk (`stream_student`, cache re-runs at `context_noise`), calling on_chunk(x0 chunk, first frame) as each
    chunk is done."""
    sigmas: Optional[torch.Tensor]
    steps: int
    guidance: float
    shift: float
    stream: bool = False
    context_noise: float = 0.0
    on_chunk: Optional[Callable] = field(default=None, compare=False)

    @property
    def student(self) -> bool:
        return self.sigmas is not None

    @property
    def draws(self) -> int:
        """Noise draws per sample: the start and one fresh draw per later student step (and a streamed chunk's
        cache re-run above level 0); 1 for Euler."""
        return len(self.sigmas) + (self.stream and self.context_noise > 0) if self.student else 1

    def describe(self) -> str:
        if self.stream:
            return f"causal student streaming, {self.steps} steps per chunk, cache at level {self.context_noise:g}"
        if self.student:
            return f"student {self.steps} steps"
        return f"teacher {self.steps} Euler steps, guidance {self.guidance:g}, shift {self.shift:g}"

    @torch.no_grad()
    def __call__(self, model, noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """noise [draws, B, *shape] and cond [B, ...] on the model's device -> samples [B, *shape] in [-1, 1]."""
        if self.stream:
            chunks, first = [], 0
            for x0 in stream_student(model, noise, cond, self.sigmas.to(noise.device), self.context_noise):
                chunks.append(x0.float().clamp_(-1, 1))
                if self.on_chunk is not None:
                    self.on_chunk(chunks[-1], first)
                first += x0.shape[-3]
            return torch.cat(chunks, dim=-3)
        if self.student:
            x0 = few_step_sample(model, noise, cond, self.sigmas.to(noise.device))
        else:
            null = model.negative_for(cond) if self.guidance != 1.0 else None
            x0 = flow.euler_sampler(model, noise[0], cond, null, steps=self.steps, guidance=self.guidance,
                                    shift=self.shift)
        return model.pin_given(x0, cond).float().clamp_(-1, 1)


def checkpoint_sampler(payload: dict, steps: Optional[int], guidance: float, shift: Optional[float],
                       stream: bool = False, on_chunk: Optional[Callable] = None) -> Sampler:
    """A DMD2 student (its payload holds "student_sigmas"): its saved grid, or with `steps` the shifted `steps`-point
    grid; guidance 1. A teacher: `steps` (default 50) Euler steps with CFG `guidance`. `shift` defaults to the
    checkpoint's --timestep-shift. `stream`: a causal checkpoint's streaming sampler (its saved grid, else the
    `steps`-point grid, default 4), its cache re-run at the checkpoint's --causal-context-noise."""
    from dmd2_mega.config import ModelConfig
    if shift is None:
        shift = (payload["args"].get("train") or {}).get("timestep_shift", 1.0)
    if stream:
        saved = ModelConfig.saved(payload["args"])
        if not saved.causal:
            raise ConfigError("--stream needs a causal checkpoint (one trained or initialised with --causal); this "
                              "one attends over the whole clip")
        sigmas = (torch.tensor(payload["student_sigmas"], dtype=torch.float32)
                  if "student_sigmas" in payload and steps is None else flow.student_sigmas(steps or 4, None, shift))
        return Sampler(sigmas, len(sigmas), 1.0, shift, True, saved.causal_context_noise, on_chunk)
    if "student_sigmas" in payload:
        sigmas = (torch.tensor(payload["student_sigmas"], dtype=torch.float32) if steps is None
                  else flow.student_sigmas(steps, None, shift))
        return Sampler(sigmas, len(sigmas), 1.0, shift)
    return Sampler(None, steps or 50, guidance, shift)


def sample_seed(seed: int, index: int) -> int:
    """The 64-bit seed of sample `index`'s generator: numpy SeedSequence((seed, index)), so nearby (seed, index)
    pairs give unrelated streams (seed * N + index would make (0, N) and (1, 0) collide)."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1, np.uint64)[0])


def keyed_noise(seed: int, indices: Sequence[int], shape: tuple, draws: int = 1) -> torch.Tensor:
    """[draws, len(indices), *shape] float32 standard normal on the CPU; column j is `draws` x `shape` values
    from sample indices[j]'s own generator (`sample_seed`), whatever the other indices."""
    if len(indices) == 0:
        return torch.empty((draws, 0, *shape))
    cols = [torch.randn((draws, *shape), generator=torch.Generator().manual_seed(sample_seed(seed, int(i))))
            for i in indices]
    return torch.stack(cols, dim=1)
