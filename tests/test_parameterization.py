"""Parameterisation adapters (`models/dit/parameterization.py`) against oracles, in float64: for a known x0 and eps, an
oracle network that checks the input it is given (its own path's point and timestep, derived here independently of
the adapter's formulas) and returns the exact prediction of its parameterisation; the adapter's velocity must be
eps - x0 on our path, across the whole sigma range including its ends. Also: the DiT routes every call (forward,
features) through its adapter, so a SiT-wrapped model's velocity is minus its network's output at t = 1 - s.
"""
import numpy as np
import pytest
import torch

from dmd2_mega.models import DataShape
from dmd2_mega.models.dit import DiT, DiTSpec
from dmd2_mega.models.dit.parameterization import SiTAdapter, VPEpsAdapter, build_adapter
from dmd2_mega.errors import ConfigError

SHAPE = (4, 3, 5, 5)


def _x0_eps():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(SHAPE, generator=g, dtype=torch.float64),
            torch.randn(SHAPE, generator=g, dtype=torch.float64))


def _ours(x0, eps, s):
    return (1 - s).view(-1, 1, 1, 1) * x0 + s.view(-1, 1, 1, 1) * eps


def _fit_ab(x, x0, eps):
    """The (a, b) of x = a x0 + b eps per sample, by least squares (the oracle's view of its input)."""
    out = []
    for i in range(x.shape[0]):
        basis = torch.stack([x0[i].flatten(), eps[i].flatten()], dim=1)
        out.append(torch.linalg.lstsq(basis, x[i].flatten()[:, None]).solution.flatten())
    return torch.stack(out)


def test_sit_adapter_is_eps_minus_x0_on_the_whole_range():
    x0, eps = _x0_eps()
    s = torch.tensor([0.0, 1e-6, 0.5, 1.0], dtype=torch.float64)
    seen = {}

    def sit_net(x_t, t):  # SiT: x_t = t x0 + (1 - t) eps (t = 1 is data), predicts u = x0 - eps
        ab = _fit_ab(x_t, x0, eps)
        torch.testing.assert_close(ab[:, 0], t, rtol=0, atol=1e-12)
        torch.testing.assert_close(ab[:, 1], 1 - t, rtol=0, atol=1e-12)
        seen["t"] = t
        return x0 - eps

    a = SiTAdapter()
    v = a.velocity(_ours(x0, eps, s), s, sit_net(*a.inputs(_ours(x0, eps, s), s)))
    torch.testing.assert_close(seen["t"], 1 - s, rtol=0, atol=0)
    torch.testing.assert_close(v, eps - x0, rtol=0, atol=1e-12)


def _levels():
    """DDPM's linear betas (1e-4 .. 0.02, 1000 steps), in numpy: (s_i, alpha_i, sigma_i) float64."""
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    alpha, sigma = np.sqrt(abar), np.sqrt(1 - abar)
    return sigma / (alpha + sigma), alpha, sigma


def _tau(s: float) -> float:
    """The documented timestep: the nearest-below pair, linear in s between its two levels; clamped at the ends."""
    lv = _levels()[0]
    if s <= lv[0]:
        return 0.0
    if s >= lv[-1]:
        return 999.0
    i = int(np.nonzero(lv <= s)[0].max())
    return i + (s - lv[i]) / (lv[i + 1] - lv[i])


def test_vp_eps_adapter_is_eps_minus_x0_up_to_the_last_level():
    lv, alpha_t, sigma_t = _levels()
    x0, eps = _x0_eps()
    s_all = [0.0, lv[0] / 2, lv[0], 0.3, lv[500], (lv[500] + lv[501]) / 2, 0.9, lv[-1]]
    a = VPEpsAdapter()
    for chunk in (s_all[:4], s_all[4:]):
        s = torch.tensor(chunk, dtype=torch.float64)

        def eps_net(x_vp, tau):  # DDPM: x_vp = alpha x0 + sigma eps with alpha^2 + sigma^2 = 1, predicts eps
            ab = _fit_ab(x_vp, x0, eps)
            torch.testing.assert_close(ab.pow(2).sum(1), torch.ones(len(chunk), dtype=torch.float64), rtol=0,
                                       atol=1e-10)
            torch.testing.assert_close(ab[:, 1] / ab.sum(1), s, rtol=0, atol=1e-10)  # the same point as x_s
            torch.testing.assert_close(tau, torch.tensor([_tau(v) for v in chunk], dtype=torch.float64), rtol=0,
                                       atol=1e-9)
            return eps

        x = _ours(x0, eps, s)
        torch.testing.assert_close(a.velocity(x, s, eps_net(*a.inputs(x, s))), eps - x0, rtol=0, atol=1e-9)


def test_vp_eps_adapter_above_the_last_level_uses_it_as_ddpm_does():
    """Above s_{T-1} (s = 1: pure noise) x0 comes from the last level, as DDPM's sampler computes it at t = T - 1,
    and the velocity keeps x_s - s v = that x0."""
    lv, alpha_t, sigma_t = _levels()
    x0, eps = _x0_eps()
    s = torch.tensor([(lv[-1] + 1) / 2, 0.999, 1.0 - 1e-12, 1.0], dtype=torch.float64)
    a = VPEpsAdapter()
    x = _ours(x0, eps, s)
    x_vp, tau = a.inputs(x, s)
    assert torch.equal(tau, torch.full((4,), 999.0, dtype=torch.float64))
    torch.testing.assert_close(x_vp[-1], eps[-1], rtol=0, atol=1e-12)  # s = 1: the input is the noise itself
    guess = eps + 0.1 * x0  # any prediction
    v = a.velocity(x, s, guess)
    want = (x_vp - sigma_t[-1] * guess) / alpha_t[-1]
    torch.testing.assert_close(x - s.view(-1, 1, 1, 1) * v, want, rtol=1e-10, atol=1e-9)
    # continuity at the last level: both branches agree there
    at = torch.tensor([lv[-1]], dtype=torch.float64)
    above = torch.tensor([np.nextafter(lv[-1], 1.0)], dtype=torch.float64)
    xa = _ours(x0[:1], eps[:1], at)
    torch.testing.assert_close(a.velocity(xa, at, guess[:1]), a.velocity(xa, above, guess[:1]), rtol=1e-9, atol=1e-9)


def test_adapter_gradients_are_finite_at_the_ends():
    """torch.where keeps no 0 division in the discarded branch: the backward at s = 0 and s = 1 is finite."""
    x = torch.randn(2, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.0, 1.0], dtype=torch.float64)
    a = VPEpsAdapter()
    x_vp, tau = a.inputs(x, s)
    a.velocity(x, s, 0.5 * x_vp).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_dit_routes_forward_and_features_through_its_adapter():
    torch.manual_seed(0)
    spec = DiTSpec(name="tiny-sit", hidden_size=16, num_layers=2, num_heads=2, patch_size=2, freq_dim=16,
                   parameterization="sit", pos_table="dit")
    from dmd2_mega.pretrained import _ensure_world
    _ensure_world()
    model = DiT(spec, DataShape(1, 4, num_classes=3))
    for p in model.parameters():  # adaLN-Zero's zeros would make the network output 0
        torch.nn.init.normal_(p, std=0.2)
    x, s, y = torch.randn(2, 1, 4, 4), torch.tensor([0.25, 0.9]), torch.tensor([0, 3])
    with torch.no_grad():
        torch.testing.assert_close(model(x, s, y), -model.network(x, 1 - s, y), rtol=0, atol=0)
        flow = DiT(DiTSpec(**{**spec.__dict__, "parameterization": "flow"}), DataShape(1, 4, num_classes=3))
        flow.load_state_dict(model.state_dict())
        torch.testing.assert_close(model.features(x, s, y, 1), flow.features(x, (1 - s) / 1000.0, y, 1), rtol=1e-6,
                                   atol=1e-6)  # SiT's t = 1 - s is the flow model's 1000 sigma


def test_unknown_parameterization_is_a_clear_error():
    with pytest.raises(ConfigError, match="parameterization 'edm' is unknown"):
        build_adapter("edm")
    with pytest.raises(ConfigError, match="beta_start <= beta_end"):
        VPEpsAdapter(0.02, 1e-4)
