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
the running set at every step a prefix of the sorted batch. The stop steps are drawn on the HOST
(`stop_gen`, a CPU generator), so the prefix lengths are known there without waiting for the device:
the rollout has no host sync (they are counted with numpy, which refuses a device tensor).

Generator consumption (TP ranks given equal generators produce identical rollouts), in this order and
independent of the stop steps:
    1. stop steps: torch.randint(0, N, (n,)) int64 from `stop_gen` (CPU; default `noise_gen`, which must
       then be a CPU generator), copied to the device without blocking
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

import kernels
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


def _running_counts(stop_host: Tensor, steps: int) -> list[int]:
    """[N + 1] ints: counts[i] = #samples with stop >= i (counts[N] = 0), from the host stop steps."""
    per_step = np.bincount(stop_host.numpy(), minlength=steps)  # .numpy() raises on a device tensor: no sync
    return [int(c) for c in per_step[::-1].cumsum()[::-1]] + [0]


@torch.no_grad()
def rollout(student: StudentFn, noise_gen: torch.Generator, batch: int, cond: Tensor, sigmas: Tensor, *,
            shape: Sequence[int], device, sample_id_offset: int = 0,
            dtype: torch.dtype = torch.float32, max_batch: Optional[int] = None,
            stop_gen: Optional[torch.Generator] = None) -> Rollout:
    """Backward simulation of `batch` samples; see the module docstring for maths and RNG order.

    student(x [m, *shape], sigma [m] fp32, cond [m, ...]) -> v [m, *shape]; cond [batch, ...];
    sigmas [N] descending (from `student_sigmas`); x and the noise are `dtype` on `device`.
    max_batch: run each step's forward in chunks of at most this many rows (None: one forward).
    stop_gen: the CPU generator of the stop steps (None: `noise_gen`, then required to be on the CPU).
    On a CPU, forwards of B rows are faster per sample than one of K*B (cache); the result is the same.
    """
    if batch < 1:
        raise RolloutError(f"rollout batch must be >= 1, got {batch}")
    if sigmas.ndim != 1 or sigmas.numel() < 1:
        raise RolloutError(f"sigmas must be a 1-D [N] tensor with N >= 1, got shape {tuple(sigmas.shape)}")
    if cond.shape[0] != batch:
        raise RolloutError(f"cond must have the rollout batch {batch} as its first dim, got {tuple(cond.shape)}")
    n, steps, full = batch, sigmas.numel(), (batch, *shape)
    gdev = noise_gen.device
    stop_gen = noise_gen if stop_gen is None else stop_gen
    if stop_gen.device.type != "cpu":
        raise RolloutError(f"the stop steps are drawn on the host: pass a CPU stop_gen (got a generator on "
                           f"{stop_gen.device})")

    def noise() -> Tensor:
        return torch.randn(full, generator=noise_gen, device=gdev, dtype=dtype).to(device)

    stop_host = torch.randint(0, steps, (n,), generator=stop_gen)
    stop = to_device(stop_host, torch.device(device))
    eps0 = noise()
    sig = sigmas.to(device=device, dtype=torch.float32)
    # Latest stop first: the samples running at step i are the first counts[i] sorted rows.
    order = torch.argsort(stop, descending=True, stable=True)
    counts = _running_counts(stop_host, steps)
    cond_sorted = cond.to(device).index_select(0, order)
    x = eps0.index_select(0, order)
    kept_x, kept_x0 = [], []
    for i in range(steps):
        c, c_next = counts[i], counts[i + 1]
        if c > 0:
            s_i = sig[i].repeat(c)
            step = c if not max_batch else max_batch
            v = torch.cat([student(x[a:min(a + step, c)], s_i[a:min(a + step, c)], cond_sorted[a:min(a + step, c)])
                           for a in range(0, c, step)]).to(dtype)
            x0 = kernels.x0_from_velocity(x[:c], v, s_i)
            kept_x.append(x[c_next:c])       # rows that stop at step i
            kept_x0.append(x0[c_next:c])
        if i + 1 < steps:
            eps = noise()                    # fresh draw of the full batch, used or not
            if c_next > 0:
                x = flow.add_noise(x0[:c_next], eps.index_select(0, order[:c_next]), sig[i + 1].repeat(c_next))
    # Pieces of steps N-1, ..., 0 are consecutive row ranges of the sorted order; undo the sort.
    inverse = torch.argsort(order)
    x_out = torch.cat(kept_x[::-1]).index_select(0, inverse)
    x0_out = torch.cat(kept_x0[::-1]).index_select(0, inverse)
    sample_id = torch.arange(n, dtype=torch.int64, device=device) + sample_id_offset
    return Rollout(x=x_out, sigma=sig.index_select(0, stop), x0hat=x0_out, cond=cond.to(device),
                   sample_id=sample_id, stop_step=stop)
