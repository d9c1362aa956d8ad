"""dmd2_kernels.adaln_modulate (LayerNorm without affine + adaLN shift/scale) against a float64 reference."""
import pytest
import torch

import dmd2_kernels
from test_kernels_utils import BATCHES, DTYPES, IMPLS, SHAPES, TOL, assert_close, case_id, f64, randn

EPS = 1e-6
# per-sample [T..., H]; (40, 96) splits one sample's rows over several backward programs
ADALN_SHAPES = SHAPES + [(40, 96)]
LARGE = (256, 1024)  # 2^18 elements per sample


def reference(x, shift, scale):
    """float64 from the definition: biased variance over the last dim, then (1 + scale), + shift."""
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    xhat = (x - mean) / torch.sqrt(var + EPS)
    return xhat * (1 + scale.reshape(view)) + shift.reshape(view)


def adaln_cases():
    out = [pytest.param(B, s, d, i, id=case_id(B, s, d, i))
           for i in IMPLS for d in DTYPES for B in BATCHES for s in ADALN_SHAPES]
    return out + [pytest.param(1, LARGE, torch.float32, i, id=case_id(1, LARGE, torch.float32, i)) for i in IMPLS]


@pytest.mark.parametrize("B,shape,dtype,impl", adaln_cases())
def test_adaln_modulate(B, shape, dtype, impl):
    H = shape[-1]
    x = (2.0 + 3.0 * randn(B, shape, torch.float32, 0)).to(dtype).requires_grad_()  # off-centre, wide
    shift = randn(B, (H,), dtype, 1).requires_grad_()
    scale = randn(B, (H,), dtype, 2, scale=0.5).requires_grad_()
    y = dmd2_kernels.adaln_modulate(x, shift, scale, eps=EPS, impl=impl)
    assert y.dtype == dtype and y.shape == x.shape
    dy = randn(B, shape, dtype, 3)
    gx, gshift, gscale = torch.autograd.grad(y, (x, shift, scale), dy)

    x64, sh64, sc64 = f64(x, shift, scale)
    ref = reference(x64, sh64, sc64)
    rx, rshift, rscale = torch.autograd.grad(ref, (x64, sh64, sc64), dy.double())
    assert_close(y, ref, dtype, msg="y")
    assert_close(gx, rx, dtype, msg="grad x")
    # dshift, dscale sum over T rows: tolerance relative to the sum's size
    atol, rtol = TOL[dtype]
    rows = x.numel() // (B * H)
    assert_close(gshift, rshift, dtype, tol=(atol * rows ** 0.5, rtol), msg="grad shift")
    assert_close(gscale, rscale, dtype, tol=(atol * rows ** 0.5, rtol), msg="grad scale")
    assert (gx.dtype, gshift.dtype, gscale.dtype) == (dtype, dtype, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_adaln_broadcast_layout(impl):
    """shift/scale given as [B, 1, H] (as a DiT's chunked adaLN output) equal the [B, H] result."""
    x = randn(3, (10, 24), torch.float32, 0)
    shift, scale = randn(3, (1, 24), torch.float32, 1), randn(3, (1, 24), torch.float32, 2)
    a = dmd2_kernels.adaln_modulate(x, shift, scale, impl=impl)
    b = dmd2_kernels.adaln_modulate(x, shift[:, 0], scale[:, 0], impl=impl)
    assert_close(a, b, torch.float32, tol=(0, 0))
    assert_close(a, reference(*f64(x, shift, scale)), torch.float32)


def test_adaln_gradcheck_torch_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    shift = torch.randn(2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    scale = torch.randn(2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda a, b, c: dmd2_kernels.adaln_modulate(a, b, c, impl="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, shift, scale))


def test_tiles_leave_at_most_an_eighth_of_the_lanes_idle():
    """Non-power-of-two hidden sizes are tiled, not padded (DiT-XL's 1152 padded to 2048 idled 44% of the lanes);
    the test shapes above (H = 17, 96) run the tiled kernels, H = 5, 1024 the one-tile ones."""
    from dmd2_kernels.adaln import _tile
    assert _tile(1152)[1:] == (256, 8, 5)
    assert _tile(1024)[3] == _tile(5)[3] == 1 and _tile(17)[3] == 2 and _tile(96)[3] == 3
    for h in list(range(128, 3000, 7)) + [768, 1152, 1536, 3072, 5120]:  # below 128 the 16-lane floor binds
        rows, block_h, _, tiles = _tile(h)
        assert tiles * block_h >= h and (tiles - 1) * block_h < h
        assert tiles * block_h - h <= h // 8, (h, block_h, tiles)
        assert rows * block_h <= 4096 or rows == 1
