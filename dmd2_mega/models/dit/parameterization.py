"""Parameterisation adapters: a teacher network that predicts something else on another path, seen as our velocity.

Our convention (DESIGN section 1): x_s = (1 - s) x0 + s eps, the model returns v = eps - x0. A network trained on
another path is wrapped by an adapter inside the model (the DiT calls `inputs` before its embedding and `velocity`
after its output), so every role built from it (teacher, critic, student) holds the same adapter, the student and
the critic start as exact copies of the teacher in its own parameterisation, and every loss sees our velocity.

    flow    ours (and Wan's): the network sees (x_s, timestep 1000 s) and predicts v.
    sit     SiT's linear interpolant, t = 1 is data: x_t = t x0 + (1 - t) eps predicts u = x0 - eps. With t = 1 - s
            x_t = x_s exactly, so the network sees (x_s, t = 1 - s; SiT embeds t in [0, 1] unscaled), v = -u.
    vp-eps  DDPM epsilon-prediction on a discrete linear-beta VP schedule (DiT): abar_i = prod_{j<=i} (1 - beta_j),
            beta linear from beta_start to beta_end over T steps; x_vp = alpha x0 + sigma_vp eps with
            alpha^2 + sigma_vp^2 = 1. Our x_s is the same point scaled: x_vp = (alpha + sigma_vp) x_s with
            s = sigma_vp / (alpha + sigma_vp), so for any s in [0, 1]
                alpha(s) = (1 - s) / r,  sigma_vp(s) = s / r,  r = sqrt((1 - s)^2 + s^2),  x_vp = x_s / r.
            Timestep: the discrete levels s_i = sigma_i / (alpha_i + sigma_i) increase with i. The network is fed the
            fractional timestep tau = i + (s - s_i) / (s_{i+1} - s_i) of the nearest-below pair s_i <= s < s_{i+1}
            (linear in s between the two; DiT's sinusoidal embedding takes fractional timesteps); below s_0 it is
            0, above s_{T-1} it is T - 1. Only the timestep is interpolated: the input is scaled to s's own VP point.
            Output: eps_hat -> x0_hat = (x_vp - sigma_vp eps_hat) / alpha, v = eps_hat - x0_hat, exact on
            [0, s_{T-1}]. Above s_{T-1} (s = 1 is pure noise, where eps-prediction cannot tell x0: alpha = 0) the
            network's last level is used as the DDPM's own sampler uses it at t = T - 1: x0_hat = (x_vp - sigma_T
            eps_hat) / alpha_T with (alpha_T, sigma_T) of level T - 1, and v = (x_s - x0_hat) / s, so that
            x_s - s v = x0_hat on the whole range (x0 is what DMD2 reads: rollout, scores, critic targets).
The adapters' maths runs on the device of x in x's dtype, at least float32 (the VP table in float64, built once per
device); the flow adapter is the identity and keeps the model's dtype.
"""
from __future__ import annotations

import torch

from dmd2_mega.errors import ConfigError

KINDS = ("flow", "sit", "vp-eps")


class FlowAdapter:
    """Ours: the network's own velocity; the timestep is 1000 s."""

    name = "flow"

    def inputs(self, x: torch.Tensor, sigma: torch.Tensor):
        return x, sigma * 1000.0

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out


class SiTAdapter(FlowAdapter):
    """SiT's linear interpolant (module docstring): t = 1 - s, v = -u."""

    name = "sit"

    def inputs(self, x, sigma):
        return x, 1.0 - sigma

    def velocity(self, x, sigma, out):
        return -out


def vp_table(beta_start: float, beta_end: float, steps: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_i, sigma_i) [T] float64 of the discrete linear-beta VP schedule (DDPM / DiT 'linear')."""
    betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64, device=device)
    abar = torch.cumprod(1.0 - betas, dim=0)
    return abar.sqrt(), (1.0 - abar).sqrt()


class VPEpsAdapter(FlowAdapter):
    """DDPM epsilon-prediction on a discrete linear-beta VP schedule (module docstring)."""

    name = "vp-eps"

    def __init__(self, beta_start: float = 1e-4, beta_end: float = 0.02, steps: int = 1000):
        if not (0 < beta_start <= beta_end < 1) or steps < 2:
            raise ConfigError(f"a VP schedule needs 0 < beta_start <= beta_end < 1 and >= 2 steps, got beta_start "
                              f"{beta_start}, beta_end {beta_end}, {steps} steps")
        self.beta_start, self.beta_end, self.steps = beta_start, beta_end, steps
        self._tables: dict = {}

    def levels(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s_i, alpha_i, sigma_i) [T] float64 on `device`, built once per device."""
        key = str(device)
        if key not in self._tables:
            alpha, sig = vp_table(self.beta_start, self.beta_end, self.steps, device)
            self._tables[key] = (sig / (alpha + sig), alpha, sig)
        return self._tables[key]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The fractional timestep tau [B] float64 of our s (module docstring)."""
        levels = self.levels(sigma.device)[0]
        s = sigma.double()
        i = (torch.searchsorted(levels, s, right=True) - 1).clamp(0, self.steps - 2)
        lo, hi = levels[i], levels[i + 1]
        return i + ((s - lo) / (hi - lo)).clamp(0.0, 1.0)

    def inputs(self, x, sigma):
        s = sigma.double()
        scale = torch.rsqrt((1.0 - s) ** 2 + s ** 2)  # x_vp = x_s / r
        return x * _per_sample(scale, x), self.timestep(sigma)

    def velocity(self, x, sigma, out):
        levels, alpha_t, sigma_t = self.levels(sigma.device)
        s = sigma.double()
        r = torch.sqrt((1.0 - s) ** 2 + s ** 2)
        top = s > levels[-1]
        a = torch.where(top, alpha_t[-1], (1.0 - s) / r)  # the (alpha, sigma_vp) the x0 estimate divides by
        b = torch.where(top, sigma_t[-1], s / r)
        eps = out.to(_dtype(x))
        x0 = (_per_sample(1.0 / r, x) * x - _per_sample(b, x) * eps) / _per_sample(a, x)
        s_top = torch.where(top, s, torch.ones_like(s))  # no 0 in the branch torch.where discards (its gradient)
        return torch.where(_per_sample(top, x), (x - x0) / _per_sample(s_top, x), eps - x0)


def _dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ...] broadcastable against `like`, in `_dtype(like)` (bool stays bool)."""
    t = t if t.dtype == torch.bool else t.to(_dtype(like))
    return t.view(-1, *([1] * (like.dim() - 1)))


def build_adapter(kind: str, beta_start: float = 1e-4, beta_end: float = 0.02, steps: int = 1000) -> FlowAdapter:
    if kind == "flow":
        return FlowAdapter()
    if kind == "sit":
        return SiTAdapter()
    if kind == "vp-eps":
        return VPEpsAdapter(beta_start, beta_end, steps)
    raise ConfigError(f"parameterization {kind!r} is unknown; expected one of {list(KINDS)}")
