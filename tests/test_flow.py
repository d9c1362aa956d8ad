"""Flow-matching maths against closed forms in float64 (dmd2_mega/flow.py)."""
import math

import pytest
import torch

import dmd2_kernels
from dmd2_mega import flow
from dmd2_mega.errors import FlowError


def _ref_shift(s, k):
    """Plain-python shift_k(s) = k s / (1 + (k - 1) s)."""
    return k * s / (1 + (k - 1) * s)


# --------------------------------------------------------------------------- conversions

@pytest.mark.parametrize("B", [1, 3, 4])
def test_roundtrips_float64(B):
    g = torch.Generator().manual_seed(B)
    x0 = torch.randn(B, 3, 5, 7, generator=g, dtype=torch.float64)
    eps = torch.randn(B, 3, 5, 7, generator=g, dtype=torch.float64)
    # float32-representable sigma: dmd2_kernels.x0_from_velocity takes sigma as [B] float32 (its documented
    # contract), so the float64 round trip is exact only for sigmas that fp32 holds exactly
    sigma = torch.rand(B, generator=g, dtype=torch.float32).double()
    x_s = flow.add_noise(x0, eps, sigma)
    for n in range(B):  # per-sample closed form, no broadcasting helper involved
        ref = (1 - sigma[n].item()) * x0[n] + sigma[n].item() * eps[n]
        torch.testing.assert_close(x_s[n], ref, rtol=0, atol=1e-14)
    v = flow.velocity_target(x0, eps)
    torch.testing.assert_close(v, eps - x0, rtol=0, atol=0)
    torch.testing.assert_close(dmd2_kernels.x0_from_velocity(x_s, v, sigma), x0, rtol=0, atol=1e-13)


def test_endpoints_and_dtype():
    x0 = torch.randn(2, 4, dtype=torch.float64)
    eps = torch.randn(2, 4, dtype=torch.float64)
    out = flow.add_noise(x0, eps, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert torch.equal(out[0], x0[0]) and torch.equal(out[1], eps[1])
    xb = torch.randn(3, 2, 2, dtype=torch.bfloat16)
    s32 = torch.rand(3)
    assert flow.add_noise(xb, xb, s32).dtype == torch.bfloat16
    assert dmd2_kernels.x0_from_velocity(xb, xb, s32).dtype == torch.bfloat16


def test_expand_like():
    x = torch.zeros(3, 2, 5, 7)
    s = torch.arange(3.0)
    e = flow.expand_like(s, x)
    assert e.shape == (3, 1, 1, 1) and torch.equal(e.flatten(), s)
    with pytest.raises(FlowError, match="shape"):
        flow.expand_like(torch.zeros(4), x)
    with pytest.raises(FlowError, match="shape"):
        flow.expand_like(torch.zeros(3, 1), x)
    with pytest.raises(ValueError, match="torch.Tensor"):
        flow.expand_like(0.5, x)


# --------------------------------------------------------------------------- shift

@pytest.mark.parametrize("k", [0.3, 1.0, 3.0, 7.5])
def test_shift_closed_form(k):
    s = torch.linspace(0, 1, 1001, dtype=torch.float64)
    sh = flow.shift_sigma(s, k)
    assert sh[0].item() == 0.0 and sh[-1].item() == 1.0  # exact endpoints
    assert flow.shift_sigma(0.0, k) == 0.0 and flow.shift_sigma(1.0, k) == 1.0
    torch.testing.assert_close(sh, _ref_shift(s, k), rtol=0, atol=1e-15)
    assert torch.all(sh[1:] > sh[:-1])  # strictly increasing
    inner = slice(1, -1)
    if k > 1:
        assert torch.all(sh[inner] > s[inner])
    elif k < 1:
        assert torch.all(sh[inner] < s[inner])
    else:
        assert torch.equal(sh, s)
    # shift_{1/k} inverts shift_k
    torch.testing.assert_close(flow.shift_sigma(sh, 1 / k), s, rtol=0, atol=1e-14)
    assert math.isclose(flow.shift_sigma(0.25, k), _ref_shift(0.25, k), rel_tol=1e-15)


@pytest.mark.parametrize("k", [0.0, -1.0, float("nan")])
def test_shift_rejects_nonpositive(k):
    with pytest.raises(FlowError, match="shift"):
        flow.shift_sigma(0.5, k)
    with pytest.raises(FlowError, match="shift"):
        flow.sigma_grid(4, k)
    with pytest.raises(FlowError, match="shift"):
        flow.sample_train_sigma(4, k, torch.Generator())
    with pytest.raises(FlowError, match="shift"):
        flow.euler_sampler(lambda x, s, c: x, torch.zeros(1, 2), torch.zeros(1), shift=k)


# --------------------------------------------------------------------------- grids / training sigma

@pytest.mark.parametrize("n,k", [(1, 1.0), (7, 1.0), (10, 3.0), (33, 0.5)])
def test_sigma_grid(n, k):
    grid = flow.sigma_grid(n, k)
    assert grid.shape == (n,) and grid.dtype == torch.float32
    ref = torch.tensor([_ref_shift((n - i) / n, k) for i in range(n)], dtype=torch.float32)
    torch.testing.assert_close(grid, ref, rtol=0, atol=1e-7)
    assert grid[0].item() == 1.0 and grid[-1].item() > 0
    assert torch.all(grid[1:] < grid[:-1])
    with pytest.raises(FlowError, match="n"):
        flow.sigma_grid(0)


@pytest.mark.parametrize("k", [1.0, 3.0])
def test_sample_train_sigma(k):
    s = flow.sample_train_sigma(20000, k, torch.Generator().manual_seed(0))
    assert s.shape == (20000,) and s.dtype == torch.float32
    assert torch.all(s > 0) and torch.all(s <= 1)
    again = flow.sample_train_sigma(20000, k, torch.Generator().manual_seed(0))
    other = flow.sample_train_sigma(20000, k, torch.Generator().manual_seed(1))
    assert torch.equal(s, again) and not torch.equal(s, other)
    # P(sigma <= shift_k(q)) = q for uniform unshifted s
    for q in (0.1, 0.25, 0.5, 0.9):
        frac = (s <= _ref_shift(q, k)).double().mean().item()
        assert abs(frac - q) < 0.015, (q, frac)


# --------------------------------------------------------------------------- Euler on a Gaussian toy

# Data x0 ~ N(mu, std^2) per element, x_t = (1 - t) x0 + t eps. With m_t = (1 - t) mu and
# V_t = (1 - t)^2 std^2 + t^2: Cov(x0, x_t) = (1 - t) std^2, Cov(eps, x_t) = t, so
# E[v | x_t] = E[eps | x_t] - E[x0 | x_t] = -mu + (t - (1 - t) std^2) / V_t * (x_t - m_t).
# The ODE solution from x_1 = z is x_t = m_t + sqrt(V_t) z (d/dt of it is exactly the field above),
# so the exact map at t = 0 is z -> mu + std * z.
MUS = torch.tensor([[0.5, -1.0, 2.0], [-0.3, 0.0, 1.5]], dtype=torch.float64)  # [classes, D]
STD = torch.tensor([0.7, 1.3, 0.2], dtype=torch.float64)


def _gauss_velocity(x, sigma, cond):
    t = sigma.to(torch.float64)[:, None]
    mu = MUS[cond]
    var = (1 - t) ** 2 * STD ** 2 + t ** 2
    return -mu + (t - (1 - t) * STD ** 2) / var * (x - (1 - t) * mu)


@pytest.mark.parametrize("k", [1.0, 3.0])
def test_euler_gaussian_toy_converges_first_order(k):
    z = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cond = torch.tensor([0, 1, 1, 0, 1])
    exact = MUS[cond] + STD * z
    err = {}
    for n in (50, 200, 2000):
        x = flow.euler_sampler(_gauss_velocity, z, cond, steps=n, shift=k)
        assert x.dtype == torch.float64
        err[n] = (x - exact).abs().max().item()
    assert err[2000] < 2e-3
    ratio = err[50] / err[200]
    assert 3.0 < ratio < 5.0, (err, ratio)  # Euler: error ~ 1 / steps


def test_euler_one_step_is_x0_prediction():
    z = torch.randn(3, 3, dtype=torch.float64)
    cond = torch.tensor([1, 0, 1])
    v = _gauss_velocity(z, torch.ones(3), cond)
    out = flow.euler_sampler(_gauss_velocity, z, cond, steps=1, shift=3.0)
    torch.testing.assert_close(out, dmd2_kernels.x0_from_velocity(z, v, torch.ones(3, dtype=torch.float64)))


# --------------------------------------------------------------------------- CFG batching

class _Recorder:
    """A nonlinear toy model that records the batch size of every forward."""

    def __init__(self, cond_dim=None):
        g = torch.Generator().manual_seed(3)
        self.table = torch.randn(11, 2, 3, generator=g, dtype=torch.float64)
        self.proj = torch.randn(cond_dim or 1, 3, generator=g, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.calls = []

    def __call__(self, x, sigma, cond):
        self.calls.append((x.shape[0], sigma.shape[0], cond.shape[0]))
        if cond.dtype == torch.int64:
            c = self.table[cond]
        else:
            c = (cond.to(torch.float64) @ self.proj)  # [B, 2, cond_dim] @ [cond_dim, 3]
        return self.w * torch.tanh(x) * (1 + sigma[:, None, None]) + c * sigma[:, None, None] ** 2


def _reference_cfg(model, z, cond, null, steps, g, k):
    """Two separate forwards per step, combined by hand, on an independently built grid."""
    grid = [_ref_shift((steps - i) / steps, k) for i in range(steps)] + [0.0]
    gg = g[:, None, None] if isinstance(g, torch.Tensor) else g
    x = z
    for s, s_next in zip(grid[:-1], grid[1:]):
        sig = torch.full((z.shape[0],), s, dtype=torch.float32)
        v_pos, v_neg = model(x, sig, cond), model(x, sig, null)
        x = x + (s_next - s) * (v_neg + gg * (v_pos - v_neg))
    return x


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kind", ["label", "embedding"])
@pytest.mark.parametrize("g", [4.0, "tensor"])
def test_cfg_one_batched_forward(B, kind, g):
    steps, k = 6, 3.0
    z = torch.randn(B, 2, 3, generator=torch.Generator().manual_seed(B), dtype=torch.float64)
    if kind == "label":
        model = _Recorder()
        cond = torch.arange(B) % 10
        null = torch.full((B,), 10)
    else:
        model = _Recorder(cond_dim=4)
        cond = torch.randn(B, 2, 4, dtype=torch.float32)
        null = torch.zeros(1, 2, 4)  # one null row, expanded to B
    if g == "tensor":
        g = torch.linspace(1.0, 5.0, B, dtype=torch.float32)
    out = flow.euler_sampler(model, z, cond, null, steps=steps, guidance=g, shift=k)
    assert model.calls == [(2 * B, 2 * B, 2 * B)] * steps
    assert not out.requires_grad  # ran under no_grad although the model has a parameter
    null_b = null.expand(B, *null.shape[1:])
    ref = _reference_cfg(model, z, cond, null_b, steps, g, k)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


def test_guidance_one_runs_positive_only():
    model = _Recorder()
    z = torch.randn(3, 2, 3, dtype=torch.float64)
    cond = torch.tensor([1, 2, 3])
    out = flow.euler_sampler(model, z, cond, steps=5, guidance=1.0, shift=2.0)
    assert model.calls == [(3, 3, 3)] * 5
    # g = 1 reduces CFG to the positive branch, whatever the null condition
    ref = _reference_cfg(model, z, cond, torch.tensor([10, 10, 10]), 5, 1.0, 2.0)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


def test_cfg_velocity():
    vp, vn = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(flow.cfg_velocity(vp, vn, 1.0), vp)
    torch.testing.assert_close(flow.cfg_velocity(vp, vn, 0.0), vn)
    g = torch.tensor([0.0, 1.0, 2.5], dtype=torch.float64)
    torch.testing.assert_close(flow.cfg_velocity(vp, vn, g), vn + g[:, None] * (vp - vn))


def test_sampler_errors():
    model = _Recorder()
    z = torch.zeros(2, 2, 3, dtype=torch.float64)
    cond = torch.tensor([0, 1])
    with pytest.raises(FlowError, match="null_cond"):
        flow.euler_sampler(model, z, cond, guidance=2.0)
    with pytest.raises(FlowError, match="null_cond"):
        flow.euler_sampler(model, z, cond, torch.tensor([10, 10, 10]), guidance=2.0)
    with pytest.raises(FlowError, match="steps"):
        flow.euler_sampler(model, z, cond, steps=0)
    assert model.calls == []
