"""Flow-matching maths (DESIGN section 1), pure torch.

Shapes: data x0 and noise eps are [B, *D]; the noise level sigma is a [B] tensor (one value per
sample) broadcast over D by `expand_like` to [B, 1, ..., 1].

    x_sigma = (1 - sigma) * x0 + sigma * eps          (sigma = 0: data, sigma = 1: noise)
    v       = eps - x0                                (= d x_sigma / d sigma)
    x0      = x_sigma - sigma * v                      (the fused `dmd2_kernels.x0_from_velocity`)
    eps     = x_sigma + (1 - sigma) * v
    shift_k(s) = k s / (1 + (k - 1) s) = k s / (k s + 1 - s)      (k > 0; k > 1 pushes toward noise)
    CFG:    v = v_neg + g * (v_pos - v_neg)           (g = 1: no guidance, no negative forward)

A grid is N points of UNSHIFTED sigma in (0, 1], s_i = (N - i) / N (`unshifted_grid`), shifted for
use. Three grids are built from it here: the Euler sampler's (`sigma_grid`), the few-step student's
(`student_sigmas`, or an explicit list) and DMD2's critic grid with its score-range mask (`critic_grid`).
Sampling integrates dx/dsigma = v(x, sigma) from sigma = 1 (x = noise) down to sigma = 0 with
Euler steps: `euler_path` over any explicit grid, keeping the states asked for; `euler_sampler` over the
sampler's grid; teacher ODE trajectories over `trajectory_grid`, the sampler's grid through the student's points.
The model receives sigma itself (a [B] fp32 tensor); the timestep sigma * 1000 is the model's business.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from dmd2_mega.errors import FlowError, GridError


def expand_like(sigma: Tensor, x: Tensor) -> Tensor:
    """[B] (or 0-d) sigma -> [B, 1, ..., 1] with x.ndim dims, to broadcast against x [B, *D]."""
    if not isinstance(sigma, Tensor):
        raise FlowError(f"sigma must be a torch.Tensor of shape [B], got {type(sigma).__name__}")
    if sigma.ndim == 0:
        return sigma
    if sigma.ndim != 1 or sigma.shape[0] != x.shape[0]:
        raise FlowError(f"sigma must have shape [B] = [{x.shape[0]}] to match x {tuple(x.shape)}, "
                        f"got {tuple(sigma.shape)}")
    return sigma.reshape(-1, *([1] * (x.ndim - 1)))


def add_noise(x0: Tensor, eps: Tensor, sigma: Tensor) -> Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps. x0, eps [B, *D]; sigma [B]. Returns x0.dtype."""
    s = expand_like(sigma, x0)
    return ((1 - s) * x0 + s * eps).to(x0.dtype)


def draw_sigma(gen: torch.Generator, n: int, choices: Tensor) -> Tensor:
    """n sigmas drawn uniformly from the 1-D tensor `choices` (on the generator's device)."""
    idx = torch.randint(0, choices.numel(), (n,), generator=gen, device=gen.device)
    return choices.to(gen.device)[idx]


def noise_on_grid(x0: Tensor, gen: torch.Generator, choices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x_sigma, sigma [B], eps): sigma ~ U{choices}, then eps ~ N(0, I), both drawn from `gen` in that
    order (on the generator's device, then moved to x0's)."""
    sigma = draw_sigma(gen, x0.shape[0], choices).to(x0.device)
    eps = torch.randn(x0.shape, generator=gen, device=gen.device, dtype=x0.dtype).to(x0.device)
    return add_noise(x0, eps, sigma), sigma, eps


def velocity_target(x0: Tensor, eps: Tensor) -> Tensor:
    """v = eps - x0, the flow-matching regression target. [B, *D]."""
    return eps - x0


def _check_shift(k: float) -> float:
    k = float(k)
    if not k > 0:  # also rejects nan
        raise FlowError(f"timestep shift factor must be > 0, got {k}")
    return k


def shift_sigma(s: Union[Tensor, float], k: float) -> Union[Tensor, float]:
    """shift_k(s) = k s / (k s + 1 - s), elementwise; s a tensor or a float in [0, 1].

    Exact at the ends (0 -> 0, 1 -> 1), monotone increasing, identity for k = 1, > s for k > 1
    on (0, 1). Written as k s / (k s + 1 - s), equal to k s / (1 + (k - 1) s), so s = 1 gives 1 exactly.
    """
    k = _check_shift(k)
    if k == 1.0:
        return s
    return k * s / (k * s + (1 - s))


def unshifted_grid(n: int, flag: str = "grid size n") -> Tensor:
    """[n] float64 UNSHIFTED grid s_i = (n - i) / n, i = 0..n-1 (1 down to 1/n): every grid's points."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GridError(f"{flag} must be an int >= 1, got {n!r}")
    return torch.arange(n, 0, -1, dtype=torch.float64) / n


def sigma_grid(n: int, shift: float = 1.0, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> Tensor:
    """[n] descending shifted grid of the Euler sampler: sigma_i = shift_k((n - i) / n), i = 0..n-1.

    Computed in float64, returned in `dtype` (float32 by default).
    """
    return shift_sigma(unshifted_grid(n), shift).to(dtype=dtype, device=device)


def student_sigmas(num_steps: int = 4, explicit: Optional[Sequence[float]] = None,
                   shift: float = 1.0) -> Tensor:
    """[N] float32 descending shifted grid of the few-step student (DMD2's rollout and sampler).

    `explicit` (the UNSHIFTED `--dmd2-student-sigmas` values) wins over `num_steps` when given; it
    must start at 1.0 and decrease strictly within (0, 1]. Otherwise s_i = (N - i) / N with
    N = `num_steps` (`--dmd2-denoising-steps`). Shifted with `shift_sigma` in float64.
    """
    if explicit is None:
        s = unshifted_grid(num_steps, "--dmd2-denoising-steps")
    else:
        vals = [float(v) for v in explicit]
        if not vals:
            raise GridError("--dmd2-student-sigmas needs at least one value (e.g. 1.0 0.75 0.5 0.25)")
        if not all(math.isfinite(v) and 0.0 < v <= 1.0 for v in vals):
            raise GridError(f"--dmd2-student-sigmas values must lie in (0, 1] (unshifted sigma), got {vals}")
        if vals[0] != 1.0:
            raise GridError(f"--dmd2-student-sigmas must start at 1.0 (pure noise), got {vals}")
        if any(b >= a for a, b in zip(vals, vals[1:])):
            raise GridError(f"--dmd2-student-sigmas must be strictly decreasing, got {vals}")
        s = torch.tensor(vals, dtype=torch.float64)
    return shift_sigma(s, shift).to(torch.float32)


def critic_grid(size: int, shift: float, sigma_range: tuple) -> tuple[Tensor, Tensor]:
    """(sigmas [G] fp32 shifted, in_range [G] bool) of DMD2's critic grid; `in_range` marks the points
    whose UNSHIFTED value lies in `sigma_range` = (MIN, MAX) (the score range, or the GAN's)."""
    s = unshifted_grid(size, "--dmd2-critic-grid-size")
    lo, hi = sigma_range
    return shift_sigma(s, shift).float(), (s >= lo) & (s <= hi)


def sample_train_sigma(batch: int, shift: float, generator: torch.Generator,
                       device: Optional[torch.device] = None) -> Tensor:
    """[batch] float32 training sigmas: s ~ U[1e-6, 1 - 1e-6] (never exactly 0), then shift_k(s).

    Draws on `generator`'s device from `generator` only, so equal generator states give equal sigmas.
    """
    k = _check_shift(shift)
    u = torch.rand(batch, dtype=torch.float64, generator=generator, device=generator.device)
    s = u * (1 - 2e-6) + 1e-6
    return shift_sigma(s, k).to(dtype=torch.float32, device=device)


def cfg_velocity(v_pos: Tensor, v_neg: Tensor, g: Union[float, Tensor]) -> Tensor:
    """v = v_neg + g (v_pos - v_neg). v_pos, v_neg [B, *D]; g a float or a [B] tensor."""
    if isinstance(g, Tensor):
        g = expand_like(g, v_pos)
    return v_neg + g * (v_pos - v_neg)


ModelFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _batch_null_cond(cond: Tensor, null_cond: Tensor) -> Tensor:
    """Null condition with cond's batch size: [B, ...] as is, [1, ...] expanded."""
    b = cond.shape[0]
    if null_cond.shape[1:] != cond.shape[1:] or null_cond.shape[0] not in (1, b):
        raise FlowError(f"null_cond must have shape [{b} or 1, *{tuple(cond.shape[1:])}] like cond, "
                        f"got {tuple(null_cond.shape)}")
    if null_cond.dtype != cond.dtype:
        raise FlowError(f"null_cond dtype {null_cond.dtype} must equal cond dtype {cond.dtype}")
    return null_cond.expand(b, *cond.shape[1:]) if null_cond.shape[0] != b else null_cond


def trajectory_grid(teacher_steps: int, student: Tensor, shift: float = 1.0) -> tuple[list, list]:
    """(grid, keep): the Euler grid through the student's points, for teacher ODE trajectories.

    grid: the descending float64 floats of `sigma_grid(teacher_steps, shift)`, the student sigmas `student` [N]
    (shifted, fp32: `student_sigmas`) and 0, duplicates merged; a student point equal in fp32 to a teacher point
    is that teacher point, so a student grid on the teacher's leaves the teacher's grid (and its Euler path) as it
    is. keep [N]: the position in `grid` of each student point (`euler_path`'s `keep`).
    """
    teacher = sigma_grid(teacher_steps, shift, dtype=torch.float64).tolist()
    as_fp32 = {float(torch.tensor(t, dtype=torch.float32)): t for t in teacher}
    points = [as_fp32.get(s, s) for s in student.to(torch.float32).tolist()]
    grid = sorted(set(teacher) | set(points) | {0.0}, reverse=True)
    return grid, [grid.index(p) for p in points]


@torch.no_grad()
def euler_path(model_fn: ModelFn, noise: Tensor, cond: Tensor, null_cond: Optional[Tensor] = None,
               grid: Sequence[float] = (1.0, 0.0), guidance: Union[float, Tensor] = 1.0,
               keep: Sequence[int] = ()) -> tuple[Tensor, list]:
    """Euler integration of dx/dsigma = v over the explicit descending grid sigma_0 > ... > sigma_M (floats; noise
    [B, *D] is x at sigma_0): M steps x <- x + (sigma_{i+1} - sigma_i) v, v = model_fn(x, sigma_i [B] fp32, cond
    [B, ...]), CFG as in `euler_sampler`. Returns (x at sigma_M in noise.dtype, [x at sigma_i for i in keep]); the
    state at i = 0 is `noise` itself.
    """
    grid = [float(s) for s in grid]
    if len(grid) < 2 or not all(math.isfinite(s) for s in grid) or any(b > a for a, b in zip(grid, grid[1:])):
        raise FlowError(f"grid must be >= 2 finite, non-increasing sigmas, got {grid}")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(grid) for i in keep):
        raise FlowError(f"keep must hold grid positions in [0, {len(grid)}), got {list(keep)}")
    use_cfg = isinstance(guidance, Tensor) or float(guidance) != 1.0
    b = noise.shape[0]
    if use_cfg:
        if null_cond is None:
            raise FlowError(f"guidance={guidance} != 1 needs null_cond (the negative / null condition)")
        cond_in = torch.cat([cond, _batch_null_cond(cond, null_cond)], dim=0)
    wanted = set(keep)
    x, states = noise, {0: noise}  # only the kept states are held
    for i, (sig, sig_next) in enumerate(zip(grid[:-1], grid[1:])):
        sigma = torch.full((b,), sig, dtype=torch.float32, device=noise.device)
        if use_cfg:
            out = model_fn(torch.cat([x, x], dim=0), torch.cat([sigma, sigma], dim=0), cond_in)
            v = cfg_velocity(out[:b], out[b:], guidance)
        else:
            v = model_fn(x, sigma, cond)
        x = x + (sig_next - sig) * v.to(x.dtype)
        if i + 1 in wanted:
            states[i + 1] = x
    return x, [states[i] for i in keep]


@torch.no_grad()
def euler_sampler(model_fn: ModelFn, noise: Tensor, cond: Tensor, null_cond: Optional[Tensor] = None,
                  steps: int = 50, guidance: Union[float, Tensor] = 1.0, shift: float = 1.0) -> Tensor:
    """Euler integration of dx/dsigma = v from sigma = 1 (x = noise [B, *D]) to sigma = 0.

    Grid sigma_0 = 1 > ... > sigma_{steps-1} = shift(1/steps) > sigma_steps = 0 (see `sigma_grid`);
    each step x <- x + (sigma_next - sigma) v with v = model_fn(x, sigma [B] fp32, cond [B, ...]).
    With guidance g != 1 (or a [B] tensor g) the positive and null conditions run as ONE forward
    of batch 2B (x, sigma and cond/null_cond concatenated) and v = v_neg + g (v_pos - v_neg).
    Returns the final x, the x0 estimate, in noise.dtype (`euler_path` on that grid).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise FlowError(f"steps must be an int >= 1, got {steps!r}")
    # Host-side grid (CPU tensor -> floats): no device syncs inside the loop.
    grid = sigma_grid(steps, shift, dtype=torch.float64).tolist() + [0.0]
    return euler_path(model_fn, noise, cond, null_cond, grid, guidance)[0]
