"""dmd2_kernels.x0_from_velocity (x0 = x_s - sigma * v) and dmd2_kernels.cfg_x0 against float64 references."""
import pytest
import torch

import dmd2_kernels
from test_kernels_utils import DEVICE, IMPLS, TOL, assert_close, cases, count_launches, f64, rand_sigma, randn


def bview(s, ndim):
    return s.double().view((-1,) + (1,) * (ndim - 1))


@pytest.mark.parametrize("B,shape,dtype,impl", cases())
def test_x0_from_velocity(B, shape, dtype, impl):
    x_s = randn(B, shape, dtype, 0).requires_grad_()
    v = randn(B, shape, dtype, 1).requires_grad_()
    sigma = rand_sigma(B, 2)
    out = dmd2_kernels.x0_from_velocity(x_s, v, sigma, impl=impl)
    assert out.dtype == dtype and out.shape == x_s.shape
    grad_out = randn(B, shape, dtype, 3)
    gx, gv = torch.autograd.grad(out, (x_s, v), grad_out)

    x64, v64 = f64(x_s, v)
    ref = x64 - bview(sigma, x64.dim()) * v64
    rx, rv = torch.autograd.grad(ref, (x64, v64), grad_out.double())
    assert_close(out, ref, dtype, msg="x0")
    assert_close(gx, rx, dtype, msg="grad x_s")
    assert_close(gv, rv, dtype, msg="grad v")
    assert gx.dtype == dtype and gv.dtype == dtype


def test_x0_gradcheck_torch_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    sigma = torch.tensor([0.3, 0.8])
    assert torch.autograd.gradcheck(lambda a, b: dmd2_kernels.x0_from_velocity(a, b, sigma, impl="torch"), (x, v))


@pytest.mark.parametrize("B,shape,dtype,impl", cases())
def test_cfg_x0(B, shape, dtype, impl):
    x_s, v_pos, v_neg = (randn(B, shape, dtype, i) for i in range(3))
    sigma = rand_sigma(B, 3)
    guidance = 1.0 + 6.0 * rand_sigma(B, 4)  # per-sample guidance in (1, 7)
    with torch.no_grad():
        out = dmd2_kernels.cfg_x0(x_s, v_pos, v_neg, sigma, guidance, impl=impl)
    assert out.dtype == dtype and out.shape == x_s.shape

    x64, p64, n64 = f64(x_s, v_pos, v_neg)
    s64, g64 = bview(sigma, x64.dim()), bview(guidance, x64.dim())
    ref = x64 - s64 * (n64 + g64 * (p64 - n64))
    # v_pos - v_neg is amplified by up to 7: scale the tolerance by the guidance
    atol, rtol = TOL[dtype]
    assert_close(out, ref, dtype, tol=(7 * atol, rtol))


@pytest.mark.parametrize("impl", IMPLS)
def test_cfg_guidance_one_is_positive_branch(impl):
    """g = 1 is the x0 of the positive velocity alone, however large v_neg is."""
    x_s, v_pos = randn(3, (4, 6), torch.float32, 0), randn(3, (4, 6), torch.float32, 1)
    v_neg = randn(3, (4, 6), torch.float32, 2, scale=1e3)
    sigma = rand_sigma(3, 3)
    with torch.no_grad():
        out = dmd2_kernels.cfg_x0(x_s, v_pos, v_neg, sigma, 1.0, impl=impl)
        want = dmd2_kernels.x0_from_velocity(x_s, v_pos, sigma, impl=impl)
    assert_close(out, want, torch.float32, tol=(1e-4, 1e-5))


def test_cfg_is_forward_only():
    x = randn(2, (3, 4), torch.float32, 0)
    with pytest.raises(dmd2_kernels.KernelError, match="forward-only"):
        dmd2_kernels.cfg_x0(x, x.clone().requires_grad_(), x, 0.5, 3.0)
    with torch.no_grad():  # the same call is fine without grad mode
        dmd2_kernels.cfg_x0(x, x.clone().requires_grad_(), x, 0.5, 3.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_cfg_guidance_as_number_or_device_tensor(impl, monkeypatch):
    """guidance and sigma as Python numbers, one-element device tensors, [B] tensors or a strided [B] view give one
    result (bit-exact: the same float32 arithmetic), with no host work: no tensor is built from a number and no
    tensor is copied, so a call is the CFG itself: the one kernel (Triton) or lerp + addcmul (torch, float32; add for a
    number sigma)."""
    x_s, v_pos, v_neg = (randn(3, (4, 6), torch.float32, i) for i in range(3))
    cols = torch.tensor([[0.25, 9.0], [0.25, 9.0], [0.25, 9.0]], device=DEVICE)
    forms = [(0.25, 4.5), (torch.tensor(0.25, device=DEVICE), torch.tensor([4.5], device=DEVICE)),
             (cols[:, 0].contiguous(), torch.full((3,), 4.5, device=DEVICE)), (cols[:, 0], cols[:, 1] / 2)]
    with torch.no_grad():
        want = dmd2_kernels.cfg_x0(x_s, v_pos, v_neg, *forms[0], impl=impl)
        for sigma, guidance in forms:
            counted, out = count_launches(monkeypatch, lambda: dmd2_kernels.cfg_x0(x_s, v_pos, v_neg, sigma, guidance,
                                                                               impl=impl))
            assert torch.equal(out, want)
            if impl == "triton":
                assert dict(counted.kernels) == {"_cfg_x0_fwd_kernel": 1} and not counted.ops, counted.ops
            else:
                assert counted.ops["lerp"] == 1 and counted.total() == 2, counted.ops  # and add or addcmul
    assert_close(want, x_s - 0.25 * (v_neg + 4.5 * (v_pos - v_neg)), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_x0_number_sigma_is_one_op(impl, monkeypatch):
    """A Python-number sigma: the torch path is one add (no tensor for sigma), the Triton path one kernel."""
    x_s, v = randn(3, (4, 6), torch.float32, 0), randn(3, (4, 6), torch.float32, 1)
    counted, out = count_launches(monkeypatch, lambda: dmd2_kernels.x0_from_velocity(x_s, v, 0.25, impl=impl))
    assert counted.total() == 1, (counted.ops, counted.kernels)
    assert_close(out, x_s - 0.25 * v, torch.float32)
