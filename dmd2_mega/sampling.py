"""Sampling trained models across DP ranks (eval during training and launch/sample.py).

Teacher (`generate`): Euler integration of the velocity ODE from sigma = 1 to 0 (flow.euler_sampler,
CFG batched). Student (`generate_student`): the few-step DMD2 sampler on the student grid
sigma_0 = 1 > ... > sigma_{N-1}:  x0 = x - sigma_i v(x, sigma_i);  x <- (1 - sigma_{i+1}) x0 +
sigma_{i+1} eps_{i+1} with fresh eps; the output is the last x0.
All noise [N, ...] is drawn up front from one seeded CPU generator on every rank (the result does
not depend on the DP size); each DP rank integrates its contiguous slice, TP ranks of a group run
the same slice together (their layers are sharded), and the slices are all-gathered over DP.
Outputs: images [N, C, H, W] float32 on the CPU, clamped to the data range [-1, 1].
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import kernels
from dmd2_mega import flow


def eval_conditions(dataset, n: int) -> torch.Tensor:
    """Class-balanced labels 0..K-1 repeated, the data's own balanced prompts (`balanced_conditions(n)`, e.g.
    moving digits: all (digit, direction) pairs in turn), or the first n condition embeddings of the data."""
    if dataset.num_classes is not None:
        return torch.arange(n) % dataset.num_classes
    if hasattr(dataset, "balanced_conditions"):
        return dataset.balanced_conditions(n)
    idx = torch.arange(n) % len(dataset)
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
        nc = null_cond[lo:hi].to(device) if null_cond is not None else model.null_cond(hi - lo, device)
        return flow.euler_sampler(model, noise[lo:hi].to(device), c, nc if guidance != 1.0 else None,
                                  steps=steps, guidance=guidance, shift=shift)

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
        x0 = kernels.x0_from_velocity(x, model(x, sig, cond).to(x.dtype), sig)
        if i + 1 < len(sigmas):
            x = flow.add_noise(x0, noise[i + 1], sigmas[i + 1].expand(b).to(x.device))
    return x0


@torch.no_grad()
def generate_student(model, cond: torch.Tensor, sigmas: torch.Tensor, *, shape: tuple, seed: int,
                     device: torch.device, dp_rank: int = 0, dp_size: int = 1, dp_group=None) -> torch.Tensor:
    """Student samples for `cond` [N, ...] on the student grid `sigmas` [N_steps]."""
    n = cond.shape[0]
    noise = torch.randn((len(sigmas), n, *shape), generator=torch.Generator().manual_seed(seed))
    was = _eval_mode(model)
    out = _dp_map(lambda lo, hi: few_step_sample(model, noise[:, lo:hi].to(device), cond[lo:hi].to(device),
                                                 sigmas.to(device)), n, shape, device, dp_rank, dp_size, dp_group)
    model.train(was)
    return out
