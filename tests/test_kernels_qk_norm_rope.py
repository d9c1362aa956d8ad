"""dmd2_kernels.qk_norm_rope (Wan's q/k RMSNorm across heads + interleaved RoPE, TP-aware) against a float64
reference, diffusers' WanAttention, and its own G = 1 result at TP = 2 (tests/mp_scripts/qk_norm_rope_tp.py)."""
import json
import os

import pytest
import torch

import dmd2_kernels
from dmd2_kernels import _utils
from test_kernels_utils import DEVICE, IMPLS, TOL, assert_close, dtype_id, f64
from tests.utils import MP_SCRIPTS, torchrun

INTEGRATION_FIXTURES = ("tp2",)  # fixtures that launch processes: their tests are marked integration

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# (B, S, heads, head_dim): odd sizes; HL = 36 and 192 are not powers of two (3 column tiles of 16 / 64);
# (1, 200, 3, 64) splits the rows over backward programs that each loop over several row tiles.
SHAPES = [(1, 1, 2, 8), (3, 7, 3, 12), (1, 33, 3, 12), (3, 33, 2, 8), (1, 200, 3, 64)]


def reference(x, weight, cos, sin, head_dim):
    """float64 from the definition: RMS over the whole last dim, * weight, then rotate each (2j, 2j + 1) pair."""
    z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight
    if cos is None:
        return z
    B, S, HL = x.shape
    ze, zo = z.view(B, S, HL // head_dim, head_dim // 2, 2).unbind(-1)
    c, s = cos.double()[None, :, None], sin.double()[None, :, None]
    return torch.stack((ze * c - zo * s, ze * s + zo * c), -1).view(B, S, HL)


def make_inputs(B, S, heads, head_dim, dtype, rope, seed=0):
    g = torch.Generator().manual_seed(seed)
    HL = heads * head_dim
    x = 3.0 * torch.randn(B, S, HL, generator=g)
    w = 1.0 + 0.5 * torch.randn(HL, generator=g)
    dy = torch.randn(B, S, HL, generator=g)
    ang = 6.0 * torch.rand(S, head_dim // 2, generator=g)
    cos, sin = (ang.cos().to(DEVICE), ang.sin().to(DEVICE)) if rope else (None, None)
    return (x.to(DEVICE, dtype).requires_grad_(), w.to(DEVICE, dtype).requires_grad_(), cos, sin,
            dy.to(DEVICE, dtype))


def qk_cases():
    return [pytest.param(shape, dtype, rope, impl, id=f"B{shape[0]}-S{shape[1]}-H{shape[2]}-D{shape[3]}-"
                         f"{dtype_id(dtype)}-{'rope' if rope else 'norope'}-{impl}")
            for impl in IMPLS for dtype in DTYPES for rope in (True, False) for shape in SHAPES]


@pytest.mark.parametrize("shape,dtype,rope,impl", qk_cases())
def test_qk_norm_rope(shape, dtype, rope, impl):
    B, S, heads, D = shape
    x, w, cos, sin, dy = make_inputs(B, S, heads, D, dtype, rope)
    y = dmd2_kernels.qk_norm_rope(x, w, cos, sin, D, eps=EPS, impl=impl)
    assert y.dtype == dtype and y.shape == x.shape
    gx, gw = torch.autograd.grad(y, (x, w), dy)

    x64, w64 = f64(x, w)
    ref = reference(x64, w64, cos, sin, D)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dy.double())
    assert_close(y, ref, dtype, msg="y")
    assert_close(gx, rx, dtype, msg="grad x")
    atol, rtol = TOL[dtype]  # dweight sums over B * S rows: tolerance relative to the sum's size
    assert_close(gw, rw, dtype, tol=(atol * (B * S) ** 0.5, rtol), msg="grad weight")
    assert (gx.dtype, gw.dtype) == (dtype, dtype)


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "norope"])
def test_ref_matches_definition(rope):
    x, w, cos, sin, dy = make_inputs(3, 7, 3, 12, torch.float64, rope)
    y = dmd2_kernels.qk_norm_rope_ref(x, w, cos, sin, 12, eps=EPS)
    assert_close(y, reference(x, w, cos, sin, 12), torch.float32, tol=(1e-12, 1e-12))
    g = torch.autograd.grad(y, (x, w), dy)
    r = torch.autograd.grad(reference(x, w, cos, sin, 12), (x, w), dy)
    for a, b in zip(g, r):
        assert_close(a, b, torch.float32, tol=(1e-12, 1e-12))


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_diffusers_wan_attention(impl, monkeypatch):
    """q and k as diffusers' WanAttnProcessor makes them (norm_q / norm_k, then its apply_rotary_emb with the
    [1, S, 1, D] tables of get_1d_rotary_pos_embed(repeat_interleave_real=True)) equal the op with cos, sin =
    the tables' even columns; the attention call is replaced to capture them."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    from diffusers.models.transformers import transformer_wan

    B, S, heads, D = 2, 9, 3, 8
    torch.manual_seed(0)
    attn = transformer_wan.WanAttention(dim=20, heads=heads, dim_head=D, eps=1e-6,
                                        processor=transformer_wan.WanAttnProcessor()).to(DEVICE)
    with torch.no_grad():
        attn.norm_q.weight.normal_(1.0, 0.5)
        attn.norm_k.weight.normal_(1.0, 0.5)
    freqs_cos, freqs_sin = get_1d_rotary_pos_embed(D, S, theta=10000.0, use_real=True, repeat_interleave_real=True)
    freqs_cos, freqs_sin = freqs_cos.to(DEVICE), freqs_sin.to(DEVICE)
    captured = {}

    def capture(query, key, value, **kwargs):
        captured.update(q=query, k=key)
        return query

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", capture)
    h = torch.randn(B, S, 20, device=DEVICE)
    with torch.no_grad():
        attn(h, rotary_emb=(freqs_cos[None, :, None], freqs_sin[None, :, None]))
        cos, sin = freqs_cos[:, 0::2], freqs_sin[:, 0::2]
        for proj, norm, key in ((attn.to_q, attn.norm_q, "q"), (attn.to_k, attn.norm_k, "k")):
            y = dmd2_kernels.qk_norm_rope(proj(h), norm.weight, cos, sin, D, eps=norm.eps, impl=impl)
            assert_close(y, captured[key].flatten(2), torch.float32, msg=key)
            assert float((captured[key].flatten(2) - norm(proj(h))).abs().max()) > 0.1  # the rotary is not a no-op


def test_gradcheck_torch_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 12, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)
    ang = torch.rand(3, 3, dtype=torch.float64, generator=g) * 6
    fn = lambda a, b: dmd2_kernels.qk_norm_rope(a, b, ang.cos(), ang.sin(), 6, impl="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))


def test_tiles_cover_wan_widths():
    """Column tiles are whole pairs, and non-power-of-two widths (Wan2.1-1.3B's HL = 1536 = 12 heads of 128, its
    TP slices, 14B's 5120) leave at most 1/8 of the lanes idle; the test shapes above run 3 column tiles."""
    from dmd2_kernels.qk_norm_rope import _tile
    assert _tile(1536)[1] == 512 and _tile(36)[1] == 16 and _tile(192)[1] == 64 and _tile(128)[1] == 128
    for hl in [640, 768, 1536, 2560, 3072, 5120] + list(range(128, 6000, 22)):  # below 128 the 16-lane floor binds
        rows, block, _ = _tile(hl)
        tiles = -(-hl // block)
        assert block % 2 == 0 and tiles * block >= hl and tiles * block - hl <= hl // 8, (hl, block)
        assert rows * block <= 4096 or rows == 1


def test_bad_arguments():
    x = torch.randn(2, 3, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    cs = torch.ones(3, 4, device=DEVICE)
    with pytest.raises(dmd2_kernels.KernelError, match="multiple of head_dim"):
        dmd2_kernels.qk_norm_rope(x, w, None, None, 6)
    with pytest.raises(dmd2_kernels.KernelError, match="even"):
        dmd2_kernels.qk_norm_rope(torch.randn(2, 3, 15, device=DEVICE), torch.ones(15, device=DEVICE), None, None, 5)
    with pytest.raises(dmd2_kernels.KernelError, match="weight must be"):
        dmd2_kernels.qk_norm_rope(x, torch.ones(8, device=DEVICE), None, None, 8)
    with pytest.raises(dmd2_kernels.KernelError, match="both"):
        dmd2_kernels.qk_norm_rope(x, w, cs, None, 8)
    with pytest.raises(dmd2_kernels.KernelError, match=r"cos must be a float \[S, head_dim // 2\]"):
        dmd2_kernels.qk_norm_rope(x, w, torch.ones(3, 8, device=DEVICE), cs, 8)
    with pytest.raises(dmd2_kernels.KernelError, match=r"\[B, S, heads \* head_dim\]"):
        dmd2_kernels.qk_norm_rope(x[0], w, None, None, 8)
    with pytest.raises(dmd2_kernels.KernelError, match="requires grad|require grad"):
        dmd2_kernels.qk_norm_rope(x, w, cs.clone().requires_grad_(), cs, 8)


# ---- TP = 2 (gloo, CPU tensors): each rank holds half of the heads ------------------------------

TP_IMPLS = "torch,triton" if _utils.INTERPRET else "torch"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("qk_tp2")
    torchrun(2, os.path.join(MP_SCRIPTS, "qk_norm_rope_tp.py"), ["--out", str(d), "--impls", TP_IMPLS],
             timeout=120).check("qk_norm_rope TP=2")
    return [json.load(open(d / f"{r}.json")) for r in range(2)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("impl", [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not _utils.INTERPRET, reason="the TP script runs gloo on CPU tensors: the Triton path needs the interpreter")),
])
def test_tp2_matches_tp1_sliced(tp2, impl):
    """y, dx and dweight of a rank holding half of the heads equal the G = 1 result sliced; the norm over
    the local heads alone (group=None) does not, so the all-reduces are what make it right."""
    for log in tp2:
        assert log["world"] == 2
        for rope in ("rope", "norope"):
            r = log["results"][impl][rope]
            assert max(r["y"], r["dx"], r["dweight"]) <= 1e-5, (rope, r)
            assert r["local_only"] > 1e-2, (rope, r)
