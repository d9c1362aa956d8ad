"""Backward-simulation rollout of the few-step student (DESIGN section 2, "rollout").

Student grid (`flow.student_sigmas`): N points of UNSHIFTED sigma s_0 = 1 > s_1 > ... > s_{N-1} > 0,
by default s_i = (N - i) / N (`--dmd2-denoising-steps N`) or an explicit list (`--dmd2-student-sigmas`),
then shifted: sigma_i = shift_k(s_i) (k = `--timestep-shift`). sigmas: [N] fp32.

One rollout of n samples (n = K*B per DP rank), all under torch.no_grad():
    i_n ~ U{0, ..., N-1}                       stop step of sample n
    x^(0) = eps_0,  eps_0 ~ N(0, I)            pure noise at sigma_0 = 1
    for i = 0 .. i_n:
        v      = student(x^(i), sigma_i, cond)
        x0^(i) = x^(i) - sigma_i v
        i < i_n:  x^(i+1) = (1 - sigma_{i+1}) x0^(i) + sigma_{i+1} eps_{i+1},  eps_{i+1} FRESH noise
    keep x = x^(i_n), sigma = sigma_{i_n}, x0hat = x0^(i_n), cond, sample id, stop step i_n.
Shapes: x, x0hat [n, *shape] (shape = (C, H, W)); sigma [n] fp32; cond [n, ...] (labels [n] int64
or embeddings [n, *cond_shape]); sample_id, stop_step [n] int64. Output rows are in sample order:
row j is sample `sample_id_offset + j` with condition cond[j].

Batched: step i runs ONE student forward on the samples with i_n >= i only, so a rollout costs
sum_n (i_n + 1) sample-forwards. The samples are sorted once by stop step (latest first), which makes
the running set at every step a prefix of the sorted batch: step i reads rows [0, c_i) of one [n] buffer
of inputs (c_i = #{n: i_n >= i}, the running count) and writes rows [0, c_i) of one [n] buffer of x0 and
rows [0, c_{i+1}) of the inputs; rows [c_{i+1}, c_i), the samples that stop at step i, are left holding
their x and x0 (no per-step pieces to concatenate). The stop steps are drawn on the HOST, ahead: a cycle
draws every micro-batch's at its start (`draw_stop_steps`, from each micro-batch's `stop_gen`, a CPU
generator) and copies them to the device in ONE non-blocking pinned copy, so the running counts are known
on the host without waiting for the device: the rollout has no host sync (they are counted with numpy,
which refuses a device tensor).

Shapes: the forward of step i has c_i rows exactly (with `max_batch`: chunks of max_batch rows and one of
c_i mod max_batch), c_i in {1, ..., n}. They are not padded to fixed buckets: the student's GEMMs pick their
kernels (and reduction order) by the row count, so a padded forward need not give bit-equal rows (the debug
DiT's rows on a CPU differ in the last bit between 3 and 16 rows), and results (resume, the golden traces)
must stay bit-identical. Instead the shapes are known ahead: every
(op, shape) a rollout dispatches depends on n, N and the counts c_i only, each in a fixed set of at most n
sizes, known at the cycle's start: a CUDA graph per size can be captured after a warm-up that runs each
size once (`bucket_stop_steps`).

Generator consumption (TP ranks given equal generators produce identical rollouts), in this order and
independent of the stop steps:
    1. stop steps: torch.randint(0, N, (n,)) int64 from `stop_gen` (CPU; default `noise_gen`, which must
       then be a CPU generator), copied to the device without blocking (a cycle draws them for all its
       micro-batches first: each micro-batch has its own generators, so the draws are the same)
    2. from `noise_gen`, on its own device: initial noise eps_0: torch.randn((n, *shape), dtype=dtype)
    3. for each transition i -> i+1, i = 0 .. N-2: torch.randn((n, *shape), dtype=dtype), the FULL
       batch (row j is sample j's fresh noise eps_{i+1}; rows of samples already stopped go unused),
       so the stream and the generator's final state depend on (n, N, shape, dtype) only.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

import dmd2_kernels
from dmd2_mega import flow
from dmd2_mega.errors import RolloutError
from dmd2_mega.distributed.parallel import to_device

StudentFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class Rollout:
    """The kept samples of one rollout, row j = sample `sample_id[j]` (see module docstring)."""

    x: Tensor           # [n, C, H, W]  noisy input at the stop step
    sigma: Tensor       # [n] fp32      sigma at the stop step
    x0hat: Tensor       # [n, C, H, W]  detached student x0 prediction at (x, sigma)
    cond: Tensor        # [n, ...]      positive condition
    sample_id: Tensor   # [n] int64
    stop_step: Tensor   # [n] int64     i_n in [0, N)

    def __len__(self) -> int:
        return self.x.shape[0]

    def micro_batch(self, k: int, size: int) -> "Rollout":
        """Rows [k * size, (k + 1) * size): micro-batch k of size `size`."""
        return micro_batch_rows(self, k, size)


def micro_batch_rows(record, k: int, size: int):
    """Rows [k * size, (k + 1) * size) of every field of a rollout record (a dataclass of per-sample tensors, rows
    first): micro-batch k of size `size`, what DMD2's critic phase steps on."""
    if k < 0 or size < 1 or (k + 1) * size > len(record):
        raise RolloutError(f"micro-batch {k} of size {size} is outside a rollout of {len(record)} samples")
    sl = slice(k * size, (k + 1) * size)
    return replace(record, **{f.name: getattr(record, f.name)[sl] for f in fields(record)})


@dataclass(frozen=True)
class StopSteps:
    """One rollout's stop steps, drawn ahead on the host (module docstring)."""

    host: Tensor                # [n] int64 on the CPU
    device: Tensor              # [n] int64 on the compute device (a row of one non-blocking copy)
    counts: tuple[int, ...]     # [N + 1] running counts: counts[i] = #samples with stop >= i, counts[N] = 0


def _running_counts(stop_host: Tensor, steps: int) -> tuple[int, ...]:
    """[N + 1] ints: counts[i] = #samples with stop >= i (counts[N] = 0), from the host stop steps."""
    per_step = np.bincount(stop_host.numpy(), minlength=steps)  # .numpy() raises on a device tensor: no sync
    return tuple(int(c) for c in per_step[::-1].cumsum()[::-1]) + (0,)


def draw_stop_steps(gens: Sequence[torch.Generator], n: int, steps: int, device) -> list[StopSteps]:
    """Each rollout's n stop steps U{0..N-1} from its CPU generator (in `gens` order), copied to `device` in ONE
    non-blocking pinned copy: what a cycle draws at its start for all its micro-batches."""
    for g in gens:
        if g.device.type != "cpu":
            raise RolloutError(f"the stop steps are drawn on the host: pass a CPU stop_gen (got a generator on "
                               f"{g.device})")
    return stop_steps_on(torch.stack([torch.randint(0, steps, (n,), generator=g) for g in gens]), steps, device)


def stop_steps_on(host: Tensor, steps: int, device) -> list[StopSteps]:
    """Host stop steps [rollouts, n] int64 as each rollout's `StopSteps`, copied to `device` in ONE non-blocking
    pinned copy (rows of it)."""
    dev = to_device(host, torch.device(device))
    return [StopSteps(host[k], dev[k], _running_counts(host[k], steps)) for k in range(host.shape[0])]


def bucket_stop_steps(n: int, steps: int) -> Tensor:
    """[n, n] host stop steps, row c - 1 = c samples stopping at the last step and n - c at the first: the n rollouts
    of n samples over N steps that together run every forward size a rollout can run (n at step 0, each c in 1..n
    after it): the warm-up before capturing a graph per shape (module docstring; `stop_steps_on` places them)."""
    return torch.tensor([[steps - 1] * c + [0] * (n - c) for c in range(1, n + 1)], dtype=torch.int64)


def _forward(student: StudentFn, x: Tensor, sigma: Tensor, cond: Tensor, max_batch: Optional[int]) -> Tensor:
    """student(x, sigma, cond), in chunks of at most `max_batch` rows (one call when they fit). Each chunk's output is
    copied out before the next call: under --cuda-graphs chunks of one size replay one graph, which writes every
    output into the same buffer (models/cuda_graphs.py)."""
    c = x.shape[0]
    if not max_batch or max_batch >= c:
        return student(x, sigma, cond)
    out = None
    for a in range(0, c, max_batch):
        v = student(x[a:a + max_batch], sigma[a:a + max_batch], cond[a:a + max_batch])
        if out is None:
            out = v.new_empty((c, *v.shape[1:]))
        out[a:a + v.shape[0]] = v
    return out


@torch.no_grad()
def rollout(student: StudentFn, noise_gen: torch.Generator, batch: int, cond: Tensor, sigmas: Tensor, *,
            shape: Sequence[int], device, sample_id_offset: int = 0,
            dtype: torch.dtype = torch.float32, max_batch: Optional[int] = None,
            stop_gen: Optional[torch.Generator] = None, stops: Optional[StopSteps] = None,
            last_step: Optional[Callable[[], None]] = None,
            pin: Optional[Callable[[Tensor, Tensor], Tensor]] = None) -> Rollout:
    """Backward simulation of `batch` samples; see the module docstring for maths and RNG order.

    student(x [m, *shape], sigma [m] fp32, cond [m, ...]) -> v [m, *shape]; cond [batch, ...];
    sigmas [N] descending (from `student_sigmas`); x and the noise are `dtype` on `device`.
    max_batch: run each step's forward in chunks of at most this many rows (None: one forward).
    stop_gen: the CPU generator of the stop steps (None: `noise_gen`, then required to be on the CPU).
    stops: the stop steps drawn ahead (`draw_stop_steps`, a cycle's); None: drawn here from `stop_gen`.
    last_step: called as the last step starts (the cycle's prefetch of the next phase's roles, `roles.ahead`).
    pin: pin(x0hat, cond) -> x0hat with what the condition fixes put back (`FamilyModel.pin_given`: a first-frame
    I2V image), as the student's own sampler returns its samples: the kept x0hat is what the critic trains on, the
    GAN head's fakes and the scores' x0 all are. The steps' re-noising uses the unpinned x0, as the sampler does.
    On a CPU, forwards of B rows are faster per sample than one of K*B (cache); the result is the same.
    """
    if batch < 1:
        raise RolloutError(f"rollout batch must be >= 1, got {batch}")
    if sigmas.ndim != 1 or sigmas.numel() < 1:
        raise RolloutError(f"sigmas must be a 1-D [N] tensor with N >= 1, got shape {tuple(sigmas.shape)}")
    if cond.shape[0] != batch:
        raise RolloutError(f"cond must have the rollout batch {batch} as its first dim, got {tuple(cond.shape)}")
    n, steps, full = batch, sigmas.numel(), (batch, *shape)
    if stops is None:
        stops = draw_stop_steps([noise_gen if stop_gen is None else stop_gen], n, steps, device)[0]
    elif tuple(stops.host.shape) != (n,) or len(stops.counts) != steps + 1:
        raise RolloutError(f"stop steps drawn for {tuple(stops.host.shape)} samples over {len(stops.counts) - 1} "
                           f"steps, not this rollout's {n} samples over {steps}")
    gdev = noise_gen.device

    def noise() -> Tensor:
        return torch.randn(full, generator=noise_gen, device=gdev, dtype=dtype).to(device)

    stop, counts = stops.device, stops.counts
    eps0 = noise()
    sig = sigmas.to(device=device, dtype=torch.float32)
    # Latest stop first: the samples running at step i are the first counts[i] sorted rows.
    order = torch.argsort(stop, descending=True, stable=True)
    cond_sorted = cond.to(device).index_select(0, order)
    x = eps0.index_select(0, order)  # [n] sorted: rows [counts[i + 1], counts[i]) keep their step-i input
    x0 = torch.empty_like(x)         # [n] sorted: rows [counts[i + 1], counts[i]) keep their step-i x0
    for i in range(steps):
        c, c_next = counts[i], counts[i + 1]
        if i == steps - 1 and last_step is not None:
            last_step()
        if c > 0:
            s_i = sig[i].repeat(c)
            v = _forward(student, x[:c], s_i, cond_sorted[:c], max_batch).to(dtype)
            x0[:c] = dmd2_kernels.x0_from_velocity(x[:c], v, s_i)
        if i + 1 < steps:
            eps = noise()                    # fresh draw of the full batch, used or not
            if c_next > 0:
                x[:c_next] = flow.add_noise(x0[:c_next], eps.index_select(0, order[:c_next]),
                                            sig[i + 1].repeat(c_next))
    inverse = torch.argsort(order)  # undo the sort
    sample_id = torch.arange(n, dtype=torch.int64, device=device) + sample_id_offset
    x0hat, cond = x0.index_select(0, inverse), cond.to(device)
    return Rollout(x=x.index_select(0, inverse), sigma=sig.index_select(0, stop),
                   x0hat=x0hat if pin is None else pin(x0hat, cond), cond=cond, sample_id=sample_id, stop_step=stop)
