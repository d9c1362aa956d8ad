"""dmd2_kernels.flow_matching_loss (per-sample or batch mean, velocity or x0 space) against a float64 reference."""
import pytest
import torch

import dmd2_kernels
from test_kernels_utils import (DEVICE, IMPLS, LOSS_TOL, assert_close, cases, count_launches, dtype_id, f64,
                                grad_tol, rand_sigma, randn)


def reference(v_pred, x0, eps, sigma, space):
    """float64, written from the definitions: velocity target eps - x0; x0 space through x_s."""
    dims = tuple(range(1, v_pred.dim()))
    if space == "velocity":
        return ((v_pred - (eps - x0)) ** 2).mean(dims)
    s = sigma.double().view((-1,) + (1,) * (v_pred.dim() - 1))
    x_s = (1 - s) * x0 + s * eps
    return (((x_s - s * v_pred) - x0) ** 2).mean(dims)


@pytest.mark.parametrize("space", ["velocity", "x0"])
@pytest.mark.parametrize("B,shape,dtype,impl", cases())
def test_flow_matching_loss(B, shape, dtype, impl, space):
    v_pred = randn(B, shape, dtype, 0).requires_grad_()
    x0, eps = randn(B, shape, dtype, 1), randn(B, shape, dtype, 2)
    sigma = rand_sigma(B, 3)
    loss = dmd2_kernels.flow_matching_loss(v_pred, x0, eps, sigma, space=space, impl=impl)
    assert loss.shape == (B,) and loss.dtype == torch.float32
    grad_out = rand_sigma(B, 4)  # per-sample weights of the loss
    (gv,) = torch.autograd.grad(loss, v_pred, grad_out)

    v64, x64, e64 = f64(v_pred, x0, eps)
    ref = reference(v64, x64, e64, sigma, space)
    (rv,) = torch.autograd.grad(ref, v64, grad_out.double())
    assert_close(loss, ref, dtype, tol=LOSS_TOL, msg="loss")
    # 2 sigma^2 d / N is tiny: in float16 an x0-space gradient over 2244 elements is subnormal
    assert_close(gv, rv, dtype, tol=grad_tol(dtype, rv), msg="grad v_pred")
    assert gv.dtype == dtype


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B", [1, 3, 8])
def test_x0_space_is_sigma_squared_velocity(B, impl):
    v_pred, x0, eps = (randn(B, (4, 33, 17), torch.float32, i) for i in range(3))
    sigma = rand_sigma(B, 3)
    lv = dmd2_kernels.flow_matching_loss(v_pred, x0, eps, sigma, space="velocity", impl=impl)
    lx = dmd2_kernels.flow_matching_loss(v_pred, x0, eps, sigma, space="x0", impl=impl)
    assert_close(lx, sigma ** 2 * lv, torch.float32, tol=LOSS_TOL)
    assert not torch.allclose(lx, lv)  # sigma < 1: the two spaces differ


def test_targets_are_not_differentiated():
    x = randn(2, (3, 4), torch.float32, 0)
    with pytest.raises(dmd2_kernels.KernelError, match="x0 and eps are targets"):
        dmd2_kernels.flow_matching_loss(x, x.clone().requires_grad_(), x, 0.5)


@pytest.mark.parametrize("space", ["velocity", "x0"])
def test_flow_matching_gradcheck_torch_path(space):
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(3, 2, 5, dtype=torch.float64, generator=g) for _ in range(3))
    v.requires_grad_()
    sigma = torch.tensor([0.2, 0.5, 0.9])
    fn = lambda a: dmd2_kernels.flow_matching_loss(a, x0, eps, sigma, space=space, impl="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (v,))


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_through_mean(impl):
    """loss.mean().backward() hands the Function a stride-0 (expanded) grad_out."""
    v_pred = randn(3, (4, 5), torch.float32, 0).requires_grad_()
    x0, eps = randn(3, (4, 5), torch.float32, 1), randn(3, (4, 5), torch.float32, 2)
    dmd2_kernels.flow_matching_loss(v_pred, x0, eps, rand_sigma(3, 3), space="x0", impl=impl).mean().backward()
    v64, x64, e64 = f64(v_pred, x0, eps)
    reference(v64, x64, e64, rand_sigma(3, 3), "x0").mean().backward()
    assert_close(v_pred.grad, v64.grad, torch.float32, tol=grad_tol(torch.float32, v64.grad))


# ------------------------------------------------------------------ the batch mean, launches, the final reduction

@pytest.mark.parametrize("space", ["velocity", "x0"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_reduction_mean(space, impl, dtype):
    """reduction="mean" is the batch mean of the per-sample losses (0-dim), gradient included; a Python-number
    sigma (a kernel argument, no tensor) gives what the same sigma as a tensor gives."""
    B, shape = 3, (4, 33, 17)
    v_pred = randn(B, shape, dtype, 0).requires_grad_()
    x0, eps = randn(B, shape, dtype, 1), randn(B, shape, dtype, 2)
    for sigma in (rand_sigma(B, 3), 0.3):
        loss = dmd2_kernels.flow_matching_loss(v_pred, x0, eps, sigma, space=space, impl=impl, reduction="mean")
        assert loss.shape == () and loss.dtype == torch.float32
        (gv,) = torch.autograd.grad(loss, v_pred, torch.tensor(0.7, device=loss.device))
        v64, x64, e64 = f64(v_pred, x0, eps)
        s = sigma if isinstance(sigma, torch.Tensor) else torch.full((B,), sigma, device=DEVICE)
        ref = reference(v64, x64, e64, s, space).mean()
        (rv,) = torch.autograd.grad(ref, v64, torch.tensor(0.7, dtype=torch.float64, device=ref.device))
        assert_close(loss, ref, dtype, tol=LOSS_TOL, msg="loss")
        assert_close(gv, rv, dtype, tol=grad_tol(dtype, rv), msg="grad v_pred")
    with pytest.raises(dmd2_kernels.KernelError, match="reduction='sum'"):
        dmd2_kernels.flow_matching_loss(v_pred, x0, eps, 0.3, reduction="sum")


# The torch path's aten ops for float32 inputs (kernels/dmd2_kernels/flow_matching.py docstring), forward and backward:
# sub, mse_loss, mean (x0 space: and the square and multiply of the weights; "mean": mse_loss's own mean for the
# velocity space, one more mean for x0); backward mse_loss_backward and the means' and weights' scalings.
TORCH_OPS = {("velocity", "none"): (3, 2), ("velocity", "mean"): (2, 1), ("x0", "none"): (5, 3), ("x0", "mean"): (6, 4)}


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("space", ["velocity", "x0"])
@pytest.mark.parametrize("impl", IMPLS)
def test_flow_matching_loss_launches(impl, space, reduction, monkeypatch):
    """A property, not a timing: the Triton path is 2 kernels forward (the partial sums; one program adding them,
    per sample and for the mean: see the module docstring for why not one) and 1 backward, with no other op (the
    old path took a further `.mean()` and its backward for the critic's mean); the torch path at most TORCH_OPS."""
    v_pred = randn(3, (4, 33, 17), torch.float32, 0).requires_grad_()
    x0, eps = randn(3, (4, 33, 17), torch.float32, 1), randn(3, (4, 33, 17), torch.float32, 2)
    sigma = rand_sigma(3, 3)
    fwd, loss = count_launches(monkeypatch, lambda: dmd2_kernels.flow_matching_loss(
        v_pred, x0, eps, sigma, space=space, impl=impl, reduction=reduction))
    grad_out = torch.ones_like(loss)
    bwd, _ = count_launches(monkeypatch, lambda: torch.autograd.grad(loss, v_pred, grad_out))
    if impl == "triton":
        assert dict(fwd.kernels) == {"_fm_fwd_kernel": 1, "_fm_final_kernel": 1} and not fwd.ops, fwd.ops
        assert dict(bwd.kernels) == {"_fm_bwd_kernel": 1} and not bwd.ops, bwd.ops
    else:
        nf, nb = TORCH_OPS[(space, reduction)]
        assert not fwd.kernels and fwd.total() <= nf, fwd.ops
        assert bwd.total() <= nb, bwd.ops


def test_final_program_loops_over_many_partials(monkeypatch):
    """Tiles of 16 elements: 141 partials per sample, added 16 at a time by the one final program."""
    from dmd2_kernels import flow_matching
    monkeypatch.setattr(flow_matching, "block_for", lambda n: 16)
    monkeypatch.setattr(flow_matching, "FINAL_BLOCK", 16)
    v_pred, x0, eps = (randn(3, (4, 33, 17), torch.float32, i) for i in range(3))
    sigma = rand_sigma(3, 3)
    ref = reference(*f64(v_pred, x0, eps), sigma, "x0")
    for reduction, want in (("none", ref), ("mean", ref.mean())):
        got = dmd2_kernels.flow_matching_loss(v_pred, x0, eps, sigma, space="x0", impl="triton", reduction=reduction)
        assert_close(got, want, torch.float32, tol=LOSS_TOL, msg=reduction)
