"""dmd2_kernels.dmd_loss against a float64 reference written in tianweiy/DMD2's form.

Reference (sd_guidance.py): under no_grad, p_real = x - x0_real, p_fake = x - x0_fake,
norm = mean_n |p_real|, grad = nan_to_num((p_real - p_fake) / norm); loss = 0.5 * mse(x, (x - grad).detach()).
nan_to_num runs in the input dtype's range (posinf/neginf = finfo(dtype).max), as DMD2 computes grad
in the dtype of its tensors.
"""
import pytest
import torch
import torch.nn.functional as F

import dmd2_kernels
from test_kernels_utils import (DEVICE, DTYPES, IMPLS, LOSS_TOL, assert_close, cases, count_launches, dtype_id,
                                f64, grad_tol, randn)


def reference(x, x0_real, x0_fake, dtype):
    """float64 DMD2 surrogate; returns (loss, norm [B], grad_rms, grad)."""
    fmax = torch.finfo(dtype).max
    dims = tuple(range(1, x.dim()))
    with torch.no_grad():
        p_real = x - x0_real
        p_fake = x - x0_fake
        norm = torch.abs(p_real).mean(dim=dims, keepdim=True)
        grad = torch.nan_to_num((p_real - p_fake) / norm, posinf=fmax, neginf=-fmax)
    loss = 0.5 * F.mse_loss(x, (x - grad).detach())
    return loss, norm.flatten(), grad.pow(2).mean().sqrt(), grad


def inputs(B, shape, dtype):
    x0hat = randn(B, shape, dtype, 0)
    x0_real = (x0hat.float() + 0.3 * randn(B, shape, torch.float32, 1)).to(dtype)
    x0_fake = (x0_real.float() + 0.1 * randn(B, shape, torch.float32, 2)).to(dtype)
    return x0hat.requires_grad_(), x0_real, x0_fake


def check(x0hat, x0_real, x0_fake, dtype, impl, grad_scale=0.7):
    loss, stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl=impl)
    assert loss.shape == () and loss.dtype == torch.float32
    assert stats.norm.shape == (x0hat.shape[0],) and stats.grad_rms.shape == ()
    (gx,) = torch.autograd.grad(loss, x0hat, torch.tensor(grad_scale, device=loss.device))
    assert gx.dtype == dtype and torch.isfinite(gx).all()

    x64, r64, f64_ = f64(x0hat, x0_real, x0_fake)
    rloss, rnorm, rrms, _ = reference(x64, r64, f64_, dtype)
    (rgx,) = torch.autograd.grad(rloss, x64, torch.tensor(grad_scale, dtype=torch.float64, device=rloss.device))
    # the float32 loss of a clamped (+-max) float32 gradient overflows to inf, as DMD2's does
    assert_close(loss, rloss.float(), dtype, tol=LOSS_TOL, msg="loss")
    assert_close(stats.norm, rnorm, dtype, tol=LOSS_TOL, msg="norm")
    # float32 statistics: sqrt(mean(grad^2)) overflows to inf exactly when the float32 loss does
    rrms = rrms if torch.isfinite(rloss.float()) else rloss.new_tensor(float("inf"))
    assert_close(stats.grad_rms, rrms.float(), dtype, tol=LOSS_TOL, msg="grad_rms")
    assert_close(gx, rgx, dtype, tol=grad_tol(dtype, rgx), msg="grad x0hat")
    return gx


@pytest.mark.parametrize("B,shape,dtype,impl", cases())
def test_dmd_loss(B, shape, dtype, impl):
    check(*inputs(B, shape, dtype), dtype, impl)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on 0/0 and inf * inf
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dmd_nan_inf_and_zero_norm(dtype, impl):
    """NaN/Inf in x0_fake or x0_real, and a sample with x0hat == x0_real, give a finite gradient."""
    x0hat, x0_real, x0_fake = (t.detach().clone() for t in inputs(5, (3, 7, 5), dtype))
    x0_fake[0, 0, 0, 0] = float("nan")  # NaN grad entry -> 0
    x0_fake[1, 0, 1, 2], x0_fake[1, 2, 6, 4] = float("inf"), float("-inf")  # -> +-max
    x0_real[2, 1, 2, 3] = float("nan")  # NaN norm: the whole sample -> 0
    x0hat[3] = x0_real[3]  # norm 0: grad +-max, and 0/0 -> 0 where fake == real
    x0_fake[3, 0, 0, 0] = x0_real[3, 0, 0, 0]
    x0_real[4, 0, 0, 0] = float("inf")  # inf norm: the whole sample -> 0
    gx = check(x0hat.requires_grad_(), x0_real, x0_fake, dtype, impl)
    assert (gx[0] != 0).any() and gx[0, 0, 0, 0] == 0
    assert (gx[2] == 0).all() and (gx[4] == 0).all()
    same = x0_fake[3] == x0_real[3]  # [0, 0, 0] and, in 16-bit dtypes, a few rounding ties
    assert same[0, 0, 0] and torch.equal(gx[3] == 0, same)
    assert (gx[3][~same].abs() == gx[3].abs().max()).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_dmd_targets_get_no_grad(impl):
    x0hat, x0_real, x0_fake = inputs(2, (3, 4), torch.float32)
    x0_real.requires_grad_()
    loss, _ = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl=impl)
    loss.backward()
    assert x0hat.grad is not None and x0_real.grad is None


def test_dmd_backward_float64_torch_path():
    """gradcheck does not apply here: the surrogate's backward is by definition not the derivative
    of its value (norm and grad depend on x0hat but are held constant). Instead the Function's
    float64 backward must equal autograd through the DMD2 expression, for several grad_out."""
    x0hat, x0_real, x0_fake = (t.detach().double() for t in inputs(3, (2, 3, 5), torch.float32))
    x0hat.requires_grad_()
    for s in (1.0, -2.5, 0.0):
        loss, stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl="torch")
        (gx,) = torch.autograd.grad(loss, x0hat, torch.tensor(s, dtype=torch.float64, device=loss.device))
        rloss, rnorm, _, rgrad = reference(x0hat, x0_real, x0_fake, torch.float64)
        (rgx,) = torch.autograd.grad(rloss, x0hat, torch.tensor(s, dtype=torch.float64, device=loss.device))
        torch.testing.assert_close(loss, rloss, atol=1e-14, rtol=1e-12)
        torch.testing.assert_close(stats.norm, rnorm, atol=1e-14, rtol=1e-12)
        torch.testing.assert_close(gx, rgx, atol=1e-16, rtol=1e-12)
        torch.testing.assert_close(gx, s * rgrad / rgrad.numel(), atol=1e-16, rtol=1e-12)


# ------------------------------------------------------------------ launches, determinism, the final reduction

# The torch path's aten ops for float32 inputs (kernels/dmd2_kernels/dmd.py docstring): forward sub, abs, mean | sub,
# div, nan_to_num | square, mean, mul, sqrt; backward one scalar divide and one multiply (grad is kept from the
# forward).
TORCH_OPS = {"fwd": 10, "bwd": 2}


@pytest.mark.parametrize("impl", IMPLS)
def test_dmd_loss_launches(impl, monkeypatch):
    """A property, not a timing: the Triton path is 2 kernels forward and 1 backward with no other op (the old
    path was 4 + 4 allocations forward, and 2 zero fills backward), the torch path at most TORCH_OPS aten ops."""
    x0hat, x0_real, x0_fake = inputs(3, (4, 33, 17), torch.float32)
    fwd, (loss, stats) = count_launches(monkeypatch, lambda: dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl=impl))
    grad_out = torch.tensor(0.7, device=loss.device)
    bwd, _ = count_launches(monkeypatch, lambda: torch.autograd.grad(loss, x0hat, grad_out))
    if impl == "triton":
        assert dict(fwd.kernels) == {"_dmd_norm_kernel": 1, "_dmd_fwd_kernel": 1} and not fwd.ops, fwd.ops
        assert dict(bwd.kernels) == {"_dmd_bwd_kernel": 1} and not bwd.ops, bwd.ops
    else:
        assert not fwd.kernels and fwd.total() <= TORCH_OPS["fwd"], fwd.ops
        assert bwd.total() <= TORCH_OPS["bwd"], bwd.ops


@pytest.mark.parametrize("impl", IMPLS)
def test_dmd_loss_is_deterministic(impl):
    """Bit-exact across calls (same inputs, same path): the partial sums are added in a fixed order, whichever
    program of the Triton path draws the last ticket; exact resume relies on it."""
    x0hat, x0_real, x0_fake = inputs(3, (16, 40, 40), torch.float32)
    runs = []
    for _ in range(2):
        loss, stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl=impl)
        runs.append((loss, stats.norm, stats.grad_rms, *torch.autograd.grad(loss, x0hat)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_dmd_loss_many_partials(monkeypatch):
    """Tiles of 16 elements: launch 1 loops over several tiles per program (P = 2 programs of 7 tiles per row), and
    the last ticket's program adds 39 partials in two steps of 32; the result still matches the reference."""
    from dmd2_kernels import dmd
    monkeypatch.setattr(dmd, "block_for", lambda n: 16)
    monkeypatch.setattr(dmd, "FINAL_BLOCK", 32)
    assert dmd._split(3, 5 * 41, torch.device(DEVICE))[:2] == ((2, 112) if DEVICE == "cpu" else (13, 16))
    check(*inputs(3, (5, 41), torch.float32), torch.float32, "triton")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with compiled Triton (TRITON_INTERPRET=0)")
def test_dmd_loss_last_ticket_on_gpu():
    """On a GPU the programs of launch 2 (128 here, on every SM) race for the last ticket: the memory ordering
    (barrier, acq_rel atomic) must let its program see every partial. 50 calls are bit-identical and agree with the
    torch path; the interpreter runs programs one after another and cannot show a race."""
    x0hat, x0_real, x0_fake = (t.detach() for t in inputs(8, (4, 128, 128), torch.float32))
    want, want_stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl="torch")
    first = None
    for _ in range(50):
        loss, stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0_fake, impl="triton")
        got = torch.stack([loss, stats.grad_rms, *stats.norm])
        first = got if first is None else first
        assert torch.equal(got, first)
    assert_close(first, torch.stack([want, want_stats.grad_rms, *want_stats.norm]), torch.float32, tol=LOSS_TOL)
