"""The DiT in a world of one (TP=1): shapes, adaLN-Zero, parameter count, clear config errors, and a
float64 plain-torch re-implementation of the forward as the reference.

Reference forward (written here from the maths in models/dit/model.py's docstring, reading the model's
weights; megatron linears keep theirs under `.inner.weight` [out, in] / `.inner.bias`):
    tokens = patchify(x)                      [B, S, C p^2],  S = (H/p)^2, row-major patches
    h = tokens W_x^T + b_x + pos              pos: 2-D sin-cos, first half of channels rows
    c = MLP_t(sincos(1000 sigma)) + table[y]  [B, H]
    per block: shift1..gate2 = silu(c) W_ada^T + b  (6 chunks of H)
        h += gate1 * (softmax(q k^T / sqrt(d)) v) W_proj^T + b,  q,k,v from LN(h)(1+scale1)+shift1,
             the qkv output laid out per head as [heads, 3, d]
        h += gate2 * W_2 gelu_tanh(W_1 (LN(h)(1+scale2)+shift2))
    out = unpatchify((LN(h)(1+scale)+shift) W_f^T + b_f)   features per token ordered (c, u, v)
Sinusoidal features are computed in fp32 as the model does (its documented precision), everything
else in float64; the model converted with .double() must agree within 1e-10.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from dmd2_mega.arguments import parse_flow_args
from dmd2_mega.config import ModelConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import DataShape, MODEL_SIZES, build_model, count_parameters, get_spec
from dmd2_mega.models.dit import DiT
from dmd2_mega.distributed.parallel import tp_partition_dim
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def world():
    with world_of_one() as ps:
        yield ps


def make(size="debug", *, seed=0, tp_size=1, num_classes=10, cond_shape=None, image_size=8, channels=1, **kw):
    torch.manual_seed(seed)
    shape = DataShape(channels, image_size, num_classes=num_classes if cond_shape is None else None,
                      cond_shape=cond_shape)
    return build_model(size, shape, tp_size=tp_size, options=ModelConfig(size=size, **kw).options())


def perturb_(model, scale=0.05, seed=1):
    """Make adaLN-Zero's zero matrices non-zero so every branch contributes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def batch(b=3, channels=1, size=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, channels, size, size, generator=g, dtype=dtype)
    sigma = (torch.rand(b, generator=g, dtype=dtype) * 0.98 + 0.01)
    labels = torch.randint(0, 11, (b,), generator=g)
    labels[0] = 10  # the null class
    return x, sigma, labels


# ---- reference ---------------------------------------------------------------------------------

def ref_sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    i = torch.arange(half, dtype=torch.float32)
    w = torch.exp(-math.log(10000.0) * i / half)
    a = pos.float()[:, None] * w[None]
    out = torch.cat([torch.cos(a), torch.sin(a)], dim=1)
    return torch.cat([out, torch.zeros(len(pos), dim - 2 * half)], dim=1)


def ref_pos(grid: int, dim: int) -> torch.Tensor:
    r = torch.arange(grid, dtype=torch.float32).repeat_interleave(grid)  # row of token k = k // grid
    c = torch.arange(grid, dtype=torch.float32).repeat(grid)             # column = k % grid
    return torch.cat([ref_sincos(r, dim // 2), ref_sincos(c, dim - dim // 2)], dim=1)


def ref_forward(model: DiT, x, sigma, cond) -> torch.Tensor:
    w = dict(model.named_parameters())  # differentiable: the reference also gives gradients
    spec = model.spec
    H, heads, p = spec.hidden_size, spec.num_heads, spec.patch_size
    d = H // heads
    B, C, Hi, Wi = x.shape
    g = Hi // p

    def lin(h, name):
        return h @ w[name + ".weight"].T + w[name + ".bias"]

    def ln_mod(h, shift, scale):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(var + 1e-6) * (1 + scale[:, None]) + shift[:, None]

    # patchify: token (i, j) holds x[:, :, i p:(i+1) p, j p:(j+1) p] flattened as (c, u, v)
    tokens = torch.stack([x[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(B, C * p * p)
                          for i in range(g) for j in range(g)], dim=1)
    h = lin(tokens, "x_embed") + ref_pos(g, H).to(x.dtype)
    t = ref_sincos(sigma * 1000.0, spec.freq_dim).to(x.dtype)
    t = lin(F.silu(lin(t, "t_embed.mlp.0")), "t_embed.mlp.2")
    if model.num_classes is not None:
        y = w["y_embed.table.weight"][cond]
    else:
        e = cond.mean(1) if cond.dim() == 3 else cond
        y = lin(F.silu(lin(e.to(x.dtype), "y_embed.mlp.0")), "y_embed.mlp.2")
    c = t + y
    for i in range(spec.num_layers):
        pre = f"blocks.{i}."
        mods = lin(F.silu(c), pre + "adaln.inner").split(H, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        qkv = lin(ln_mod(h, shift1, scale1), pre + "qkv.inner").view(B, -1, heads, 3, d)
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # [B, heads, S, d]
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v
        a = att.transpose(1, 2).reshape(B, -1, H)
        h = h + gate1[:, None] * lin(a, pre + "proj.inner")
        u = lin(ln_mod(h, shift2, scale2), pre + "fc1.inner")
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        h = h + gate2[:, None] * lin(u, pre + "fc2.inner")
    shift, scale = lin(F.silu(c), "final_adaln.inner").split(H, dim=-1)
    out = lin(ln_mod(h, shift, scale), "final")  # [B, S, C p p] as (c, u, v), like the input tokens
    img = torch.zeros_like(x)
    for s in range(g * g):
        i, j = divmod(s, g)
        img[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p] = out[:, s].view(B, C, p, p)
    return img


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("b,channels,size", [(1, 1, 8), (3, 1, 8), (2, 3, 6)])
def test_output_shape(b, channels, size):
    m = make(channels=channels, image_size=size)
    x, sigma, y = batch(b, channels, size)
    out = m(x, sigma, y)
    assert out.shape == (b, channels, size, size) and out.dtype == torch.float32


def test_adaln_zero_fresh_model_outputs_exactly_zero():
    m = make()
    x, sigma, y = batch(4)
    assert torch.count_nonzero(m(x, sigma, y)) == 0
    m2 = make(cond_shape=(3, 5))
    cond = torch.randn(4, 3, 5)
    assert torch.count_nonzero(m2(x, sigma, cond)) == 0
    # ... and yet the zero-initialised final projection gets gradient (the model can leave zero),
    # while everything behind it (its adaLN, the blocks' gates) sees none until it has moved
    ((m(x, sigma, y) - 1.0) ** 2).mean().backward()
    assert m.final.weight.grad.abs().max() > 0
    assert m.final_adaln.weight.grad.abs().max() == 0


def test_count_parameters():
    m = make()
    assert count_parameters(m) == sum(p.numel() for p in m.parameters())
    # closed form for the debug spec (H=32, 2 blocks, patch 2, freq 32, 1 channel, 10 classes)
    s = get_spec("debug")
    H, L, P, Fq, K = s.hidden_size, s.num_layers, s.patch_size ** 2 * 1, s.freq_dim, 10
    block = (6 * H * H + 6 * H) + (3 * H * H + 3 * H) + (H * H + H) + (4 * H * H + 4 * H) + (4 * H * H + H)
    total = L * block + (P * H + H) + (Fq * H + H + H * H + H) + (K + 1) * H + (2 * H * H + 2 * H) + (H * P + P)
    assert count_parameters(m) == total == 42692
    assert all(tp_partition_dim(p) is None for p in m.x_embed.parameters())
    assert tp_partition_dim(m.blocks[0].qkv.weight) == 0 and tp_partition_dim(m.blocks[0].proj.weight) == 1


@pytest.mark.parametrize("cond_kind", ["labels", "embedding"])
def test_float64_reference_forward_and_grads(cond_kind):
    if cond_kind == "labels":
        m = perturb_(make()).double()
        x, sigma, cond = batch(3, dtype=torch.float64)
    else:  # 2 channels, 6x6: also pins the (c, u, v) order inside a patch
        m = perturb_(make(cond_shape=(2, 6), channels=2, image_size=6)).double()
        x, sigma, _ = batch(3, channels=2, size=6, dtype=torch.float64)
        cond = torch.randn(3, 2, 6, dtype=torch.float64)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for fn in (m, lambda *a: ref_forward(m, *a)):
        m.zero_grad(set_to_none=True)
        out = fn(x, sigma, cond)
        ((out - target) ** 2).mean().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (out, g_model), (ref, g_ref) = grads
    assert out.dtype == torch.float64
    assert ref.abs().max() > 0.1, "reference output should be non-trivial after perturbation"
    err = (out - ref).abs().max().item()
    assert err <= 1e-10, f"DiT forward differs from the float64 reference by {err:.3e}"
    for n, g in g_ref.items():
        assert g.abs().max() > 0, f"{n} gets no gradient in the reference"
        e = (g_model[n] - g).abs().max().item()
        assert e <= 1e-10 * max(1.0, g.abs().max().item()), f"grad of {n} differs from the reference by {e:.3e}"


def test_float64_reference_detects_a_wrong_head_layout():
    """The reference is sensitive to the [heads, 3, d] qkv layout: a [3, heads, d] reading differs."""
    m = perturb_(make()).double()
    x, sigma, y = batch(2, dtype=torch.float64)
    w = m.blocks[0].qkv.inner.weight
    with torch.no_grad():
        ref = ref_forward(m, x, sigma, y)
        H = m.spec.hidden_size
        perm = w.view(m.spec.num_heads, 3, H // m.spec.num_heads, H).transpose(0, 1).reshape(3 * H, H).clone()
        w.copy_(perm)
        assert (m(x, sigma, y) - ref).abs().max() > 1e-3


def test_recompute_full_gives_same_output_and_grads():
    x, sigma, y = batch(3)
    outs = []
    for rec in (None, "full"):
        m = perturb_(make(recompute_granularity=rec))
        assert m.options.recompute == (rec or "none")
        out = m(x, sigma, y)
        out.square().mean().backward()
        outs.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_conditioning_matters_after_training():
    """A few AdamW steps on a label-dependent target: outputs must then depend on the label."""
    m = make()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, sigma, _ = batch(8)
    labels = torch.arange(8) % 4
    target = labels.float().view(-1, 1, 1, 1).expand_as(x) / 4
    for _ in range(5):
        loss = F.mse_loss(m(x, sigma, labels), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        a = m(x[:1], sigma[:1], torch.tensor([0]))
        b = m(x[:1], sigma[:1], torch.tensor([3]))
        n = m(x[:1], sigma[:1], m.null_cond(1, x.device))
    assert (a - b).abs().max() > 1e-3 and (a - n).abs().max() > 1e-3


# ---- configuration errors ---------------------------------------------------------------------

def test_unknown_model_size_names_the_flag():
    with pytest.raises(ConfigError, match=r"--model-size 'nope' is unknown"):
        get_spec("nope")
    with pytest.raises(ConfigError, match=r"--model-size") as e:  # rejected at parse time
        parse_flow_args(["--model-size", "nope"])
    for name in MODEL_SIZES:
        assert name in str(e.value)


def test_heads_not_divisible_by_tp():
    assert get_spec("debug").num_heads == 4
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 3 must divide .* heads \(4\)"):
        make(tp_size=3)


def test_image_size_not_multiple_of_patch():
    with pytest.raises(ConfigError, match=r"image size 7 .* patch size 2"):
        make(image_size=7)


@pytest.mark.parametrize("flags,needle", [
    (["--attention-backend", "flash"], "--attention-backend flash"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
])
def test_missing_gpu_packages_are_config_errors(flags, needle):
    cfg = parse_flow_args(flags)
    with pytest.raises(ConfigError) as e:
        build_model(cfg.model.size, DataShape(1, 8, num_classes=10), options=cfg.model.options())
    msg = str(e.value)
    assert needle in msg
    assert ("flash-attn" in msg or "transformer-engine" in msg or "CUDA" in msg), msg


@pytest.mark.parametrize("flags,needle", [
    (["--attention-backend", "xformers"], "--attention-backend"),
    (["--transformer-impl", "apex"], "--transformer-impl"),
    (["--recompute-granularity", "partial"], "--recompute-granularity"),
])
def test_bad_model_flags(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_flow_args(flags)


def test_family_interface_is_enforced():
    """A family model that leaves out an interface method cannot be instantiated (FamilyModel is abstract)."""
    from dmd2_mega.models import FamilyModel

    class VelocityOnly(FamilyModel):
        def forward(self, x, sigma, cond):
            return x

    with pytest.raises(TypeError, match="features, forward_features, null_cond"):
        VelocityOnly()
